"""Stage `weight_cast`: a weight kept in fp32 (master weights) that the graph reads only through a
cast to bf16 or fp16 (`torch.autocast` casts each GEMM's operands) is read as a copy of itself in
that dtype, made once and kept by the compiled function's wrapper.

Before (W a graph input, fp32):     mm(x, permute(convert_element_type(W, bf16), [1, 0]))
After  (W the bf16 copy of it):     mm(x, permute(W, [1, 0]))

Under autocast every GEMM reads `convert_element_type(W_fp32, bf16)`: no pattern takes that as a
weight (pack and the kernels read a weight input's own storage), so every GEMM fusion is lost,
and each step reads 4 bytes per weight and writes and reads 2 more. A canonical rule cannot help:
a rule cannot change the dtype of a graph input. This stage changes the placeholder's meaning
instead: the graph takes the copy in W's position, every cast of W (or of a view of W) becomes
the view itself, and the executor's wrapper (`Cast.wrap`) hands the compiled graph the copy at
every call. A cast of a non-dense view (a column slice: MLA's W_UK / W_UV out of kv_b) lays its
result out anew; it is taken only where every reader is a GEMM operand, directly or through
transposes (`_gemm_operand`), whose values and output layout ignore the strides. Values: autocast's cast and `copy_` into a bf16 tensor both round to nearest even,
so the copy of the same fp32 value is bitwise the cast the graph computed.

Never stale. Each call first checks every master it was compiled for against what the copy was
made from: its address (`param.data = t` moves it) and its `_version` (`copy_`,
`load_state_dict`, optimiser steps, any in-place write bump it; views share their base's
counter); a master that changed is copied again into the same copy buffer, so a CUDA graph keeps
its addresses. The wrapper holds each master's storage as it was last copied, so a freed storage's
address is never another tensor's while it is compared (`param.data = t` keeps the Parameter's
version counter: the address tells). Not seen: a write through `param.data` (`param.data.copy_(t)`,
or a `.data` taken earlier): `.data` is a tensor with a version counter of its own, so nothing
tells the wrapper short of reading the master, the traffic the copy saves. Hence the stage is
off by default (stages pack, kernel_layout and stack_inputs read the parameter's own storage and
see such writes). One copy per master and dtype for the whole process
(`_COPIES`): every bucket's graph reads the same buffer, and stage `pack` moves the copies as it
moves any weight (later compiles find them packed).

Taken: a placeholder that is no caller's input, is not written in place, is float and wider than
the cast's dtype, every read of which reaches a cast to one dtype (bf16 or fp16) through views
only (permute, view, slice, select, split and their getitems), where no cast or view is an output
of the graph or written in place. Left alone, with the reason in the report (`ctx.notes`): a
weight read in its own dtype too (the fp32 read would need the master and the copy both; the
report names the reader), read through casts to two dtypes, or not a plain tensor.

Runs before the stage cache's key (after `kernel_layout`, whose transposed weights it takes as
they are: the cast of Wᵀ), on every compile, a cache hit included: it makes the copies the
process's graphs read, so it is never cached, and the key is the graph it wrote (a bf16
placeholder where it took the weight). Options.weight_cast / K3_WEIGHT_CAST=1 turn it on.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.weak import WeakIdKeyDictionary

from k3compile.graph import ROW_VIEWS, fake_value, written_in_place
from k3compile.stages.kernel_layout import VIEWS, placed

log = logging.getLogger("k3compile")
aten, prims = torch.ops.aten, torch.ops.prims

LOW = (torch.bfloat16, torch.float16)
_VIEWS = VIEWS | ROW_VIEWS | {aten.unbind.int, operator.getitem}
_GEMMS = {aten.mm.default, aten.bmm.default}
_TRANSPOSES = {aten.permute.default, aten.t.default, aten.transpose.int}
# the master's storage -> {(offset, shape, stride, dtype): its copy}: one copy per master and
# dtype in the process, whatever the compiles (buckets) that read it
_COPIES = WeakIdKeyDictionary()


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype `node` casts its first argument to, where it is a plain dtype cast (no device,
    layout or memory-format change); None otherwise."""
    if node.op != "call_function":
        return None
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    if node.target is aten._to_copy.default and not node.args[1:] and set(node.kwargs) <= {
            "dtype", "layout", "device", "memory_format", "non_blocking"}:
        val, kw = node.args[0].meta.get("val"), node.kwargs
        if (kw.get("layout") not in (None, torch.strided)
                or kw.get("memory_format") not in (None, torch.preserve_format)
                or (kw.get("device") is not None and val is not None
                    and torch.device(kw["device"]) != val.device)):
            return None
        return kw.get("dtype")
    return None


