"""The compiled step checks its inputs before it writes state (issue 20, "validate before writing").

A decode step writes state in place at rows the caller picks: the state row of each request
(`slots`), the cache rows from each request's position (`positions`), after reading embedding rows
(`input_ids`). Eager torch checks none of it: a negative slot wraps round to another request's
row, duplicate slots race, a negative position reads garbage, and a position past the cache
raises halfway through the step, after earlier layers wrote their state. The compiled step checks
first and raises a `ValueError` naming the argument.

**Roles, from the graph.** Read once per compiled graph off the functional ATen graph the first
bucket enters the pipeline with, never from argument names (a foreign spelling gets the same
checks). A caller's input whose values reach an index operand (`index`, `index_put`,
`index_copy`, `index_select`, `embedding`, `gather`, `scatter`, ...) through views, integer casts
and added constants or aranges (T verify rows: `positions + arange(T)`) is
  * a **slot** input where it indexes dim 0 of a state buffer (a graph input written in place):
    values in [0, rows), pairwise distinct, and never the scratch slot (the last row, or
    `Options.scratch_slot`) where something else writes it: a bucketed graph's padding rows, the
    device-side check, or padding the options announce (a static graph checked on the host
    takes the last row, as eager does);
  * a **position** input where it indexes another dim of a state buffer (a cache's sequence dim):
    value + offset in range for every offset the graph adds ([0, max_seq_len - T]);
  * an **id** input where it indexes an embedding's rows ([0, vocab)); any other index input
    (a lookup table) in range of the dim it indexes.
Every checked input has an integer dtype, and the checked inputs agree on dim 0 (the batch). A
role the graph does not show is logged once and not checked: a valid call is never refused.

**Where the check runs** (`Options.validate`, `K3_VALIDATE`):
  * `host` (`auto` on CPU): before the step, on the host. A rejected call ran nothing: every
    state buffer is bit-equal, and the error lists the bad values.
  * `device` (`auto` on CUDA; on CPU it runs the same code, for the tests): a host check would
    synchronise every step, so the check is part of the step (inside its CUDA graph; on CUDA one
    Inductor-compiled function per bucket, a few fused kernels, not ~8 per input; with
    `K3_CHECK_KERNEL` one CuTe kernel launch, kernels/input_check.py, where it takes the
    limits, else Inductor's with the reason logged once). It computes
    a bitmask of failed checks on the device; where it is nonzero, every checked input is replaced
    by a safe value (slots by the scratch slot, the others by their lowest valid value), so the
    step writes only the scratch row and no request's state changes. The host copies the mask
    back asynchronously (pinned memory and an event) and raises at the first call that finds the
    step finished: on CPU that call itself, on CUDA normally the next call (which then does not
    run), or `InputChecks.wait()`. The error names the failed checks, not the values (those are
    gone). The scratch row is the one thing a rejected device-checked step changes: it holds no
    request's state (padding rows write it at every padded step). Without a slot input the writes
    cannot be redirected, so such a graph is checked on the host.
  * `off`: no checks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile import stage_cache
from k3compile.calls import integer_dtype, structure_error
from k3compile.canonical import paged_write
from k3compile.graph import written_in_place
from k3compile.observe import Observer
from k3compile.settings import KERNELS

log = logging.getLogger("k3compile")

aten, prims = torch.ops.aten, torch.ops.prims

# ops whose output holds (a subset of) the input's values, unchanged
_SAME_VALUES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default,
    aten.clone.default, aten.alias.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.slice.Tensor, aten.select.int, aten.repeat.default,
    aten.flatten.using_ints, aten.lift_fresh_copy.default, aten._to_copy.default,
    prims.convert_element_type.default,
}
_ADD = {aten.add.Tensor, aten.add.Scalar}
_SUB = {aten.sub.Tensor, aten.sub.Scalar}
# functional writes: their output is their first input, rewritten
_WRITES = {aten.index_put.default, aten._unsafe_index_put.default, aten.index_copy.default,
           aten.scatter.src, aten.scatter.value, aten.slice_scatter.default,
           aten.select_scatter.default, aten.index_fill.int_Scalar, aten.index_add.default}

RANGE, SCRATCH, DUPLICATE = 0, 1, 2  # a limit's checks, bit 3 * k + check of the device mask
_CHECKS = ("out of range", "holds the scratch slot", "holds duplicates")


@dataclasses.dataclass(frozen=True)
class Limit:
    """What one input of the step may hold."""

    index: int  # its position among the graph's inputs
    name: str  # the argument as the caller wrote it
    role: str  # "slots", "positions", "ids" or "index"
    lo: int
    hi: int  # every value in [lo, hi]
    why: str  # where the bound comes from, for the error
    batched: bool  # dim 0 is the (possibly padded) batch
    scratch: int | None = None  # slots: the padding rows' slot, which no request may use


@dataclasses.dataclass(frozen=True)
class _Use:
    dim: int
    size: int
    lo_off: int
    hi_off: int
    state: bool  # the indexed tensor is a state buffer (a graph input written in place)
    embedding: bool


# ---- analysis (once per compiled graph) ----------------------------------------------------------

def analyse(graph: fx.Graph, inputs: Sequence, scratch: int | None = None,
            quiet: bool = False) -> list[Limit]:
    """The limits of the caller's inputs (`inputs`: the backend's `_Input`s, in placeholder
    order), read off the ATen graph's index operands; `quiet`: no warning for a missing role."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    callers = {placeholders[i.index]: i for i in inputs if i.user and i.index < len(placeholders)}
    reach: dict[fx.Node, tuple[int, int, int]] = {n: (i.index, 0, 0) for n, i in callers.items()}
    uses: dict[int, list[_Use]] = collections.defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for dim, index, source in _index_operands(node):
            if _reached(index, reach) and (use := _use(node, dim, source, reach[index], callers)):
                uses[reach[index][0]].append(use)
            elif dim == 0:
                for k, use in _flat_uses(node, index, source, reach, callers):
                    uses[k].append(use)
        if (carried := _carried(node, reach)) is not None:
            reach[node] = carried
    by_index = {i.index: i for i in inputs}
    limits = [_limit(by_index[k], u, scratch) for k, u in sorted(uses.items())]
    if not quiet:
        _log_missing(limits)
    return limits


