"""`torch.compile(model, backend="k3")`: receives Dynamo's graph and hands it to the pipeline,
once per batch bucket.

A graph whose batch size is symbolic (`dynamic=True`, or Dynamo's automatic dynamic shapes after a
second batch size) is compiled lazily once per bucket with the batch specialised to the bucket;
the bucket is chosen at run time by guards that are sympy relations over the batch symbol
(`lo < B <= hi`). A batch between buckets is padded to the bucket above: padding rows point at the
scratch state slot, so they never touch a real request's state. Which input picks the state slot
is read off the graph at the first compile (k3compile/validate.py), whatever the argument is
called; the first compile of a bucket sees placeholder padding, each run the real one. A batch above the largest bucket
runs Dynamo's graph eagerly (correct, slower) with a logged warning; so does an empty batch
(eager's empty result, nothing compiled for it). On a GPU each bucket is
captured once in a CUDA graph after its first (real) run and replayed afterwards.

A float that Dynamo lifts to a graph input (`specialize_float` off: a second model whose RMSNorm
eps differs recompiles with every float attribute as a 0-d tensor read by `.item()`) is baked
back in as the constant it is in the call: the compiled steps are keyed by those values too, so
the patterns see their literal eps and each model gets its own step.

A call Dynamo cannot trace (a float id, batch sizes that disagree) fails inside Dynamo, which
hands the caller its own error; the module Dynamo traced gets k3compile/calls.py's pre-hook after
its first compile, so from then on such a call raises our `ValueError` before Dynamo sees it (the
built-in models register it themselves, which covers their first call too).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch import fx, nn

from k3compile import precompile
from k3compile.calls import batch_error, check_calls
from k3compile.observe import Observer
from k3compile.pipeline import Pipeline
from k3compile.settings import Options
from k3compile.stages.contract import ContractReport, format_contract
from k3compile.validate import InputChecks, arg_name

log = logging.getLogger("k3compile")

_compiled: list[K3Compiled] = []  # every compiled graph of this process, newest last (for tools)


def k3_backend(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, **_):
    compiled = K3Compiled(gm, example_inputs, Options.make(options), _traced_module())
    _compiled.append(compiled)
    precompile.record(gm, compiled.signature, options)  # TORCH_CACHING_PRECOMPILE=1 only
    return compiled


def restored(gm: fx.GraphModule, signature: Signature, options: dict | None) -> K3Compiled:
    """A graph compiled in an earlier process, as Dynamo's warm start (k3compile/precompile.py)
    hands it back: Dynamo's tracing skipped, each bucket compiled at its first call."""
    compiled = K3Compiled(gm, None, Options.make(options), signature=signature)
    _compiled.append(compiled)
    return compiled