def _reads(p: fx.Node) -> tuple[list[fx.Node], list[fx.Node], torch.dtype] | str:
    """(the views, the casts) every read of p goes through, and the casts' one dtype; or why
    not."""
    views, casts, dtypes, stack = [], [], set(), [p]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.op == "output":
                return "an output of the graph" if node is p else "a view of it is an output"
            plain = user.op == "call_function" and user.args[0] is node and not any(
                isinstance(a, fx.Node) for a in (*user.args[1:], *user.kwargs.values()))
            if plain and (dtype := cast_dtype(user)) is not None:
                if any(u.op == "output" for u in user.users) or written_in_place(user):
                    return f"its cast {user.name} is an output or written in place"
                if user.meta["val"].stride() != node.meta["val"].stride():
                    # a cast of a non-dense view (a column slice) is laid out anew: the view of
                    # the copy hands the cast's readers other strides, which only readers whose
                    # values and layout ignore them take (GEMM operands, through transposes)
                    transposes = []
                    if not _gemm_operand(user, transposes):
                        return (f"its cast {user.name} lays out a non-dense view anew and is "
                                "read by more than GEMMs")
                    views += transposes
                casts.append(user)
                dtypes.add(dtype)
                continue
            if plain and user.target in _VIEWS:
                if written_in_place(user):
                    return f"a view of it ({user.name}) is written in place"
                views.append(user)
                stack.append(user)
                continue
            return f"read in {p.meta['val'].dtype} too ({user.name}: {user.target})"
    if not casts:
        return "read through no cast"
    if len(dtypes) > 1:
        return "cast to " + " and ".join(sorted(str(d) for d in dtypes))
    return views, casts, dtypes.pop()


def _gemm_operand(node: fx.Node, transposes: list[fx.Node]) -> bool:
    """Every read of node is an operand of an mm / bmm, directly or through transposes
    (collected in `transposes`): readers whose values and output layout do not depend on node's
    strides (MLA's W_UK / W_UV, column slices of kv_b cast under autocast)."""
    for user in node.users:
        if user.op == "call_function" and user.target in _GEMMS:
            continue
        if (user.op == "call_function" and user.target in _TRANSPOSES and user.args[0] is node
                and not written_in_place(user)):
            transposes.append(user)
            if _gemm_operand(user, transposes):
                continue
        return False
    return bool(node.users)


def _narrowed(p: fx.Node) -> bool:
    """Some read of p, through views, is a cast to a lower float dtype (a weight under autocast:
    worth a line in the report where the stage leaves it)."""
    stack = [p]
    while stack:
        node = stack.pop()
        for user in node.users:
            if cast_dtype(user) in LOW and user.args[0] is node:
                return True
            if user.op == "call_function" and user.target in _VIEWS and user.args[0] is node:
                stack.append(user)
    return False


@dataclasses.dataclass
class Cast:
    """The graph inputs read through their copy in a lower float dtype: `positions`, with each
    copy and its example value, and what the stage left."""

    positions: list[int] = dataclasses.field(default_factory=list)
    copies: list[torch.Tensor] = dataclasses.field(default_factory=list)
    fakes: list = dataclasses.field(default_factory=list)
    masters: list[torch.Tensor] = dataclasses.field(default_factory=list)  # as at compile
    report: WeightCastReport = dataclasses.field(default_factory=lambda: WeightCastReport())

    def inputs(self, originals: list) -> list:
        """The rewritten graph's example inputs, from the original graph's."""
        return placed(originals, self.positions, self.fakes)

    def wrap(self, fn):
        """A boxed callable of the original inputs that calls boxed `fn` with each master's copy
        in its place, the copy first made again where its master changed (see the module
        docstring): per call one address and one version read per master."""
        positions, copies, count = self.positions, self.copies, len(self.positions)
        pointers = [m.data_ptr() for m in self.masters]  # what each copy was last made from
        versions = [m._version for m in self.masters]
        sources = [m.untyped_storage() for m in self.masters]  # held: no other tensor's address
        masters = operator.itemgetter(*positions) if count > 1 else lambda a: (a[positions[0]],)
        picks = None  # (argument count, the new inputs picked from the arguments + the copies)

        @torch.no_grad()
        def refresh(ws) -> None:
            for k, w in enumerate(ws):
                if w.data_ptr() != pointers[k] or w._version != versions[k]:
                    copies[k].copy_(w)
                    pointers[k], versions[k], sources[k] = (w.data_ptr(), w._version,
                                                            w.untyped_storage())

        def call(args: list):
            nonlocal picks
            ws = masters(args)
            for w, pointer, version in zip(ws, pointers, versions):
                if w.data_ptr() != pointer or w._version != version:
                    refresh(ws)
                    break
            n = len(args)
            if n == 1:
                new = [copies[0]]
            else:
                if picks is None or n != picks[0]:
                    slot = {i: n + k for k, i in enumerate(positions)}
                    picks = (n, operator.itemgetter(*(slot.get(j, j) for j in range(n))))
                args.extend(copies)
                new = list(picks[1](args))
            args.clear()
            return fn(new)

        call._boxed_call = True
        return call


