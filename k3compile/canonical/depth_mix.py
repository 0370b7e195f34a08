"""Rule `depth_mix`: the Attention-Residual depth mix's foreign spellings -> the form
`k3compile.math.depth_mix` traces to, which `patterns/attn_res_mix_norm.py` matches:

    sources = torch.stack([*blocks, prefix])              cat(srcs) + view [S, ..., D]
    alpha = softmax(proj(norm(sources)), dim=0)           amax, sub, exp, sum, div over dim 0
    h = (alpha.unsqueeze(-1) * sources.float()).sum(0)    unsqueeze, mul, sum over dim 0, fp32

Anchored on the softmax over the sources (dim 0) and the stacked sources it is computed from,
the rule rewrites
* the stack built as `torch.cat([s.unsqueeze(0) for s in srcs])` -> cat + view, the stack's own
  decomposition (the same values, bit for bit);
* the weighted sum in any spelling that reads only alpha and the sources: an einsum
  (`"s...d,s...->...d"`: permutes + bmm), a Python loop `sum(alpha[i, ..., None] * src_i)` over
  the stack or over the source list, `matmul`, ... The region between alpha and the node where it
  closes (the first node of the sources' trailing shape that every path from alpha runs through)
  is evaluated once on random alpha and sources against the canonical sum before it is replaced:
  an equal region differs from it by summation order only (fp32, checked to 1e-5 relative); a
  weighted sum computed in bf16, or of other weights, fails the check and is left alone.

Sources stacked along another dim (`[B, T, S, D]` from `torch.cat` of `unsqueeze(-2)`s or
`torch.stack(dim=-2)`, `[N, S, D]` from `stack(dim=1)` or Moonshot's block list grown by cats
from `new_zeros(N, 0, D)`), the softmax over that dim (scores squeezed or kept `[.., S, .., 1]`),
the weighted sum over it in any spelling (`sum(-2)`, einsum, `matmul` / `bmm`): the whole mix,
from the sources to its fp32 weighted sum, is replaced by `k3compile.math.depth_mix_weights`
traced over the same sources, with the two weights of D values and the eps the scores read.
Where the sources are [B, T, D] tensors flattened to tokens (`.view(-1, D)`) and the mix is
viewed back, the canonical mix takes the unflattened sources; so it does where the stack itself
is flattened (spell11: `cat([bank, prefix.unsqueeze(-2)], -2).float().flatten(0, 1)`, [B, T, S,
D] -> [B*T, S, D], S at dim k >= 1 after the merged leading dims) and the mix is viewed back to
[B, T, D]: the stack is read as the sources' stack along its own dim, flattened (`_merged`; the
check evaluates it so). The scores' rsqrt may come after the projection (`bmm(v, w) * rsqrt`):
r·Σ_d v_d·q_d against Σ_d (r·v_d)·q_d, the factor taken out of the sum, within fp32 rounding
(measured on a toy of spell11's mix: <= 2e-7 relative; its test bounds 1e-6). The
blocks may also sit in a
preallocated bank [N, nb, D] written by slice assignment (`bank[:, j] = block`: a chain of
select_scatter / slice_scatter) and read `bank[:, :n]`: each read index is the tensor last
written there, and the mix is taken only where every index read is so written (statically); an
unwritten slot (the bank's zeros) leaves the mix alone. A one-block `torch.stack([b], dim=1)`
(a view, no cat) is a stack of one source. The mix is read structurally
(sources, weights, eps, where the sum closes) and taken only if it evaluates, on random sources
and weights, to the canonical mix within RTOL (which role each weight plays is decided there).

What that check admits, and why it is sound: in fp32 the canonical form rounds only in fp32, so
a spelling that differs by summation order (the mm's dot products, the weighted sum) or by the
association of a product is within its rounding. Moonshot's fold `(w_norm * w_proj)` applied to
the normalised sources is one: Σ_d h_d·fl(wn_d·wp_d) against Σ_d fl(wn_d·h_d)·wp_d, the same
three fp32 factors per term, each side within 2 roundings of the exact term (measured: <= 3e-7
relative on the mix), so the fold is taken in fp32. In bf16 the canonical form rounds the
normalised sources, their product with w_norm and the projection to bf16, which the fold (all
in fp32) does not: the mix differs by up to 7e-3 (measured), not rounding order. A bf16 spelling
with the canonical roundings (transformers' RMSNorm + `nn.Linear`, as in tests/models/hf_k3.py)
evaluates bit-equal and is taken. A mix that is not the built-in form is then tried against the
second canonical form, the scores in fp32 throughout (`k3compile.math.depth_mix_scores_fp32`,
Moonshot's bf16 mix; `attn_res_mix_norm`'s `scores_fp32` variants), by the same check.

Sources never stacked (spell12): each scored by its own chain (`vecdot(normalise(v_i),
query)`), the n scores stacked along k and softmaxed, the mix a sum of the n terms
`alpha[.., i, ..] * v_i` (a running Python sum, in any order; a select or a one-wide slice of
alpha, each index once): the sources are the terms' (`_scored_apart`), and the whole mix is
rebuilt as above, by the same check. Exact where it matters: a source's vecdot is its row's
`sum(x * q, -1)`, the stacked scores' own reduction (0 ulps, measured at D = 16 and 7168); the
built-in form's scores (norm weight, then the projection's mm) differ from the folded query
by fp32 rounding (<= 8e-7 relative to the largest score, measured); the running sum against
`sum(-2)`: 0 ulps at D = 7168 (CPU sums the strided dim in order), <= 2 ulps of Σ|terms| at
D = 16; the whole mix <= 6.1e-7 relative (n = 2..13; RTOL 1e-5 admits it). In bf16 the
spelling's scores and sum are fp32 throughout, one rounding at the end: the fp32-scores form,
rounding where the spelling rounds (measured: <= 1 % of the elements differ, by <= half a bf16
ulp of the mix's largest: the fp32 differences above, flipping a rounding).

Sources stacked on dim 0 whose scores are spelled otherwise than a canonical form are first
tried as a whole mix against the canonical one, as above; where that check fails, the first
path runs. Such scores: a graph whose ops (views aside) are no canonical form's, as a paper's
reference code writes them (tests/models/spell8_k3.py):

    v = torch.stack(bank + [prefix], dim=0).float()
    normed = v / torch.sqrt(torch.mean(v ** 2, -1, keepdim=True) + eps)
    scores = torch.einsum("s...d,d->s...", normed, w_norm * w_proj[0])   # folded weights
    h = torch.einsum("s...,s...d->...d", torch.softmax(scores, 0), v)

or scores that reach the softmax through no GEMM, so cannot be the canonical projection
(`F.rms_norm(sources, weight=w_norm * w_proj).sum(-1)`, spell7). A mix whose graph already has
a canonical form's ops and a GEMM goes to the first path only, so the built-in model's graph
does not change. (Until session 27 the first kind was rule `depth_mix_scores`, run over the
whole graph before this one; one rule now, the same rewrites.)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import math

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import call_on_cpu
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.graph import call
from k3compile.math import depth_mix_scores_fp32, depth_mix_weights
from k3compile.rewrite import inductor

aten, prims = torch.ops.aten, torch.ops.prims
log = logging.getLogger("k3compile")
RTOL = 1e-5  # summation order in fp32
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims,
          aten.select.int, aten.slice.Tensor, aten.expand.default, aten.clone.default,
          aten.alias.default, prims.convert_element_type.default, aten.t.default,
          aten.transpose.int}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
             aten.squeeze.dims, aten.clone.default, aten.alias.default}
_FLATTEN = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# what a weighted sum of sources may be spelled with
_SUM_OPS = _VIEWS | {aten.mul.Tensor, aten.add.Tensor, aten.sum.dim_IntList, aten.bmm.default,
                     aten.mm.default, aten.div.Tensor, aten.sub.Tensor}
_GEMMS = (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.matmul.default)
REACH = 24  # how far back from the softmax the stacked sources may be
FORMS = (depth_mix_weights, depth_mix_scores_fp32)  # the canonical mixes, in the order tried


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


# ---- the anchor: softmax over the sources --------------------------------------------------------


def _softmax_dim(div: fx.Node) -> int | None:
    """d (>= 0) if div is softmax(x, dim=d) as it decomposes: exp(x - amax(x, d)) / sum(., d)."""
    if not _is(div, aten.div.Tensor) or _val(div) is None:
        return None
    exp, total = div.args
    if not (_is(exp, aten.exp.default) and _is(total, aten.sum.dim_IntList) and total.args[0] is exp
            and _is(exp.args[0], aten.sub.Tensor) and _is(exp.args[0].args[1], aten.amax.default)):
        return None
    dims = {_dims(total.args[1], div), _dims(exp.args[0].args[1].args[1], div)}
    return dims.pop()[0] if len(dims) == 1 and len(next(iter(dims))) == 1 else None


def _dims(dims, node: fx.Node) -> tuple[int, ...]:
    rank = _val(node).dim()
    return tuple(sorted(d % rank for d in dims))


# ---- the stacked sources ------------------------------------------------------------------------


def _stacked(node: fx.Node, width: int | None = None) -> list[fx.Node] | None:
    """The sources if node is torch.stack(sources) (cat + view) or cat of unsqueeze(0)s."""
    if _is(node, aten.view.default) and _is(node.args[0], aten.cat.default):
        cat = node.args[0]
        srcs = list(cat.args[0])
        if (len(cat.args) == 1 or cat.args[1] == 0) and _shape(node) == (len(srcs),
                                                                           *_shape(srcs[0])):
            return srcs if all(_shape(s) == _shape(srcs[0]) for s in srcs) else None
    if _is(node, aten.cat.default) and (len(node.args) == 1 or node.args[1] == 0):
        parts = list(node.args[0])
        if all(_is(p, aten.unsqueeze.default) and p.args[1] == 0 for p in parts):
            srcs = [p.args[0] for p in parts]
            if all(_shape(s) == _shape(srcs[0]) for s in srcs):
                return srcs
    return None


def _sources(alpha: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(stacked sources [S, ..., D], the sources) that alpha's scores are computed from."""
    def found(x):
        shape = _shape(x)
        if shape and shape[:-1] == _shape(alpha) and (srcs := _stacked(x)) is not None:
            return x, srcs
        return None

    return _nearest_input(alpha, found)