def _traced_module() -> nn.Module | None:
    """The module whose `forward` Dynamo is tracing (the `self` of its frame), or None: the one
    place the backend sees the module, to give it the call check (Dynamo's own API has no hook
    around a call)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code = tx.f_code
        me = tx.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    except Exception:  # noqa: BLE001 (a private API: without it the check comes later, in the step)
        return None
    forward = getattr(type(me), "forward", None)
    return me if isinstance(me, nn.Module) and getattr(forward, "__code__", None) is code else None


def ensure_registered() -> None:
    """Make `backend="k3"` resolve where the entry point is missing: a source tree used through
    PYTHONPATH, never pip-installed (the GPU machine). Installed packages need no call."""
    if "k3" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(k3_backend, name="k3")


BATCH = "k3_batch"  # the shape_id of the step inputs' batch dim


def mark_batch(*inputs: torch.Tensor) -> None:
    """Mark dim 0 of the step's inputs (ids, positions, slots) as the batch, before the first
    call: one Dynamo graph then serves every batch size, and the backend compiles each bucket
    once. The batch is unbacked: Dynamo neither specialises batch 1 (as it does a backed size)
    nor guards on comparisons that torch's fake kernels make (conv's `16 <= B` on CPU); the
    backend specialises it per bucket. Marking later calls too is harmless. The batch is at least 1
    (`min=1`: code that reshapes a permuted batch, as the second spelling's q|k|v does, traces
    only when it cannot be 0); an empty batch is left unmarked and gets its own graph, which
    returns eager's empty result.

    In a process whose step Dynamo's warm start restored (k3compile/precompile.py) the batch is
    already symbolic in the loaded code, and torch 2.13's loaded guards reject a marked tensor
    ("_has_dynamo_dim_marking ... absent at compile time"): nothing is marked there.

    The inputs' batches are one symbol (`shape_id`; Dynamo asserts their equality at run time):
    with one symbol each, code where two of them meet in an op whose fake kernel guards on their
    equality failed to trace (spell11's SDPA over the cache rows of `slots` with queries from
    the ids: "Could not guard on data-dependent expression Eq(u2, u1)", session 36)."""
    if precompile.RESTORED:
        return
    for t in inputs:
        if t.dim() and t.shape[0] == 0:
            continue
        try:
            torch._dynamo.decorators.mark_unbacked(t, 0, min=1, shape_id=BATCH)
        except TypeError:  # a torch without `min` (the bound is then >= 0)
            _warn_no_batch_min()
            torch._dynamo.decorators.mark_unbacked(t, 0, shape_id=BATCH)


@functools.cache
def _warn_no_batch_min() -> None:
    """torch 2.11 (the H200's) has no `mark_unbacked(min=)`: the batch may be 0 to Dynamo, and code
    that infers a size from it fails to trace, e.g. the second spelling's `bmm(...).permute(1, 0,
    2).reshape(*lead, -1)` ("Could not guard on data-dependent expression Ne(u2, 0)"). Dynamo then
    gives up on the whole step ("WON'T CONVERT", at INFO only) and compiles each layer's forward as
    its own graph: correct, but nothing fuses across layers. Found on the CPU with torch 2.11
    (session 16); our model and Moonshot's adapted code trace as one graph there."""
    log.warning("k3: torch %s has no mark_unbacked(min=): the batch is >= 0 to Dynamo, so a step "
                "that reshapes with -1 over a batch-major size cannot trace as one graph; Dynamo "
                "then compiles each frame on its own (see TORCH_LOGS=dynamo for 'WON'T CONVERT'). "
                "Compile per bucket (no mark_batch) or use torch >= 2.12 if that happens.",
                torch.__version__)


def last_compiled() -> K3Compiled:
    if not _compiled:
        raise RuntimeError("nothing has been compiled with backend='k3' in this process")
    return _compiled[-1]


def _is_module_state(name: str) -> bool:
    return name.lower().startswith("l_self") or "_modules_" in name or "_parameters_" in name


def _lifted_float(node: fx.Node, example) -> bool:
    return (isinstance(example, torch.Tensor) and example.dim() == 0
            and example.dtype.is_floating_point and bool(node.users)
            and all(u.op == "call_method" and u.target == "item" for u in node.users))


def _fallback_line() -> str | None:
    """The CUDA calls of this process that a kernel refused and ran the torch reference, by op
    and reason (kernels/common/dsl.py counts them), or None."""
    from k3compile.kernels.common.dsl import fallback_counts  # kernels import no stage: lazily

    if counts := fallback_counts():
        return "reference fallbacks: " + ", ".join(
            f"{op} ({reason}) x {n}" for (op, reason), n in sorted(counts.items()))
    return None


@dataclasses.dataclass
class _Input:
    index: int
    name: str
    batched: bool  # dim 0 is the batch
    symint: bool  # a SymInt placeholder (its value is a size)
    expr: Any = None  # the SymInt's sympy expression
    user: bool = False  # a tensor the caller passes anew each step (copied in on graph replay)
    scalar: bool = False  # a float Dynamo lifted to a 0-d tensor input, read only by `.item()`


@dataclasses.dataclass
class Signature:
    """What the backend reads off Dynamo's graph and example inputs: plain data, so a later process
    restores the compiled graph without them (k3compile/precompile.py)."""

    inputs: list[_Input]
    symbol: Any  # the batch symbol (sympy), or None: a static graph
    batch_symbols: set
    outputs_batched: list[bool]
    static_batch: int | None  # a static graph's batch size


class _Bucket:
    def __init__(self, fn: Callable, batch: int):
        self.fn, self.batch = fn, batch
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: list | None = None
        self.fixed: list[int] = []  # the inputs the graph reads where they are (not copied in)
        self.pointers: list[int | None] = []  # their addresses at capture
        self.static_out: Any = None
        self.runs = 0
        self.layout: tuple = ()  # the strides of the module tensors the compile was handed
        self.stale = False  # its first run re-laid weights: compiled again at the next call
        self.reads: Any = None  # the ReadGuard of the inputs whose values the compile read


def _moved(entry: _Bucket, args: list) -> bool:
    """Whether a module tensor the captured graph reads (a parameter, a state buffer) has other
    memory now: a captured graph reads the addresses it saw, so it must be captured again. One C++
    call over every such input (torch's CUDA-graph trees check their static inputs with it)."""
    same = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)  # CUDA builds only
    if same is not None:
        return not same(args, entry.pointers, entry.fixed)
    return any(args[i].data_ptr() != entry.pointers[i] for i in entry.fixed)


# Tensor.put / put_ take int64 indices only in eager, but their decomposition (AOTAutograd's, as
# Inductor's) indexes with any integer: compiled, an int32 index would run where eager raises
_PUTS = frozenset({"put", "put_", torch.put, torch.Tensor.put, torch.Tensor.put_})
_SCALAR_TYPES = {torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
                 torch.bool: "Bool"}  # eager's names (c10::ScalarType) in that message


def refuse_as_eager(gm: fx.GraphModule) -> None:
    """Raise eager's error for a call the lowering would accept and eager refuses."""
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function") or node.target not in _PUTS:
            continue
        index = node.args[1] if len(node.args) > 1 else node.kwargs.get("index")
        val = index.meta.get("example_value") if isinstance(index, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dtype != torch.int64:
            got = _SCALAR_TYPES.get(val.dtype, str(val.dtype))
            raise RuntimeError(f"put_(): Expected a long tensor for index, but got {got}")


class K3Compiled:
    """The callable Dynamo receives; dispatches each call to its bucket's compiled step."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list | None, options: Options,
                 module: nn.Module | None = None, *, signature: Signature | None = None):
        """`signature`: what an earlier process read off this graph (`example_inputs` is then
        None, and a static graph's bucket compiles at its first call)."""
        self.gm, self.options, self.module = gm, options, module
        self.observer = Observer(options.keep_graphs)
        self.pipeline = Pipeline(options, self.observer)
        self.buckets: dict[tuple, _Bucket] = {}
        self._warned: set[str] = set()
        if signature is None:
            refuse_as_eager(gm)
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            self.inputs = self._classify(placeholders, example_inputs)
            self.batch_symbols: set = set()
            self.symbol = self._batch_symbol()
            self.outputs_batched = self._batched_outputs()
            self.static_batch = None if self.symbol is not None else self._static_batch(example_inputs)
        else:
            self.inputs, self.symbol, self.batch_symbols = (
                signature.inputs, signature.symbol, signature.batch_symbols)
            self.outputs_batched, self.static_batch = signature.outputs_batched, signature.static_batch
        self._lead = next((i for i in self.inputs if i.batched), None)
        self.guards = self._make_guards() if self.symbol is not None else {}
        self.checks = InputChecks(self.inputs, options.validate, options.scratch_slot,
                                  pads=self.symbol is not None or options.scratch_slot is not None)
        # a static graph (Dynamo already guards the exact batch size) compiles now; an empty batch
        # runs Dynamo's graph as eager would
        if self.symbol is None and self.static_batch != 0 and example_inputs is not None:
            self._compile_bucket(self._scalars(example_inputs), example_inputs, self.static_batch)

    @property
    def signature(self) -> Signature:
        return Signature(self.inputs, self.symbol, self.batch_symbols, self.outputs_batched,
                         self.static_batch)

    # ---- graph analysis ----------------------------------------------------------------------

    def _classify(self, placeholders, example_inputs) -> list[_Input]:
        """Dynamo hands real example inputs; the symbolic sizes live in the placeholders' meta."""
        out, self._examples = [], []
        for i, (node, real) in enumerate(zip(placeholders, example_inputs)):
            ex = node.meta.get("example_value", real)
            self._examples.append(ex)
            if isinstance(ex, torch.SymInt):
                out.append(_Input(i, node.name, False, True, ex.node.expr))
            elif _lifted_float(node, ex):
                out.append(_Input(i, node.name, False, False, scalar=True))
            else:
                user = isinstance(ex, torch.Tensor) and not _is_module_state(node.name)
                out.append(_Input(i, node.name, False, False, user=user))
        return out

    def _user_tensors(self):
        return [inp for inp in self.inputs if not inp.symint and not inp.scalar
                and not _is_module_state(inp.name) and isinstance(self._examples[inp.index], torch.Tensor)]

    def _batch_symbol(self):
        users = self._user_tensors()
        if not users or self._examples[users[0].index].dim() == 0:
            return None
        dim0 = self._examples[users[0].index].shape[0]
        if not isinstance(dim0, torch.SymInt) or not isinstance(dim0.node.expr, sympy.Symbol):
            return None
        symbol = dim0.node.expr
        # Dynamo gives each marked input its own symbol unless an op ties them: every user
        # input's leading size is taken as the batch (checked equal at run time).
        self.batch_symbols = set()
        for inp in users:
            ex = self._examples[inp.index]
            lead = ex.shape[0] if ex.dim() > 0 else None
            if isinstance(lead, torch.SymInt) and isinstance(lead.node.expr, sympy.Symbol):
                inp.batched = True
                self.batch_symbols.add(lead.node.expr)
        for inp in self.inputs:
            if inp.symint and inp.expr in self.batch_symbols:
                inp.batched = False
        return symbol

    def _make_guards(self) -> dict[int, sympy.Basic]:
        guards, lo = {}, 0
        for b in self.options.buckets:
            guards[b] = sympy.And(sympy.Gt(self.symbol, lo), sympy.Le(self.symbol, b))
            lo = b
        return guards

    @property
    def scratch(self) -> int | None:
        """The state slot padding rows use: the options', else the last row of the state buffers
        the step's slot input indexes (None: not compiled yet, or no input picks state rows)."""
        if self.options.scratch_slot is not None:
            return self.options.scratch_slot
        slots = self.checks.slots
        return None if slots is None else slots.scratch

    def _batched_outputs(self) -> list[bool]:
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        flags = []
        for a in torch.utils._pytree.tree_leaves(out.args[0]):
            val = a.meta.get("example_value") if isinstance(a, fx.Node) else None
            flags.append(isinstance(val, torch.Tensor) and val.dim() > 0
                         and isinstance(val.shape[0], torch.SymInt)
                         and val.shape[0].node.expr in self.batch_symbols)
        return flags

    def _static_batch(self, example_inputs) -> int | None:
        users = self._user_tensors()
        return int(example_inputs[users[0].index].shape[0]) if users and example_inputs[users[0].index].dim() else None

    # ---- compile and run ---------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int | None:
        for b, guard in self.guards.items():
            if guard.subs(self.symbol, batch) == sympy.true:
                return b
        return None

    def _scalars(self, args) -> tuple[float, ...]:
        """The lifted floats' values in this call (part of every bucket key)."""
        return tuple(float(args[i.index]) for i in self.inputs if i.scalar)

    def _with_scalars(self, key_scalars: tuple[float, ...]) -> fx.GraphModule:
        """Dynamo's graph with each lifted float's `.item()` replaced by its value."""
        scalars = [i for i in self.inputs if i.scalar]
        if not scalars:
            return self.gm
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.gm.graph, {}))
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for inp, value in zip(scalars, key_scalars):
            for item in list(placeholders[inp.index].users):
                item.replace_all_uses_with(value)  # type: ignore[arg-type]
                graph.erase_node(item)
        gm = fx.GraphModule(self.gm, graph)
        gm.meta.update(self.gm.meta)
        return gm

    def _compile_bucket(self, key: tuple, inputs: list, batch: int | None) -> _Bucket:
        """The bucket compiled on `inputs`. Where its first run changes the layout of a module
        tensor (stage kernel_layout re-lays [in, out] weights at the first call, as the compile
        cannot: Dynamo checks its guards after the backend returns), the bucket is compiled again
        at its next call, so that stage pack sees the weights as they are now. torch 2.13's Dynamo
        would compile the step again anyway (its stride guards; the next call then never reaches
        this step), torch 2.11's does not (session 26)."""
        user = frozenset(i.index for i in self.inputs if i.user)
        gm = self._with_scalars(self._scalars(inputs))
        with self.checks.analysing(self.observer):
            fn = self.pipeline.compile(gm, list(inputs), batch, user_inputs=user)
        bucket = self.buckets[key] = _Bucket(self.checks.guard(fn, list(inputs)), batch)
        bucket.reads = getattr(fn, "k3_read_guard", None)  # inputs whose values the stages read
        bucket.layout = self._layout(inputs)
        self._check_module_calls()
        return bucket

    def _check_module_calls(self) -> None:
        """Give the traced module the call check over the inputs the graph indexes with."""
        if self.module is not None and self.checks.limits and self.options.validate != "off":
            check_calls(self.module, [lim.name for lim in self.checks.limits])
            self.module = None

    def _warn_once(self, key: str, msg: str, *args):
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def __call__(self, *args):
        if self.symbol is None:
            if self.static_batch == 0:
                return self.gm(*args)
            key = self._scalars(args)
            entry = self._current(key, args) or self._compile_bucket(key, list(args),
                                                                    self.static_batch)
            return self._run(entry, list(args), None, None)
        batch = int(args[self._lead.index].shape[0])
        if error := batch_error([(arg_name(i.name), args[i.index], "")
                                 for i in self.inputs if i.batched]):
            raise ValueError(error)
        if batch == 0:  # nothing to compute: Dynamo's graph gives eager's empty result
            return self.gm(*args)
        bucket = self.bucket_for(batch)
        if bucket is None:
            self._warn_once("above", "k3: batch %d is above the largest bucket %d; running the "
                            "uncompiled graph (correct, slow)", batch, max(self.options.buckets))
            self.checks.before_eager(list(args))
            return self.gm(*args)
        entry = self._entry(args, batch, bucket)
        if entry.batch != batch and self.scratch is None:
            self._warn_once("noslots", "k3: no input of the step picks state rows, so padding "
                            "rows cannot be sent to a scratch slot; compiling batch %d exactly",
                            batch)
            entry = self._entry(args, batch, batch)
        return self._run(entry, self._pad(args, batch, entry.batch), batch, entry.batch)

    def _entry(self, args, batch: int, bucket: int) -> _Bucket:
        """The bucket's compiled step, compiled now if new (its first compile pads with
        placeholder rows: which input holds the slots is known only after it)."""
        # other symbols (verify rows T, ...) are specialised to their run-time values
        key = (bucket, *(bucket if inp.expr in self.batch_symbols else int(args[inp.index])
                         for inp in self.inputs if inp.symint),
               *self._scalars(args))
        entry = self._current(key, args)
        return entry or self._compile_bucket(key, self._pad(args, batch, bucket), bucket)

    def _current(self, key: tuple, args) -> _Bucket | None:
        """The bucket's compiled step, None where it is to be compiled (again: `_Bucket.stale`,
        or an input whose values the compile read has changed: `_Bucket.reads`)."""
        entry = self.buckets.get(key)
        if entry is not None and entry.stale:
            log.info("k3: the first run re-laid weights (stage kernel_layout); compiling bucket "
                     "%s again, on their new layout", entry.batch)
            return None
        if entry is not None and entry.reads is not None and (why := entry.reads.changed(args)):
            log.warning("k3: %s; compiling bucket %s again, on its new values", why, entry.batch)
            return None
        return entry

    def _layout(self, args: list) -> tuple:
        """The strides of the module tensors (parameters, buffers) among the step's inputs."""
        return tuple(args[i.index].stride() for i in self.inputs
                     if not i.user and isinstance(args[i.index], torch.Tensor))

    def _pad(self, args, batch: int, bucket: int) -> list:
        """Rows batch..bucket of each batched input: the scratch slot for the slot input, the
        lowest valid value for other checked inputs, else 0."""
        fills = {lim.index: lim.lo for lim in self.checks.limits or ()}
        if (slots := self.checks.slots) is not None and self.scratch is not None:
            fills[slots.index] = self.scratch
        out = list(args)
        for inp in self.inputs:
            a = args[inp.index]
            if inp.symint and inp.expr in self.batch_symbols:
                out[inp.index] = bucket
            elif inp.batched and bucket != batch:
                pad = a.new_full((bucket - batch, *a.shape[1:]), fills.get(inp.index, 0))
                out[inp.index] = torch.cat([a, pad])
        return out

    def _run(self, entry: _Bucket, args: list, batch: int | None, bucket: int | None):
        self.checks.before(args, batch)  # a bad input raises here, before any state is written
        use_graph = (self.options.cuda_graphs and torch.cuda.is_available()
                     and any(isinstance(a, torch.Tensor) and a.is_cuda for a in args))
        if entry.graph is not None and _moved(entry, args):  # `param.data = t`, `.to()` and back
            self._warn_once("moved", "k3: a parameter or buffer has new memory since the step's "
                            "CUDA-graph capture; capturing it again")
            entry.graph = None
        if entry.graph is not None:
            outs = self._replay(entry, args)
        else:
            outs = entry.fn(*args)
            entry.runs += 1
            if entry.runs == 1 and self._layout(args) != entry.layout:
                entry.stale = True  # see `_compile_bucket`
            elif use_graph:
                self._capture(entry, args)
        self.checks.after()
        if batch is None or batch == bucket:
            return outs
        return tuple(o[:batch] if flag else o for o, flag in zip(outs, self.outputs_batched))

    def _capture(self, entry: _Bucket, args: list):
        """Record the step once; replays reuse these input/output buffers."""
        entry.static_in = [a.clone() if self.inputs[i].user else a for i, a in enumerate(args)]
        entry.fixed = [i for i, a in enumerate(args)
                       if isinstance(a, torch.Tensor) and not self.inputs[i].user]
        entry.pointers = [None] * len(args)
        for i in entry.fixed:
            entry.pointers[i] = args[i].data_ptr()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            entry.static_out = entry.fn(*entry.static_in)
        entry.graph = graph

    def _replay(self, entry: _Bucket, args: list):
        for i, (static, a) in enumerate(zip(entry.static_in, args)):
            if self.inputs[i].user:
                static.copy_(a)
        entry.graph.replay()
        entry.runs += 1
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in entry.static_out)

    # ---- reports -----------------------------------------------------------------------------

    @property
    def contracts(self) -> dict[int | None, ContractReport]:
        """The fusion contract of each compiled bucket (stage `contract`'s report)."""
        return {b: n["contract"] for b, n in self.observer.notes.items() if "contract" in n}

    def summary(self) -> str:
        lines = []
        for batch, report in self.contracts.items():
            lines.append(format_contract(report, batch))
        packs = [f"{b}: {n['pack']}" for b, n in self.observer.notes.items() if "pack" in n]
        if packs:  # stage `pack`: the fused groups' weights stored as one buffer each
            lines.append("weights, by bucket compiled: " + "; ".join(packs))
        if self.options.verify:  # K3_VERIFY: what stage `verify` checked and reverted
            lines.append("verify, by bucket compiled: " + "; ".join(
                f"{b}: {r.verified} rewrites verified, {len(r.reverted)} reverted"
                for b, r in self.observer.reports.items()))
        if self.guards:
            lines.append("bucket guards: " + ", ".join(f"{b}: {g}" for b, g in self.guards.items()))
        if fell := _fallback_line():
            lines.append(fell)
        return "\n".join(lines)