def _carried(node: fx.Node, reach) -> tuple[int, int, int] | None:
    """(input, lo, hi): node's values are that input's plus an offset in [lo, hi]."""
    args = node.args
    if not args or not _is_integer(node):
        return None
    if node.target in _SAME_VALUES and _reached(args[0], reach):
        return reach[args[0]]
    if node.target in _ADD | _SUB and len(args) == 2:
        pairs = [(args[0], args[1])] + ([(args[1], args[0])] if node.target in _ADD else [])
        for a, b in pairs:
            if _reached(a, reach) and (off := _constant_range(b)) is not None:
                k, lo, hi = reach[a]
                alpha = node.kwargs.get("alpha", 1)
                lo_b, hi_b = sorted((off[0] * alpha, off[1] * alpha))
                if node.target in _SUB:
                    return k, lo - hi_b, hi - lo_b
                return k, lo + lo_b, hi + hi_b
    return None


def _constant_range(value: Any) -> tuple[int, int] | None:
    """The smallest and largest value of a literal, an arange/iota, or a view of one."""
    if isinstance(value, bool) or not isinstance(value, (int, fx.Node)):
        return None
    if isinstance(value, int):
        return value, value
    if value.op != "call_function":
        return None
    a, kw = value.args, value.kwargs
    if value.target is prims.iota.default:
        start, step, length = kw.get("start", 0), kw.get("step", 1), a[0]
        return _span(start, start + step * length, step)
    if value.target is aten.arange.default:
        return _span(0, a[0], 1)
    if value.target is aten.arange.start:
        return _span(a[0], a[1], 1)
    if value.target is aten.arange.start_step:
        return _span(a[0], a[1], a[2])
    if value.target in _SAME_VALUES and a:
        return _constant_range(a[0])
    return None


def _span(start, end, step) -> tuple[int, int] | None:
    if not all(isinstance(v, int) for v in (start, end, step)) or step == 0:
        return None
    values = range(start, end, step)
    return (min(values[0], values[-1]), max(values[0], values[-1])) if len(values) else None