def _as_stack(graph: fx.Graph, cat: fx.Node, srcs: list[fx.Node]) -> fx.Node:
    """cat of unsqueeze(0)s -> torch.stack's own cat + view."""
    with graph.inserting_before(cat):
        flat = call(graph, aten.cat.default, (list(srcs),), like=cat)
        stack = call(graph, aten.view.default, (flat, list(_shape(cat))), like=cat)
    cat.replace_all_uses_with(stack)
    return stack


# ---- the weighted sum ---------------------------------------------------------------------------


def _closing(alpha: fx.Node, shape: tuple, limit: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the node every use of alpha runs into, the region between) if it has `shape`, is fp32 and
    the region holds only what a weighted sum is spelled with."""
    region, node = [alpha], alpha.next
    inside = {alpha}
    for _ in range(limit):
        if node.op != "call_function":
            return None
        if any(x in inside for x in node.all_input_nodes):
            if node.target not in _SUM_OPS:
                return None
            region.append(node)
            inside.add(node)
            if _fits(node, shape) and all(u in inside for n in region[:-1] for u in n.users):
                return _past_reshapes(region, shape)
        node = node.next
    return None


def _fits(node: fx.Node, shape: tuple) -> bool:
    return _shape(node) == shape and _val(node).dtype == torch.float32


def _past_reshapes(region: list[fx.Node], shape: tuple) -> tuple[fx.Node, list[fx.Node]]:
    """Extend the region through the reshapes that follow its end (a bmm's [B*T, 1, D] result
    viewed back to [B, T, D]) to the last one of the sources' shape."""
    end, node, tail = len(region), region[-1], []
    while len(node.users) == 1 and next(iter(node.users)).target in _RESHAPES:
        node = next(iter(node.users))
        tail.append(node)
        if _fits(node, shape):
            region += tail
            tail = []
            end = len(region)
    return region[end - 1], region[1:end]


