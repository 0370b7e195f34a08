"""Stage `kernel_layout`: a weight stored [in, out] (a Flax kernel applied as `x @ kernel`) is read
by the graph as the [out, in] tensor that F.linear reads, so that the patterns, the fused ops and
their kernels, which take a projection's weight as contiguous [N, K] rows, see the same graph as
for an `nn.Linear` weight.

Before (W a graph input [K, N], contiguous):     mm(x2d, W)
After  (W the [N, K] tensor Wᵀ, contiguous):     mm(x2d, permute(W, [1, 0]))

The placeholder itself changes meaning: the graph the later stages get takes Wᵀ [N, K] in W's
position, and every reader of W reads `permute(Wᵀ, [1, 0])` (one per reader, as each F.linear
traces its own; a dtype cast of W becomes the cast of Wᵀ, permuted). The executor's wrapper
(`Transposed.wrap`) hands the compiled graph `W.t()` at every call: a view, no copy, where W is
laid out as the transpose of a contiguous [N, K] tensor. So the weight is re-laid, once: its
Parameter's storage becomes a fresh contiguous [N, K] buffer and the Parameter the `.t()` view of
it (`param.data = buffer.t()`): the same shape, values, dtype, device and Parameter object,
**other strides** ((1, K) instead of (N, 1)). The first call of the step does it, not
the compile: Dynamo checks the guards it made on the frame that made them, after the backend
returns, and they hold the parameters' strides. Those stride guards then compile the step again
at its next call (once per Dynamo graph that saw the old layout); that compile finds the weights
laid out so, reads them as Wᵀ without a move, and stage `pack` moves Wᵀ into a fused group's
buffer as it moves any weight (`pack.TRANSPOSE_OF` names the Parameter that follows it).

A weight is read transposed only where every reader reaches a GEMM (mm, bmm) through views and
dtype casts, and at least one of them, and none the other way, contracts over the weight's whole
first dim: the [in, out] orientation (an `nn.Linear` weight read as `permute(W)` contracts over
its second dim; a Flax kv_b's W_UK half contracts over part of a dim and decides nothing). A
weight read otherwise too (`W[0]` into an add, an output of the graph), a 1-wide one, a state the
graph writes, a caller's input, a non-float or non-2-D tensor is left as it is.

The move is refused (the weight stays [K, N], its GEMMs unfused as before, the reason logged)
where it could not carry every holder of the weight along: a tensor subclass, a weight that
requires grad in grad mode, a meta weight, one an earlier k3 compile was handed (a captured CUDA
graph reads its address), one that shares its storage (tied) or is a view into a larger storage,
and with `pack_weights` off (K3_PACK_WEIGHTS=0: no weight moves). A weight laid out so already
is read as Wᵀ without a move, whatever the options.

Values: a GEMM over Wᵀ's contiguous rows may sum in another order than over W (CPU BLAS), so
results equal the unfused [K, N] graph's to rounding, as F.linear on the [out, in] weight does
(the user's eager model, reading the re-laid Parameter, rounds the same way). Tensors on the old
storage (a `state_dict()` taken or a `.data` saved before the first call) keep the old layout
and memory: unlike pack's moves, the storage cannot be re-pointed, since the element order
differs; writes through the Parameter (`copy_`, `load_state_dict`, `param.data.copy_`) are seen.

Runs first in `Pipeline.run`, before the stage cache's key (the key is the rewritten graph's), on
every compile, a cache hit included: it acts on the process's weights, as `pack` does.

Stage `conv_layout` (in this module, run after `fuse` on every compile, before `pack`) re-lays the
same way a weight that a fused op's kernel reads contiguous but the graph hands it through a
permutation: spell9's Flax conv kernels [taps, 1, C], which rule cell_conv binds as kda_decode's
[C, 1, taps] conv weights (`permute(kernel, [2, 1, 0])`, strides (1, C, C)). The first call makes
each such Parameter the permuted-back view of a contiguous [C, 1, taps] buffer (`_relay` for any
permutation); the graph is left as it is (it still reads `permute(kernel)`, now a contiguous
view). The same refusals as above apply, and a weight read otherwise too is left alone. The graph
compiled before the re-lay was compiled for the old strides (Inductor bakes them into its code),
so its first call is handed the old tensors, which still hold the same values (`Permuted.wrap`).

Both re-lays change a Parameter's strides at the first call, so the bucket compiled before it
is compiled again at its next call (k3compile/backend.py, `K3Compiled._compile_bucket`), where
the weights are laid out so already: on torch 2.11 too, whose Dynamo does not compile the step
again after the strides change (torch 2.13's does, through its stride guards).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from k3compile.graph import RESHAPES, call, written_in_place
from k3compile.stages.addresses import Addresses
from k3compile.stages.pack import TRANSPOSE_OF, unwritable

log = logging.getLogger("k3compile")
aten, prims = torch.ops.aten, torch.ops.prims

GEMMS = {aten.mm.default: (1, 0), aten.bmm.default: (2, 1)}  # contracted dim of (a, b)
VIEWS = RESHAPES | {
    aten.permute.default, aten.t.default, aten.transpose.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
    aten.select.int, aten.slice.Tensor, aten.alias.default, aten.split.Tensor,
    aten.split_with_sizes.default,
}
CASTS = {aten._to_copy.default, prims.convert_element_type.default, aten.clone.default}
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass
class Transposed:
    """The graph inputs read as their transpose: `positions`, with the new example values."""

    positions: list[int]
    fakes: list  # the [N, K] example value of each, in `positions` order
    pending: list[int] = dataclasses.field(default_factory=list)  # re-laid by the first call
    moved: list[str] = dataclasses.field(default_factory=list)  # "input [K, N]": to re-lay
    kept: list[str] = dataclasses.field(default_factory=list)  # laid out so already
    skipped: list[str] = dataclasses.field(default_factory=list)  # "input: why"

    def __str__(self) -> str:
        return (f"{len(self.positions)} [in, out] weights read as [out, in] ({len(self.moved)} "
                f"re-laid by the first call, {len(self.kept)} laid out so already), "
                f"{len(self.skipped)} left as they are")

    def inputs(self, originals: list) -> list:
        """The rewritten graph's example inputs, from the original graph's."""
        return placed(originals, self.positions, self.fakes)

    def wrap(self, fn):
        """A boxed callable of the original inputs that calls boxed `fn` with each weight's `.t()`
        in its place: a view where the weight is laid out so. The weights this compile chose to
        re-lay are re-laid by the first call (not by the compile: Dynamo checks its guards on the
        frame that made them, after the backend returns), which makes Dynamo's stride guards
        compile the step again at the next call. The views are made once and kept while every
        weight stays at its address (one C++ check per call where torch has it, as
        `stack_inputs` checks its parts; `param.data = t` moves one: the views are made again),
        and swapped in by one itemgetter: O(1) Python calls per step, whatever the count (900
        `.t()` per step cost 14 ms on the shared CPU). A weight not laid out so (never reached
        through Dynamo: its stride guards recompile first) is copied per call, logged once: the
        graph was compiled for contiguous [N, K]."""
        positions, pending = self.positions, list(self.pending)
        kept: dict = {}  # "views", "addresses", "pick": what the last call made

        def made(args: list) -> list:
            views = [w if w.is_contiguous() else _copied(w) for w in (args[i].t() for i in positions)]
            count = len(args)
            slot = {i: count + k for k, i in enumerate(positions)}
            picks = [slot.get(j, j) for j in range(count)]
            kept.clear()
            if all(v.data_ptr() == args[i].data_ptr() for i, v in zip(positions, views)):
                kept.update(views=views, addresses=Addresses.of(args, positions),
                            pick=operator.itemgetter(*picks) if count > 1 else None)
            return views

        def unchanged(args: list) -> bool:
            return bool(kept) and kept["addresses"].same(args)

        def call(args: list):
            if pending:
                for i in pending:
                    if not args[i].t().is_contiguous():
                        _relay(args[i])
                pending.clear()
            views = kept["views"] if unchanged(args) else made(args)
            pick = kept.get("pick")
            if pick is None:  # copies (never kept) or a single input
                new = list(args)
                for i, v in zip(positions, views, strict=True):
                    new[i] = v
            else:
                args.extend(views)
                new = list(pick(args))
            args.clear()
            return fn(new)

        call._boxed_call = True
        return call


def placed(originals: list, positions: list[int], values: list) -> list:
    """A copy of the list `originals` with `values[k]` at `positions[k]` (an input-mapping stage's
    example inputs: this one's, weight_cast's)."""
    new = list(originals)
    for i, value in zip(positions, values, strict=True):
        new[i] = value
    return new


def _copied(w: torch.Tensor) -> torch.Tensor:
    _warn_copy(tuple(w.shape))
    return w.contiguous()


@functools.cache
def _warn_copy(shape) -> None:
    log.warning("k3 kernel_layout: a weight read as [out, in] %s is not laid out so; it is copied "
                "on every call", list(shape))


# ---- which inputs -----------------------------------------------------------------------------

def _replay(shape, chain: list[fx.Node]) -> torch.Tensor | None:
    t = torch.empty(shape, device="meta")
    try:
        for node in chain:
            if node.target in CASTS:
                continue
            target = aten.view.default if node.target in RESHAPES else node.target
            t = target(t, *node.args[1:], **node.kwargs)
    except (RuntimeError, ValueError):  # a view the layout cannot take raises ValueError on meta
        return None
    return t


def _gemm_reads(p: fx.Node) -> list[tuple[list[fx.Node], fx.Node, int]] | None:
    """(chain of views and casts, GEMM, operand index) of every path from p to a GEMM; None where
    some reader of p, through views and casts, is no GEMM."""
    reads, stack = [], [[p]]
    while stack:
        chain = stack.pop()
        for user in chain[-1].users:
            if user.op != "call_function":
                return None
            args = [a for a in (*user.args, *user.kwargs.values()) if isinstance(a, fx.Node)]
            if user.target in GEMMS and args.count(chain[-1]) == 1:
                reads.append((chain[1:], user, user.args.index(chain[-1])))
            elif ((user.target in VIEWS or user.target in CASTS) and args == [chain[-1]]
                  and user.args[0] is chain[-1]):
                if user.target in (aten.split.Tensor, aten.split_with_sizes.default):
                    return None  # its pieces are read through getitem
                stack.append([*chain, user])
            else:
                return None
    return reads


def _orientation(shape, chain: list[fx.Node], gemm: fx.Node, operand: int) -> str | None:
    """"in_out" where the GEMM contracts over W's whole dim 0, "out_in" over its whole dim 1,
    None otherwise (part of a dim, or a layout the replay cannot tell)."""
    t = _replay(shape, chain)
    if t is None:
        return None
    if gemm.target is aten.bmm.default and t.dim() == 2:
        return None
    dim = GEMMS[gemm.target][operand]
    k, n = shape
    size, stride = t.shape[dim], t.stride(dim)
    if size == k and stride == n:
        return "in_out"
    if size == n and stride == 1:
        return "out_in"
    return None


def _in_out(p: fx.Node) -> bool:
    val = p.meta.get("val")
    if (not isinstance(val, torch.Tensor) or val.dim() != 2 or val.dtype not in FLOATS
            or min(val.shape) < 2 or written_in_place(p)):
        return False
    reads = _gemm_reads(p)
    if not reads:
        return False
    ways = {_orientation(tuple(val.shape), *read) for read in reads}
    return "in_out" in ways and "out_in" not in ways


# ---- the real weights -------------------------------------------------------------------------

def _refusal(w, pack_weights: bool) -> str | None:
    if type(w) not in (torch.Tensor, torch.nn.Parameter):
        return "not a plain tensor (a subclass, or no tensor)"
    if w.is_meta:
        return "a meta weight holds no data"
    if torch.is_grad_enabled() and w.requires_grad:
        return "it requires grad in grad mode"
    if not pack_weights:
        return "pack_weights is off (K3_PACK_WEIGHTS=0: no weight moves)"
    return unwritable(w)


@torch.no_grad()
def _relay(w: torch.Tensor, dims: tuple[int, ...] = (1, 0)) -> None:
    """w's storage becomes the contiguous `w.permute(dims)`, w its view permuted back: for an
    [in, out] weight a contiguous [N, K] buffer, w its `.t()` view."""
    back = sorted(range(len(dims)), key=dims.__getitem__)
    w.data = w.detach().permute(dims).contiguous().permute(back)


# ---- the stage --------------------------------------------------------------------------------

def transpose_inputs(gm: fx.GraphModule, ctx) -> Transposed | None:
    """Rewrite gm's [in, out] weights (see the module docstring), re-laying their real tensors in
    `ctx.inputs` (which then hold each weight's `.t()`); the mapping for the executor, or None
    where no input is read transposed."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(ctx.inputs):
        return None
    found = Transposed([], [])
    for i, p in enumerate(placeholders):
        if i in ctx.user_inputs or not _in_out(p):
            continue
        w = ctx.inputs[i]
        name = f"{p.name} {list(p.meta['val'].shape)}"
        if isinstance(w, torch.Tensor) and type(w) in (torch.Tensor, torch.nn.Parameter) \
                and w.dim() == 2 and w.t().is_contiguous():
            found.kept.append(name)
        elif (why := _refusal(w, ctx.options.pack_weights)) is not None:
            found.skipped.append(f"{name}: {why}")
            continue
        else:
            found.pending.append(i)
            found.moved.append(name)
        with unset_fake_temporarily():
            wt = w.t()
        TRANSPOSE_OF[wt] = w
        ctx.inputs[i] = wt
        found.positions.append(i)
        found.fakes.append(_read_transposed(graph, p))
    if found.positions:
        gm.recompile()
    if found.positions or found.skipped:
        log.info("k3 kernel_layout: %s%s", found,
                 "".join(f"\n  skipped {s}" for s in found.skipped))
    return found if found.positions else None


# ---- conv_layout ------------------------------------------------------------------------------

CONV_WEIGHTS = ("q_conv_weight", "k_conv_weight", "v_conv_weight")
# the fused ops' arguments their CUDA kernels read contiguous, where a spelling may hand them a
# permuted view of a weight (kernels/kda_decode.py's `refusal`: contiguous [C, 1, taps])
CONTIGUOUS_ARGS = {"kda_decode": CONV_WEIGHTS, "fb_kda_decode": CONV_WEIGHTS}


@dataclasses.dataclass
class Permuted:
    """Graph inputs a fused op reads through a permutation: position -> its dims, re-laid by the
    first call so that the permuted view is contiguous."""

    pending: dict[int, tuple[int, ...]]
    moved: list[str] = dataclasses.field(default_factory=list)  # "input [shape]": to re-lay
    skipped: list[str] = dataclasses.field(default_factory=list)  # "input: why"
    strides: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # compiled for

    def wrap(self, fn):
        """Boxed `fn`, its first call re-laying the pending weights first (not the compile: see
        `Transposed.wrap`); the bucket is compiled again at its next call. `fn` was compiled for
        the weights' old strides (Inductor bakes an input's strides into its code), so the first
        call hands it the old tensors (the old storage, still holding the same values), and any
        later call that still reaches it a copy laid out as it was compiled for (logged once)."""
        pending, strides = dict(self.pending), dict(self.strides)

        def call(args: list):
            new = None
            for i, dims in pending.items():
                w = args[i]
                if not w.permute(dims).is_contiguous():
                    old = w.detach()  # the old storage and strides, as fn was compiled for
                    _relay(w, dims)
                    new = new or list(args)
                    new[i] = old
            pending.clear()
            for i, stride in strides.items():
                w = (new or args)[i]
                if w.stride() != stride:  # re-laid, and this graph still called: a copy
                    _warn_layout(tuple(w.shape))
                    new = new or list(args)
                    new[i] = torch.empty_strided(w.shape, stride, dtype=w.dtype,
                                                 device=w.device).copy_(w)
            return fn(args if new is None else new)

        call._boxed_call = True
        return call


@functools.cache
def _warn_layout(shape) -> None:
    log.warning("k3 conv_layout: a graph compiled before weight %s was re-laid is called again; "
                "the weight is copied into its old layout on every such call", list(shape))


def _contiguous_reads(graph: fx.Graph) -> dict[fx.Node, set[fx.Node]]:
    """Each node that a fused op takes as an argument its kernel reads contiguous -> the ops."""
    found: dict[fx.Node, set[fx.Node]] = {}
    for op, names in CONTIGUOUS_ARGS.items():
        packet = getattr(torch.ops.k3, op, None)
        if packet is None:
            continue
        for node in graph.find_nodes(op="call_function", target=packet.default):
            schema = [a.name for a in node.target._schema.arguments]
            for name in names:
                i = schema.index(name)
                arg = node.args[i] if i < len(node.args) else node.kwargs.get(name)
                if isinstance(arg, fx.Node):
                    found.setdefault(arg, set()).add(node)
    return found


def _permutation(p: fx.Node, reads: dict) -> tuple[int, ...] | None:
    """The dims every reader of p permutes it by, where each reader is such a permute and only
    fused ops' contiguous arguments read the permutes; None otherwise."""
    dims = None
    for user in p.users:
        if (user.target is not aten.permute.default or user.args[0] is not p
                or user not in reads or len(user.users) != len(reads[user])):
            return None
        if dims not in (None, tuple(user.args[1])):
            return None
        dims = tuple(user.args[1])
    return dims


def permuted_inputs(gm: fx.GraphModule, ctx) -> Permuted | None:
    """The graph inputs to re-lay at the first call (see the module docstring), or None."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(ctx.inputs):
        return None
    reads = _contiguous_reads(gm.graph)
    # inputs another wrapper maps (a `.t()`, a copy): not the tensor Permuted.wrap would re-lay
    mapped = {i for m in (ctx.transposed, ctx.weight_cast) if m is not None for i in m.positions}
    found = Permuted({})
    for i, p in enumerate(placeholders):
        if i in ctx.user_inputs or i in mapped or not p.users or written_in_place(p):
            continue
        if (dims := _permutation(p, reads)) is None:
            continue
        w = ctx.inputs[i]
        name = f"{p.name} {list(p.meta['val'].shape)}"
        with unset_fake_temporarily():
            if not isinstance(w, torch.Tensor) or w.permute(dims).is_contiguous():
                continue
        if (why := _refusal(w, ctx.options.pack_weights)) is not None:
            found.skipped.append(f"{name}: {why}")
            continue
        found.pending[i] = dims
        found.strides[i] = tuple(w.stride())
        found.moved.append(name)
    if found.moved or found.skipped:
        log.info("k3 conv_layout: %d weights a fused op reads permuted, re-laid by the first "
                 "call: %s%s", len(found.moved), ", ".join(found.moved),
                 "".join(f"\n  skipped {s}" for s in found.skipped))
    return found if found.pending else None


def conv_layout(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage: the weights to re-lay go to the executor through `ctx.permuted`."""
    ctx.permuted = permuted_inputs(gm, ctx)
    return gm


def _read_transposed(graph: fx.Graph, p: fx.Node):
    """p stands for Wᵀ from now on: each reader reads permute(Wᵀ) (a cast: the cast of Wᵀ,
    permuted). Returns p's new example value."""
    old = p.meta["val"]
    p.meta["val"] = new = old.new_empty(old.shape[::-1])
    for user in list(p.users):
        with graph.inserting_before(user):
            if user.target in CASTS and user.args[0] is p:
                cast = call(graph, user.target, (p, *user.args[1:]), user.kwargs, like=user)
                user.replace_all_uses_with(
                    call(graph, aten.permute.default, (cast, [1, 0]), like=user))
                graph.erase_node(user)
            else:
                user.replace_input_with(p, call(graph, aten.permute.default, (p, [1, 0]),
                                                like=user))
    return new


def kernel_layout(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage: the mapping goes to the executor through `ctx.transposed`."""
    ctx.transposed = transpose_inputs(gm, ctx)
    return gm