def _index_operands(node: fx.Node) -> Iterator[tuple[int, Any, Any]]:
    """(dim, index operand, indexed tensor) of an indexing op, read off its schema: a list of
    `indices` (one per dim), one `indices` tensor (an embedding's rows), or `index` with `dim`."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return
    bound = {arg.name: node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
             for k, arg in enumerate(schema.arguments)}
    source = bound[schema.arguments[0].name]
    indices, dim = bound.get("indices"), bound.get("dim")
    if isinstance(indices, (list, tuple)):
        yield from ((d, idx, source) for d, idx in enumerate(indices))
    elif indices is not None:
        yield (dim if isinstance(dim, int) else 0), indices, source
    elif bound.get("index") is not None and isinstance(dim, int):
        yield dim, bound["index"], source


def _use(node: fx.Node, dim: int, source: Any, reached: tuple[int, int, int],
         callers) -> _Use | None:
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    dim = dim % val.dim()
    size = val.shape[dim]
    if not isinstance(size, int):
        return None
    root = _root(source)
    state = root.op == "placeholder" and root not in callers and written_in_place(root)
    return _Use(dim, size, reached[1], reached[2], state, node.target is aten.embedding.default)


def _flat_uses(node: fx.Node, index: Any, source: Any, reach, callers) -> list[tuple[int, _Use]]:
    """A cache [S, L, ...] viewed as [S * L, ...] rows and indexed at `slot * L + position` (a
    paged slot mapping, rule `paged_write`): the slot indexes dim 0 of the cache, the position
    dim 1."""
    if not isinstance(index, fx.Node) or not isinstance(source, fx.Node) or source.op != (
            "call_function") or source.target not in paged_write.VIEWS:
        return []
    cache = source.args[0]
    shape, flat = (tuple(getattr(t.meta.get("val"), "shape", ())) for t in (cache, source))
    if len(shape) < 3 or not all(isinstance(d, int) for d in shape) or flat != (
            shape[0] * shape[1], *shape[2:]):
        return []
    while index.target in (aten.expand.default, aten.unsqueeze.default):  # a scatter's row index
        index = index.args[0]  # (the flat mapping broadcast over the row: the same values)
    found = paged_write.slot_and_position(index, shape[1])
    if found is None:
        return []
    parts = ((found[0], 0), (found[1], 1))
    return [(reach[t][0], use) for t, d in parts
            if _reached(t, reach) and (use := _use(node, d, cache, reach[t], callers))]


def _root(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _SAME_VALUES | _WRITES and node.args:
        node = node.args[0]
    return node


def _limit(inp, uses: list[_Use], scratch: int | None) -> Limit:
    name = arg_name(inp.name)
    bound = min(uses, key=lambda u: u.size - 1 - u.hi_off)
    lo = max(-u.lo_off for u in uses)
    hi = bound.size - 1 - bound.hi_off
    rows = [u.size for u in uses if u.state and u.dim == 0]
    if rows:
        scratch = min(rows) - 1 if scratch is None else scratch
        why = f"the state buffers have {min(rows)} rows; {scratch} is the scratch slot"
        return Limit(inp.index, name, "slots", lo, hi, why, inp.batched, scratch)
    if caches := [u for u in uses if u.state]:
        c = min(caches, key=lambda u: u.size - 1 - u.hi_off)
        rows = f"rows {name} to {name} + {c.hi_off}" if c.hi_off else f"row {name}"
        why = f"the step writes {rows} of a state buffer's dim {c.dim} of {c.size}"
        return Limit(inp.index, name, "positions", lo, hi, why, inp.batched)
    role = "ids" if any(u.embedding for u in uses) else "index"
    why = (f"the embedding has {bound.size} rows" if role == "ids"
           else f"it indexes dim {bound.dim} ({bound.size}) of a tensor")
    return Limit(inp.index, name, role, lo, hi, why, inp.batched)


def _log_missing(limits: list[Limit]) -> None:
    roles = {lim.role for lim in limits}
    missing = {"slots": "no input indexes the rows of a state buffer",
               "positions": "no input indexes a state buffer's sequence dim",
               "ids": "no input indexes an embedding"}
    for role, what in missing.items():
        if role not in roles:
            log.warning("k3 input checks: %s, so no input is checked as %s", what, role)


def arg_name(placeholder: str) -> str:
    """Dynamo's placeholder name (`l_input_ids_`) as the caller wrote the argument."""
    return re.sub(r"^l_(kwargs_)?|_$", "", placeholder)