def _canonical(out: fx.Node, alpha: fx.Node, stack: fx.Node) -> bool:
    mul = out.args[0]
    if not (_is(out, aten.sum.dim_IntList) and list(out.args[1]) == [0] and _is(mul, aten.mul.Tensor)):
        return False
    ops = set(mul.args)
    f32 = [x for x in ops if _is(x, prims.convert_element_type.default) and x.args[0] is stack]
    unsq = [x for x in ops if _is(x, aten.unsqueeze.default) and x.args[0] is alpha]
    return bool(unsq) and (stack in ops or bool(f32))


def _inputs(region: list[fx.Node], alpha, stack, srcs) -> list[fx.Node] | None:
    """The nodes outside the region it reads, each a view chain back to the sources; the chain
    nodes in graph order, or None if the region reads anything else."""
    known, chain = {alpha, stack, *srcs, *region}, []
    todo = [x for n in region for x in n.all_input_nodes if x not in known]
    while todo:
        x = todo.pop()
        if x in known:
            continue
        if x.op != "call_function" or x.target not in _VIEWS:
            return None
        known.add(x)
        chain.append(x)
        todo += [y for y in x.all_input_nodes if y not in known]
    order = {n: i for i, n in enumerate(alpha.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def _evaluates_as_sum(out, region, chain, alpha, stack, srcs) -> bool:
    """The region, run on random alpha and sources, equals Σ_s alpha[s] · sources[s] in fp32."""
    gen = torch.Generator().manual_seed(0)
    with unset_fake_temporarily():
        unique = {s: torch.randn(_shape(s), generator=gen).to(_val(s).dtype) for s in srcs}
        env = {stack: torch.stack([unique[s] for s in srcs])}
        env |= unique
        a = torch.randn(_shape(alpha), generator=gen).softmax(0).to(_val(alpha).dtype)
        env[alpha] = a
        for node in [*chain, *region]:
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = call_on_cpu(node.target, args, kwargs)
        want = (a.unsqueeze(-1) * env[stack].float()).sum(0)
        got = env[out]
        if got.shape != want.shape or got.dtype != want.dtype:
            return False
        return float((got - want).abs().max()) <= RTOL * float(want.abs().max().clamp_min(1e-30))


def _weighted_sum(graph: fx.Graph, alpha: fx.Node, stack: fx.Node, srcs: list[fx.Node]) -> int:
    closing = _closing(alpha, _shape(stack)[1:], limit=8 * len(srcs) + 40)
    if closing is None:
        return 0
    out, region = closing
    if _canonical(out, alpha, stack):
        return 0
    chain = _inputs(region, alpha, stack, srcs)
    if chain is None or not _evaluates_as_sum(out, region, chain, alpha, stack, srcs):
        return 0
    with graph.inserting_before(out):
        weights = call(graph, aten.unsqueeze.default, (alpha, -1), like=out)
        values = stack if _val(stack).dtype == torch.float32 else call(
            graph, prims.convert_element_type.default, (stack, torch.float32), like=out)
        terms = call(graph, aten.mul.Tensor, (weights, values), like=out)
        total = call(graph, aten.sum.dim_IntList, (terms, [0]), like=out)
    out.replace_all_uses_with(total)
    return 1


# ---- sources stacked along another dim: the whole mix rebuilt -----------------------------------


@dataclasses.dataclass(frozen=True)
class Site:
    """A depth mix over sources stacked along dim k of [..., S, ..., D], up to `out`, the fp32
    weighted sum; `nodes` the graph between the sources and weights and out, in graph order."""

    srcs: list[fx.Node]
    out: fx.Node
    nodes: list[fx.Node]
    weights: list[fx.Node]  # the two graph inputs of D values the scores read
    eps: list[float]  # the float constants the scores add (the norm's eps among them)
    # the canonical mix's sources and the node it replaces: srcs and out, or, where the sources
    # are tokens flattened to [N, D] and out is viewed back (Moonshot's `.view(-1, D)`), the
    # unflattened sources and that view (out cast to `cast` on the way)
    tokens: list[fx.Node]
    end: fx.Node
    cast: torch.dtype | None = None
    # reads of a block bank written by scatters (`bank[:, j] = src`, read `bank[:, :n]`), and a
    # flattened stack (`_merged`): the read -> (the dim, the sources it stacks along it; the read
    # is that stack cast and reshaped to its own dtype and shape); the graph between starts there
    reads: dict = dataclasses.field(default_factory=dict)


def _parts(node: fx.Node, k: int, reads: dict | None = None) -> list[fx.Node] | None:
    """The sources a tensor stacked along dim k is built of: unsqueeze(src, k) (or a view that
    only inserts dim k: torch.stack of one tensor), cats along k of such parts (nested: a block
    list grown one cat at a time), torch.stack's cat + view, clones, empty parts (a list started
    as `new_zeros(N, 0, D)`), and a block bank written by scatters along k and read whole or
    sliced along k (`_written`; each such read, with its sources, goes into `reads`)."""
    val = _val(node)
    if val is None:
        return None
    rank = val.dim()
    if val.shape[k] == 0:
        return []
    if _is(node, aten.clone.default) or _is(node, aten.alias.default):
        return _parts(node.args[0], k, reads)
    if _is(node, aten.unsqueeze.default) and node.args[1] % rank == k:
        return [node.args[0]]
    if _is(node, aten.cat.default) and _cat_dim(node) == k:
        found = [_parts(p, k, reads) for p in node.args[0]]
        return None if any(f is None for f in found) else [s for f in found for s in f]
    if _is(node, aten.view.default) and _is(node.args[0], aten.cat.default):
        cat = node.args[0]
        srcs = list(cat.args[0])
        shape = _shape(srcs[0])
        if (_cat_dim(cat) == k and all(_shape(s) == shape for s in srcs)
                and _shape(node) == (*shape[:k], len(srcs), *shape[k:])):
            return srcs
    if _is(node, aten.view.default) and isinstance(node.args[0], fx.Node):
        shape = _shape(node.args[0])
        if shape is not None and _shape(node) == (*shape[:k], 1, *shape[k:]):
            return [node.args[0]]  # torch.stack([x], dim=k): one source, no cat
    if node.op == "call_function" and node.target in _BANK_READS:
        found = _bank_read(node, k)
        if found is not None and reads is not None:
            reads[node] = (k, found)
        return found
    return None


# a block bank: written by scatters along the stack dim, read whole or by a slice along it
_SCATTERS = {aten.select_scatter.default, aten.slice_scatter.default}
_BANK_READS = _SCATTERS | {aten.slice.Tensor, aten.copy.default}


def _static(*xs) -> bool:
    return all(x is None or (isinstance(x, int) and not isinstance(x, bool)) for x in xs)


def _indices(node: fx.Node, k: int, first: int) -> range | None:
    """The indices along k a slice / slice_scatter (args dim, start, end, step from `first`) of
    a tensor of node.args[0]'s shape covers; None unless along k with static bounds, step > 0."""
    args = [*node.args[first:], None, None, None][:4]
    dim, start, end, step = args
    dim = node.kwargs.get("dim", 0 if dim is None else dim)
    start, end = node.kwargs.get("start", start), node.kwargs.get("end", end)
    step = node.kwargs.get("step", 1 if step is None else step)
    shape = _shape(node.args[0])
    if shape is None or not _static(dim, start, end, step) or step <= 0:
        return None
    if dim % len(shape) != k or not isinstance(shape[k], int):
        return None
    return range(*slice(start, end, step).indices(shape[k]))


def _bank_read(node: fx.Node, k: int) -> list[fx.Node] | None:
    """The sources of a bank read (a slice along k of a scatter chain, the chain itself, or a
    functional copy_ of a same-shaped tensor into it): each read index must be written
    (`_written`), else None (an unwritten entry is the bank's init, e.g. zeros: left alone)."""
    if _is(node, aten.copy.default):
        src = node.args[1]
        if (_shape(src) != _shape(node) or _val(src) is None
                or _val(src).dtype != _val(node).dtype):
            return None
        return _parts(src, k)
    if _is(node, aten.slice.Tensor):
        idx, base = _indices(node, k, 1), node.args[0]
    else:
        size = _shape(node)[k]
        idx, base = (range(size) if isinstance(size, int) else None), node
    if idx is None:
        return None
    known = _written(base, k)
    return [known[i] for i in idx] if all(i in known for i in idx) else None


def _written(node: fx.Node, k: int) -> dict[int, fx.Node]:
    """Index along k -> the tensor there, for the entries of node that are known: those written
    by a chain of select_scatter / slice_scatter along k with static indices (the latest write of
    an index wins; a slice_scatter's source must itself be a stack along k, else the entries it
    writes are unknown), those of a slice along k of such a chain, or those of a stack
    (`_parts`). A write along another dim or at an index not known statically ends the chain:
    nothing before it is known."""
    if _is(node, aten.slice.Tensor) and (idx := _indices(node, k, 1)) is not None:
        known = _written(node.args[0], k)  # a slice of a bank: its entries, renumbered
        return {n: known[i] for n, i in enumerate(idx) if i in known}
    if node.op != "call_function" or node.target not in _SCATTERS:
        parts = _parts(node, k)
        return dict(enumerate(parts)) if parts is not None else {}
    rank, src = _val(node).dim(), node.args[1]
    if _is(node, aten.select_scatter.default):
        dim, index = (*node.args[2:4], None, None)[:2]
        dim, index = node.kwargs.get("dim", dim), node.kwargs.get("index", index)
        size = _shape(node)[k]
        if not _static(dim, index) or index is None or dim % rank != k or not isinstance(size, int):
            return {}
        known = _written(node.args[0], k)
        known[index % size] = _copied(src)
        return known
    idx = _indices(node, k, 2)
    if idx is None:
        return {}
    known = _written(node.args[0], k)
    parts = _parts(src, k)
    for n, i in enumerate(idx):
        if parts is not None and len(parts) == len(idx):
            known[i] = parts[n]
        else:
            known.pop(i, None)
    return known


def _copied(src: fx.Node) -> fx.Node:
    """What a select_scatter writes: copy(view of the bank, x) (slice assignment, functionalised)
    is x where x has the view's shape and dtype (the copy is then the identity)."""
    if _is(src, aten.copy.default):
        x = src.args[1]
        if (isinstance(x, fx.Node) and _val(x) is not None and _shape(x) == _shape(src)
                and _val(x).dtype == _val(src).dtype):
            return x
    return src


def _cat_dim(cat: fx.Node) -> int:
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return dim % _val(cat).dim()


def _stacked_along(alpha: fx.Node, k: int) -> tuple[list[fx.Node], dict] | None:
    """(the sources of the stack [.., S (dim k), .., D] that alpha's scores are computed from,
    alpha being [.., S, ..] or [.., S, .., 1]; the bank reads among its parts, `_parts`)."""
    want = _shape(alpha)

    def found(x):
        shape = _shape(x)
        if shape and k < len(shape) - 1 and want in (shape[:-1], (*shape[:-1], 1)):
            reads = {}
            srcs = _parts(x, k, reads)
            if srcs is None and (merged := _merged(x, k)) is not None:
                srcs = _parts(*merged, reads)
                if srcs:
                    reads[x] = (merged[1], srcs)
            if srcs and all(_shape(s) == _shape(srcs[0]) for s in srcs):
                return srcs, reads
        return None

    return _nearest_input(alpha, found)


def _merged(x: fx.Node, k: int) -> tuple[fx.Node, int] | None:
    """(y, j) if x is a stack y [*lead, .., S (dim j), .., D] with its leading dims flattened
    into one (spell11's `cat(..., -2).float().flatten(0, 1)`: [B, T, S, D] -> [B*T, S, D]; the
    sources' cast to fp32 on the way), S then at dim k >= 1 of x; else None."""
    if x.op != "call_function" or x.target not in _FLATTEN or k < 1:
        return None
    y = x.args[0]
    if _is(y, prims.convert_element_type.default):
        y = y.args[0]
    shape, into = _shape(y), _shape(x)
    if shape is None or not all(isinstance(d, int) for d in (*shape, *into)):
        return None
    lead = len(shape) - len(into) + 1
    if lead < 2 or shape[lead:] != into[1:] or math.prod(shape[:lead]) != into[0]:
        return None
    return y, k + lead - 1


def _nearest_input(node: fx.Node, found):
    """found(x) of the first input x (breadth first, at most REACH steps up from node) for which
    it is not None, else None."""
    seen, frontier = set(), [node]
    for _ in range(REACH):
        nxt = []
        for n in frontier:
            for x in n.all_input_nodes:
                if x in seen:
                    continue
                seen.add(x)
                if (hit := found(x)) is not None:
                    return hit
                nxt.append(x)
        frontier = nxt
    return None


# ---- sources scored apart: one score chain per source, the mix a sum of terms --------------------


def _scored_apart(alpha: fx.Node, k: int) -> tuple[list[fx.Node], dict] | None:
    """(the sources in index order, no bank reads) of a mix that never stacks its sources
    (spell12): the softmax over a stack along k of n >= 2 scores, one chain per source
    (`vecdot(normalise(v_i), query)`), and the weighted sum a sum of the n terms
    `alpha[.., i, ..] * v_i` (a running Python sum, in any order), each index once. What the
    scores compute from which source is left to the random-value check (`_equals_canonical`)."""
    scores = alpha.args[0].args[0].args[0]  # softmax = exp(x - amax(x)) / sum: x
    if _is(scores, prims.convert_element_type.default):
        scores = scores.args[0]
    parts = _parts(scores, k)
    terms = _terms(alpha, k)
    if not parts or len(parts) < 2 or terms is None or sorted(terms) != list(range(len(parts))):
        return None
    srcs = [terms[i] for i in range(len(parts))]
    rows = _shape(parts[0])  # one score per token: the sources' shape without its last dim
    if any(_shape(p) != rows for p in parts) or any(_shape(s)[:-1] != rows for s in srcs):
        return None
    return srcs, {}


_TERM_VIEWS = {aten.unsqueeze.default, aten.view.default, aten.reshape.default,
               aten.expand.default}


def _terms(alpha: fx.Node, k: int) -> dict[int, fx.Node] | None:
    """Index i -> v_i for each use of alpha that is a term `alpha[.., i, .., None] * v_i` (a
    select, or a slice of one, along k, views, a mul with v_i or its cast to fp32); None if any
    use is not such a term or an index repeats."""
    size, terms = _shape(alpha)[k], {}
    for pick in alpha.users:
        if _is(pick, aten.select.int) and pick.args[1] % len(_shape(alpha)) == k:
            index = pick.args[2]
        elif _is(pick, aten.slice.Tensor) and (idx := _indices(pick, k, 1)) and len(idx) == 1:
            index = idx[0]
        else:
            return None
        node = pick
        while len(node.users) == 1 and next(iter(node.users)).target in _TERM_VIEWS:
            node = next(iter(node.users))
        mul = next(iter(node.users)) if len(node.users) == 1 else None
        if not _is(mul, aten.mul.Tensor) or not isinstance(index, int) or index % size in terms:
            return None
        v = mul.args[1] if mul.args[0] is node else mul.args[0]
        if _is(v, prims.convert_element_type.default) and v.args[1] == torch.float32:
            v = v.args[0]
        if not isinstance(v, fx.Node) or _val(v) is None:
            return None
        terms[index % size] = v
    return terms


def _site(alpha: fx.Node, k: int) -> Site | None:
    """The mix alpha belongs to: its sources, where its weighted sum closes, and what the graph
    between reads besides the sources (two weights of D values, constants; nothing else)."""
    # scored apart first: its sources are certain (the terms'), and a stack of scores [S, B, 1]
    # (T = 1) would read as a stack of sources with D = 1
    found = _scored_apart(alpha, k) or _stacked_along(alpha, k)
    if found is None:
        return None
    srcs, reads = found
    if not srcs or any(_val(s).dtype != _val(srcs[0]).dtype for s in srcs):
        return None
    if not all(isinstance(d, int) for d in _shape(srcs[0])):  # evaluated on concrete sizes
        return None
    closing = _closing(alpha, _shape(srcs[0]), limit=8 * len(srcs) + 40)
    if closing is None:
        return None
    out = closing[0]
    nodes, leaves = _between(out, {*srcs, *reads}, limit=40 + 12 * len(srcs))
    if nodes is None:
        return None
    width = _shape(srcs[0])[-1]
    first_use = {x: i for i, n in reversed(list(enumerate(nodes))) for x in n.all_input_nodes}
    weights = sorted((x for x in leaves if _val(x).numel() > 0), key=first_use.__getitem__)
    if len(weights) != 2 or any(_val(w).numel() != width for w in weights):
        return None
    eps = [a for n in nodes if n.target in (aten.add.Tensor, aten.add.Scalar)
           for a in n.args if isinstance(a, float)]
    return Site(srcs, out, nodes, weights, eps, *_unflattened(srcs, out),
                reads={x: reads[x] for x in reads if any(x in n.all_input_nodes for n in nodes)})


def _unflattened(srcs: list[fx.Node], out: fx.Node
                 ) -> tuple[list[fx.Node], fx.Node, torch.dtype | None]:
    """(sources, the node the canonical mix replaces, the cast on the way): the reshaped tensors
    and the reshape back where every source is a flattening of one shape and out's only use is
    (a cast and) the reshape back to it, else (srcs, out, None)."""
    if not all(x.target in _FLATTEN for x in srcs):
        return srcs, out, None
    tokens = [x.args[0] for x in srcs]
    shape = _shape(tokens[0])
    end, cast = out, None
    if len(end.users) == 1 and _is(next(iter(end.users)), prims.convert_element_type.default):
        end = next(iter(end.users))
        cast = end.args[1]
    if (len(end.users) != 1 or next(iter(end.users)).target not in _FLATTEN
            or _shape(next(iter(end.users))) != shape or shape == _shape(srcs[0])
            or shape[-1] != _shape(srcs[0])[-1] or any(_shape(t) != shape for t in tokens)):
        return srcs, out, None
    return tokens, next(iter(end.users)), cast


def _between(out: fx.Node, srcs: set, limit: int):
    """(the nodes out is computed by from srcs and graph inputs, in graph order; those inputs),
    or (None, None) past `limit` nodes or at a node computed from nothing (not an empty tensor)."""
    nodes, leaves, todo = set(), set(), [out]
    while todo:
        x = todo.pop()
        if x in srcs or x in nodes or x in leaves:
            continue
        if x.op in ("placeholder", "get_attr") or (_val(x) is not None and _val(x).numel() == 0):
            if _val(x) is None or not all(isinstance(d, int) for d in _val(x).shape):
                return None, None
            leaves.add(x)
            continue
        if x.op != "call_function" or not x.all_input_nodes or len(nodes) >= limit:
            return None, None
        nodes.add(x)
        todo += x.all_input_nodes
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    return sorted(nodes, key=order.__getitem__), leaves


def _canonical_trace(srcs: list[fx.Node], wn: fx.Node, wp: fx.Node, eps: float,
                     form=depth_mix_weights) -> fx.GraphModule:
    """A canonical mix (`form`: `k3compile.math.depth_mix_weights` or `depth_mix_scores_fp32`)
    over the sources, traced as the patterns trace it."""
    width = _shape(srcs[0])[-1]

    def mix(w_norm, w_proj, *sources):
        w_norm = w_norm if w_norm.shape == (width,) else w_norm.view(width)
        w_proj = w_proj if w_proj.shape == (1, width) else w_proj.view(1, width)
        return form(sources[-1], list(sources[:-1]), w_norm, w_proj, eps)

    vals = [_val(n) for n in (wn, wp, *srcs)]
    with torch._guards.detect_fake_mode(vals) or contextlib.nullcontext():
        return inductor.fwd_only_fake(mix, vals)


def _fp32_sum(gm: fx.GraphModule) -> fx.Node:
    """The canonical mix's fp32 weighted sum: its output, or what its final cast casts."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (list, tuple)) else out
    return out.args[0] if _is(out, prims.convert_element_type.default) else out


def _run(nodes, env: dict) -> dict:
    for node in nodes:
        args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
        env[node] = call_on_cpu(node.target, args, kwargs)
    return env


def _random(node: fx.Node, gen: torch.Generator, scale: float = 1.0, shift: float = 0.0):
    val = _val(node)
    return (shift + scale * torch.randn(tuple(val.shape), generator=gen)).to(val.dtype)


def _equals_canonical(site: Site, gm: fx.GraphModule, wn: fx.Node, wp: fx.Node) -> bool:
    """site.out, run on random sources and weights, equals the canonical mix's fp32 sum within
    RTOL (the canonical form's own rounding in fp32: summation order, reassociated products)."""
    gen = torch.Generator().manual_seed(0)
    width = _shape(site.srcs[0])[-1]
    with unset_fake_temporarily():
        tokens = {t: _random(t, gen) for t in dict.fromkeys(site.tokens)}
        env = {s: tokens[t].reshape(_shape(s)) for s, t in zip(site.srcs, site.tokens)}
        env |= {x: torch.stack([env[s] for s in parts], dim=k).to(_val(x).dtype).reshape(_shape(x))
                for x, (k, parts) in site.reads.items()}
        env[wn] = _random(wn, gen, 0.1, 1.0)
        env[wp] = _random(wp, gen, width ** -0.5)
        for x in {a for n in site.nodes for a in n.all_input_nodes} - set(env) - set(site.nodes):
            env[x] = torch.empty(tuple(_val(x).shape), dtype=_val(x).dtype)  # empty parts
        got = _run(site.nodes, env)[site.out]
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        mine = dict(zip(inputs, [env[wn], env[wp], *(tokens[t] for t in site.tokens)]))
        want = _run([n for n in gm.graph.nodes if n.op == "call_function"], mine)[_fp32_sum(gm)]
        if got.dtype != want.dtype or got.numel() != want.numel():
            return False
        want = want.reshape(got.shape)
        return float((got - want).abs().max()) <= RTOL * float(want.abs().max().clamp_min(1e-30))


def _splice(graph: fx.Graph, gm: fx.GraphModule, site: Site, wn: fx.Node, wp: fx.Node) -> None:
    """The traced canonical mix, inserted before site.out, takes its uses."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    env = dict(zip(inputs, [wn, wp, *site.tokens]))
    with graph.inserting_before(site.end):
        for n in gm.graph.nodes:
            if n.op == "call_function":
                args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = call(graph, n.target, args, kwargs, like=site.out)
        mix = env[_fp32_sum(gm)]
        if site.cast is not None:
            mix = call(graph, prims.convert_element_type.default, (mix, site.cast), like=site.end)
    site.end.replace_all_uses_with(mix)


def _rebuilt(graph: fx.Graph, alpha: fx.Node, site: Site | None) -> int:
    """alpha's mix (`site`), replaced by the canonical mix of the same sources, weights and eps
    when it evaluates to the same values (1), else left (0)."""
    if site is None:
        return 0
    # the built-in form first: in fp32 the two forms are the same values and it is the one taken
    for form, (wn, wp), eps in itertools.product(FORMS, _roles(site.weights),
                                                 dict.fromkeys(site.eps)):
        try:
            gm = _canonical_trace(site.tokens, wn, wp, eps, form)
            equal = _equals_canonical(site, gm, wn, wp)
        except Exception as e:  # noqa: BLE001 (e.g. a projection weight of another dtype)
            log.debug("k3 depth_mix: %s left alone: %s: %s", alpha.name, type(e).__name__, e)
            continue
        if equal:
            _splice(graph, gm, site, wn, wp)
            return 1
    return 0


def _roles(weights: list[fx.Node]) -> list[tuple[fx.Node, fx.Node]]:
    """(norm weight, projection weight) in the order to try: a [1, D] weight is the projection,
    else the one used first is the norm's (fp32 takes either: the product is symmetric)."""
    a, b = weights  # in the order of first use
    row = (1, _shape(a)[-1])
    return [(b, a), (a, b)] if _shape(a) == row and _shape(b) != row else [(a, b), (b, a)]


def _projected(alpha: fx.Node) -> bool:
    """Whether alpha's scores come through a GEMM (walking up from alpha, not past a cat: the
    sources' stack): the canonical scores project the normalised sources by one (`mm`); scores
    without any cannot be the canonical ones."""
    seen, frontier = set(), [alpha]
    for _ in range(REACH):
        if any(n.target in _GEMMS for n in frontier):
            return True
        frontier = [x for n in frontier if not _is(n, aten.cat.default)
                    for x in n.all_input_nodes if x not in seen]
        seen.update(frontier)
    return False


def _ops(nodes) -> collections.Counter:
    return collections.Counter(n.target for n in nodes
                               if n.op == "call_function" and n.target not in _VIEWS)


def _already_canonical(site: Site, traced: dict) -> bool:
    """Whether the site's ops (views aside) are a canonical form's; `traced`: the forms' op
    counts by (form, eps, the inputs' shapes and dtypes), shared by one pass's sites (a model's
    mixes repeat a few shapes, and each trace costs ~10 ms)."""
    ops = _ops(site.nodes)
    for form, (wn, wp), eps in itertools.product(FORMS, _roles(site.weights),
                                                 dict.fromkeys(site.eps)):
        key = (form, eps, *((tuple(_shape(n)), _val(n).dtype) for n in (wn, wp, *site.tokens)))
        if key not in traced:
            try:
                traced[key] = _ops(_canonical_trace(site.tokens, wn, wp, eps, form).graph.nodes)
            except Exception as e:  # noqa: BLE001 (a weight the form cannot take: not this form)
                log.debug("k3 depth_mix: %s: %s", type(e).__name__, e)
                traced[key] = None
        if traced[key] == ops:
            return True
    return False


def _write(graph: fx.Graph, alpha: fx.Node, _, traced: dict) -> int:
    dim = _softmax_dim(alpha)
    site = _site(alpha, dim)
    found = _sources(alpha) if dim == 0 else None
    if found is None:
        return _rebuilt(graph, alpha, site)
    # sources on dim 0, scores spelled otherwise (spell8's einsum, spell7's folded weight)
    if (site is not None and (not _projected(alpha) or not _already_canonical(site, traced))
            and _rebuilt(graph, alpha, site)):
        return 1
    stack, srcs = found
    rewritten = 0
    if _is(stack, aten.cat.default):
        stack = _as_stack(graph, stack, srcs)
        rewritten += 1
    return rewritten + _weighted_sum(graph, alpha, stack, srcs)


def apply(graph: fx.Graph) -> int:
    traced = {}
    return rewrite_sites(graph, lambda n: _softmax_dim(n) is not None,
                         lambda graph, alpha, site: _write(graph, alpha, site, traced))


RULE = Rule("depth_mix", apply, "AttnRes depth mix: cat of unsqueezed sources -> stack's cat + "
            "view; einsum / loop / matmul weighted sum -> (alpha[..., None] * sources).sum(0); "
            "a mix over sources stacked on another dim (blocks listed, or in a bank written "
            "by slice assignment; the stack's leading dims flattened), or on dim 0 with "
            "scores not in the canonical form (einsum against w_norm * w_proj, ...), or never "
            "stacked (a score per source, a sum of terms) -> math.depth_mix_weights")