@dataclasses.dataclass
class WeightCastReport:
    """What the stage took and left, by name (it pickles: the stage cache stores the notes)."""

    taken: list[str] = dataclasses.field(default_factory=list)  # "input [shape] fp32 -> bf16"
    skipped: list[str] = dataclasses.field(default_factory=list)  # "input: why"
    bytes: int = 0  # the copies' bytes

    def __str__(self) -> str:
        return (f"{len(self.taken)} weights read through a cast read as a copy in that dtype "
                f"({self.bytes / 1e6:.1f} MB of copies), {len(self.skipped)} left as they are")


def _refusal(w) -> str | None:
    if type(w) not in (torch.Tensor, torch.nn.Parameter):
        return "not a plain tensor (a subclass, or no tensor)"
    if w.is_meta:
        return "a meta weight holds no data"
    return None


@torch.no_grad()
def copy_of(master: torch.Tensor, like) -> torch.Tensor:
    """The process's copy of `master` laid out as fake `like` (dtype, shape, strides), made now
    or found, holding master's values now."""
    key = (master.storage_offset(), tuple(master.shape), tuple(master.stride()), like.dtype,
           tuple(like.stride()))
    with unset_fake_temporarily():
        copies = _COPIES.setdefault(master.untyped_storage(), {})
        copy = copies.get(key)
        if copy is None:
            copy = copies[key] = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype,
                                                     device=master.device)
        copy.copy_(master)
    return copy


def _weights(placeholders: list[fx.Node], ctx):
    """(position, placeholder, its value, `_reads` of it) of each float graph input that is no
    caller's input and is read."""
    for i, p in enumerate(placeholders):
        val = p.meta.get("val")
        if (i not in ctx.user_inputs and isinstance(val, torch.Tensor)
                and val.dtype.is_floating_point and p.users):
            yield i, p, val, _reads(p)


def cast_inputs(gm: fx.GraphModule, ctx) -> Cast | None:
    """Rewrite gm's weights read through a cast (see the module docstring), replacing their real
    tensors in `ctx.inputs` by the copies; the mapping for the executor, or None where none was
    taken. The report goes to `ctx.notes["weight_cast"]` where any weight was taken or left."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(ctx.inputs):
        return None
    found = Cast()
    position = {n: k for k, n in enumerate(graph.nodes)}
    for i, p, val, reads in _weights(placeholders, ctx):
        if isinstance(reads, str):
            if _narrowed(p):
                found.report.skipped.append(f"{p.name} {list(val.shape)}: {reads}")
            continue
        views, casts, dtype = reads
        if dtype not in LOW or val.dtype.itemsize <= dtype.itemsize:
            continue
        name = f"{p.name} {list(val.shape)} {val.dtype} -> {dtype}"
        if (why := _refusal(ctx.inputs[i])) is not None:
            found.report.skipped.append(f"{name}: {why}")
            continue
        master = ctx.inputs[i]
        p.meta["val"] = fake_value(prims.convert_element_type.default, (p, dtype))
        p.meta.pop("tensor_meta", None)
        for cast in casts:
            cast.replace_all_uses_with(cast.args[0])
            graph.erase_node(cast)
        for view in sorted(views, key=position.__getitem__):  # each after its input
            view.meta["val"] = fake_value(view.target, view.args, view.kwargs)
            view.meta.pop("tensor_meta", None)
        copy = copy_of(master, p.meta["val"])
        ctx.inputs[i] = copy
        found.positions.append(i)
        found.copies.append(copy)
        found.fakes.append(p.meta["val"])
        found.masters.append(master)
        found.report.taken.append(name)
        found.report.bytes += copy.nbytes
    if found.positions:
        graph.lint()
        gm.recompile()
    if found.positions or found.report.skipped:
        ctx.notes["weight_cast"] = found.report
        log.info("k3 weight_cast: %s%s", found.report,
                 "".join(f"\n  skipped {s}" for s in found.report.skipped))
    return found if found.positions else None


def castable(gm: fx.GraphModule, ctx) -> int:
    """How many of gm's weights the stage would read as a copy in a lower float dtype (the
    `cast_inputs` test, nothing changed)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return sum(not isinstance(reads, str) and reads[2] in LOW
               and val.dtype.itemsize > reads[2].itemsize
               for _, _, val, reads in _weights(placeholders, ctx))


_HINTED = False


def hint(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """With the stage off: a warning, once per process, where a graph reads weights only through
    a cast to a lower float dtype (fp32 masters under `torch.autocast`), whose GEMMs no pattern
    fuses; the stage would take them."""
    global _HINTED
    if not _HINTED and (count := castable(gm, ctx)):
        _HINTED = True
        log.warning("k3: %d fp32 weights are read only through a cast to bf16 / fp16 (fp32 master "
                    "weights under torch.autocast?): no GEMM fusion takes a cast weight. "
                    "K3_WEIGHT_CAST=1 (option weight_cast) reads them as copies in that dtype, "
                    "kept fresh unless written through `param.data` (README, weights)", count)
    return gm


def weight_cast(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage (on with `Options.weight_cast`): the mapping goes to the executor through
    `ctx.weight_cast`."""
    ctx.weight_cast = cast_inputs(gm, ctx)
    return gm