def _is_integer(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and integer_dtype(val.dtype)


def _reached(arg: Any, reach) -> bool:
    return isinstance(arg, fx.Node) and arg in reach


# ---- the checks (every call) ---------------------------------------------------------------------

class InputChecks:
    """The backend's hooks: `analysing` around a bucket's compile, `guard` on its compiled step,
    `before` / `after` around each run, `before_eager` for a batch that runs uncompiled."""

    def __init__(self, inputs: Sequence, setting: str, scratch: int | None, pads: bool):
        """`pads`: padding rows may use the scratch slot (a bucketed graph, or a scratch slot the
        options name), so no request may."""
        self.inputs, self.setting, self.scratch, self.pads = inputs, setting, scratch, pads
        self.limits: list[Limit] | None = None  # None: not analysed yet
        self.mode: str | None = None  # "host", "device" or "off", fixed at the first guard
        self.steps = 0
        self._rows: torch.Tensor | None = None  # device path: the real (unpadded) batch, as read
        self._mask: torch.Tensor | None = None  # device path: the last step's failed checks
        self._row_count = RowCount()
        self._pending: collections.deque = collections.deque()  # (pinned mask, event, step)
        self._pinned: list[torch.Tensor] = []
        # the device check compiled by Inductor: None on CUDA only, True always (tests), False never
        self.compiled: bool | None = None
        # what runs the device check of the last bucket compiled: "torch" (eager), "inductor" or
        # "kernel" (K3_CHECK_KERNEL); None: no device check
        self.redirect_by: str | None = None

    # ---- compile time

    @contextlib.contextmanager
    def analysing(self, observer: Observer) -> Iterator[None]:
        """Analyse the ATen graph the first compile of this graph hands its first stage (also
        where nothing is checked: the backend pads the slot input found here)."""
        if self.limits is not None:
            yield
            return

        def listen(event):
            if event.observer is observer and event.first and self.limits is None:
                stage_cache.complete(event.gm)  # a warm bucket's graph: the values it reads
                self.limits = analyse(event.gm.graph, self.inputs, self.scratch,
                                      quiet=self.setting == "off")

        with Observer.subscribe(listen):
            yield

    @property
    def slots(self) -> Limit | None:
        """The input that picks each row's state slot, found from the graph (None: not
        analysed yet, or no input indexes the rows of a state buffer)."""
        return next((lim for lim in self.limits or () if lim.role == "slots"), None)

    def guard(self, fn, example_inputs: list):
        """The compiled step, with the device check in front where the mode is `device`."""
        if self.mode is None:
            self.mode = self._resolve(example_inputs)
            if self.mode == "host" and not self.pads:  # nothing writes the scratch row
                self.limits = [dataclasses.replace(lim, scratch=None) for lim in self.limits]
        if self.mode != "device":
            return fn

        redirect = self._redirect(example_inputs)

        def checked_step(*args):
            args = list(args)
            safe = redirect(self._rows, self._mask, *(args[lim.index] for lim in self.limits))
            for lim, t in zip(self.limits, safe):
                args[lim.index] = t
            return fn(*args)

        return checked_step

    def _redirect(self, example_inputs: list):
        """`(rows, mask, *checked) -> checked'`: the device check and the redirect, writing the
        failed checks into `mask`. On CUDA one Inductor-compiled function per bucket (its shapes):
        a few fused kernels inside the step's CUDA graph instead of ~8 per checked input, or with
        `K3_CHECK_KERNEL` one CuTe kernel (kernels/input_check.py) where it takes the limits; on
        CPU (the tests) the same function run eagerly (`redirect_ref`). `redirect_by` says which."""
        limits = tuple(self.limits)

        def redirect(rows, mask, *checked):
            return redirect_ref(limits, rows, mask, *checked)

        checked = [example_inputs[lim.index] for lim in limits]
        cuda = all(t.is_cuda for t in checked)
        if not (self.compiled or self.compiled is None and cuda):
            self.redirect_by = "torch"
            return redirect
        if cuda and KERNELS.check_kernel:
            from k3compile.kernels import input_check

            if (kernel := input_check.redirect(limits, checked)) is not None:
                self.redirect_by = "kernel"
                return kernel
        self.redirect_by = "inductor"
        scalar = torch.zeros((), dtype=torch.int64, device=checked[0].device)
        examples = [scalar, scalar.clone(), *(t.contiguous() for t in checked)]
        from k3compile.rewrite import inductor

        compiled = inductor.compile_fx_static(make_fx(redirect)(*examples), examples)
        # Inductor's code asserts the example's strides: a strided view of ids is copied first
        return lambda rows, mask, *args: compiled(rows, mask, *(t.contiguous() for t in args))

    def _resolve(self, example_inputs: list) -> str:
        if self.setting == "off" or not self.limits:
            if self.setting != "off":
                log.warning("k3 input checks: no input of the step indexes anything; none checked")
            return "off"
        cuda = any(isinstance(x, torch.Tensor) and x.is_cuda
                   for i, x in enumerate(example_inputs) if self.inputs[i].user)
        mode = self.setting if self.setting != "auto" else ("device" if cuda else "host")
        if mode == "device" and not any(lim.role == "slots" for lim in self.limits):
            log.warning("k3 input checks: no slot input to redirect a rejected step's writes to "
                        "the scratch slot; checking on the host (a sync per step on CUDA)")
            return "host"
        return mode

    # ---- run time

    def before(self, args: list, batch: int | None) -> None:
        """Raise on a bad input before the step runs (host), or on an earlier step the device
        rejected; `batch`: the real rows of a padded batch (None: no padding)."""
        if self.mode in (None, "off"):
            return
        if not _capturing():  # a caller's own CUDA-graph capture may not query events
            self.raise_finished()
        self._check_shapes(args)
        if self.mode == "host":
            self._check_values(args, batch)
            return
        lead = args[self.limits[0].index]
        if self._mask is None or self._mask.device != lead.device:
            self._mask = torch.zeros((), dtype=torch.int64, device=lead.device)
        size = _lead_size(lead)
        self._rows = self._row_count.tensor(lead.device, batch if batch is not None else size, size)

    def after(self) -> None:
        """After a device-checked step: its mask, read now on CPU, later on CUDA."""
        self.steps += 1
        if self.mode != "device":
            return
        if not self._mask.is_cuda:
            if bits := int(self._mask):
                raise ValueError(self._describe(bits, self.steps))
            return
        if _capturing():
            # the caller captures the step in its own CUDA graph (a benchmark, a server's graph):
            # the check and the redirect are in that graph, but no host read-back can be: a
            # rejected replay writes only the scratch row and `mask` holds its failed checks
            return
        pinned = self._pinned.pop() if self._pinned else torch.empty(
            (), dtype=torch.int64, pin_memory=True)
        pinned.copy_(self._mask, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((pinned, event, self.steps))
        if len(self._pending) > 64:  # the host ran far ahead: wait for the oldest
            self._pending[0][1].synchronize()

    def before_eager(self, args: list) -> None:
        """A batch Dynamo's graph runs uncompiled: checked on the host, if analysed."""
        if self.limits and self.setting != "off":
            self.raise_finished()
            self._check_shapes(args)
            self._check_values(args, None)

    @property
    def mask(self) -> torch.Tensor | None:
        """The device check's bitmask of the last step (0: every input passed); the one place a
        step replayed from the caller's own CUDA graph reports a rejection."""
        return self._mask

    def wait(self) -> None:
        """Wait for every device-checked step and raise if one was rejected."""
        self.raise_finished(wait=True)

    def raise_finished(self, wait: bool = False) -> None:
        while self._pending:
            pinned, event, step = self._pending[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self._pending.popleft()
            bits = int(pinned)
            self._pinned.append(pinned)
            if bits:
                raise ValueError(self._describe(bits, step))

    # ---- the checks

    def _check_shapes(self, args: list) -> None:
        if error := structure_error([(lim.name, args[lim.index], lim.why) for lim in self.limits]):
            raise ValueError(error)

    def _check_values(self, args: list, batch: int | None) -> None:
        for lim in self.limits:
            t = args[lim.index]
            real = t[:batch] if lim.batched and batch is not None and t.dim() else t
            values = real.reshape(-1).tolist()
            shown = _show(values)
            if bad := sorted({v for v in values if v < lim.lo or v > lim.hi}):
                raise ValueError(f"k3: {lim.name} {shown}: {_show(bad)} outside "
                                 f"[{lim.lo}, {lim.hi}] ({lim.why})")
            if lim.role != "slots":
                continue
            if lim.scratch is not None and lim.scratch in values:
                raise ValueError(f"k3: {lim.name} {shown}: {lim.scratch} is the scratch slot "
                                 f"(padding rows write it; no request may use it)")
            if dups := sorted(v for v, c in collections.Counter(values).items() if c > 1):
                raise ValueError(f"k3: {lim.name} {shown}: {_show(dups)} used by more than one "
                                 f"row (each request needs its own state row)")

    def _describe(self, bits: int, step: int) -> str:
        failed = [f"{lim.name} {_CHECKS[check]}"
                  + (f" [{lim.lo}, {lim.hi}] ({lim.why})" if check == RANGE else "")
                  for k, lim in enumerate(self.limits) for check in range(3)
                  if bits >> (3 * k + check) & 1]
        return (f"k3: step {step} was rejected by its device-side input check: "
                + "; ".join(failed) + ". Its state writes went to the scratch slot (no request's "
                "state changed) and its outputs are meaningless.")


def redirect_ref(limits: Sequence[Limit], rows: torch.Tensor, mask: torch.Tensor,
                 *checked: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The device check and the redirect, in torch: the failed checks (`_device_mask`) written
    into `mask`, and each checked input, or where a check failed its safe value (the scratch slot
    for the slot input, lo for the others). What Inductor compiles, the CPU path, and the
    reference of kernels/input_check.py."""
    bits = _device_mask(limits, checked, rows)
    mask.copy_(bits)
    ok = bits == 0
    return tuple(torch.where(ok, t, lim.scratch if lim.role == "slots" else lim.lo)
                 for lim, t in zip(limits, checked))


def _device_mask(limits: Sequence[Limit], checked: Sequence[torch.Tensor],
                 rows: torch.Tensor) -> torch.Tensor:
    """The failed checks as bits of one int64, computed without leaving the device; `rows`: the
    real (unpadded) batch, a 0-dim tensor."""
    bits = []
    for k, (lim, t) in enumerate(zip(limits, checked)):
        real = _real_rows(t, rows) if lim.batched and t.dim() else None
        inside = (t >= lim.lo) & (t <= lim.hi)
        bits.append(_any(~inside, real) * (1 << (3 * k + RANGE)))
        if lim.role == "slots":
            bits.append(_any(t == lim.scratch, real) * (1 << (3 * k + SCRATCH)))
            bits.append(_duplicates(t, inside if real is None else inside & real)
                        * (1 << (3 * k + DUPLICATE)))
    return torch.stack(bits).sum()


def _real_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    real = torch.arange(t.shape[0], device=t.device) < rows
    return real.view(-1, *[1] * (t.dim() - 1)).expand_as(t)


class RowCount:
    """The device check's row count (a 0-d int64 tensor), written only where its value changes.

    One shared tensor serves every call the backend runs itself: its own CUDA graphs read it where
    they were captured, so a padded batch of another size only refills it, outside the graph, and a
    step of the same size as the last launches no fill at all. Inside a caller's own capture (a
    benchmark's, a server's graph) a fill would be recorded and replayed with the graph, so an
    unpadded call there reads a constant tensor of its size instead (made outside any capture by an
    earlier call; the first call of a size is never inside the caller's capture for a warmed-up
    step). A fill that is recorded after all (a padded call, or a size not seen before) may rewrite
    the shared tensor at any replay, so from then on every call fills it."""

    def __init__(self):
        self.shared: torch.Tensor | None = None
        self.value: int | None = None  # the shared tensor's value as last written here
        self.replays_write = False  # a captured fill may rewrite the shared tensor
        self.constants: dict[int, torch.Tensor] = {}  # unpadded sizes, on the shared's device

    def tensor(self, device: torch.device, rows: int, size: int) -> torch.Tensor:
        """The row count `rows` of a call whose checked inputs have `size` rows."""
        if self.shared is None or self.shared.device != device:
            self.shared = torch.zeros((), dtype=torch.int64, device=device)
            self.value, self.constants = 0, {}
        capturing = _capturing()
        if rows == size:
            if capturing and (constant := self.constants.get(rows)) is not None:
                return constant
            if not capturing and rows not in self.constants:
                self.constants[rows] = torch.full((), rows, dtype=torch.int64, device=device)
        if capturing or self.replays_write or self.value != rows:
            self.shared.fill_(rows)
            self.value = rows
            self.replays_write |= capturing
        return self.shared


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _any(bad: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    return (bad if real is None else bad & real).any().long()


def _duplicates(t: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """1 where two counted entries hold the same value (the others get distinct negatives)."""
    flat = t.reshape(-1)
    apart = -1 - torch.arange(flat.numel(), device=t.device, dtype=t.dtype)
    flat = torch.where(counted.reshape(-1), flat, apart)
    same = flat.unsqueeze(0) == flat.unsqueeze(1)
    return (same.sum() > flat.numel()).long()


def _lead_size(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


def _show(values: list) -> str:
    return str(values) if len(values) <= 16 else f"{values[:16]}... ({len(values)} values)"
