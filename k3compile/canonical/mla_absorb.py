"""Rule `mla_absorb`: Gated MLA written in the non-absorbed form over a latent cache -> the absorbed
form our model (`GatedMLA.forward`) traces to, which patterns mla_q_absorb, mla_decode and
mla_uv_gate match.

DeepSeek/HF-style code up-projects every cached latent, kv = c·W_kvbᵀ [B, L, H·(N + V)], splits it
per head into k_nope | v, scores q against cat(k_nope, k_pe) (or as a nope and a rope term), masks,
softmaxes and takes p·v. The rewrite is algebraic, q·(W_UK·c)ᵀ = (W_UKᵀ·q)·cᵀ and
p·(c·W_UVᵀ) = (p·c)·W_UVᵀ, so it rounds differently (measured in the tests: fp32 ~1e-7 relative).

Matching is structural, not by spelling: from each read of a cache that was just written
(`index(index_put(cache, [slots, pos], rows), [slots])`) the rule follows the contractions
(`mm`/`bmm`, however einsum/matmul/linear lowered them) through view-like ops (view, permute,
expand, slices, split, cat, clone, scalar multiples) and reads each one as an einsum over named
axes: kv = c·W_kvbᵀ, scores = q_nope·k_nopeᵀ + q_pe·k_peᵀ, o = p·v, o flattened to [B, T, H·V].
Head count and head dims are solved from the shapes (every head count dividing both projections is
tried). What lies between the scores and p (scale, mask as -inf fill or additive bias, softmax in
fp32 or not, casts) is not matched but evaluated: on random scores and positions it must equal the
canonical scale -> causal mask over `pos` -> fp32 softmax, or the site is left alone.

Before: bmm(c, W_kvbᵀ), view, split, cat(k_nope, expand(k_pe)), bmm(q, kᵀ), mul, where/add, softmax,
    bmm(p, v), permute, view
After:  view(q_b), split, einsum(q_nope, W_UK), einsum(q_lat, c) + einsum(q_pe, k_pe), convert, mul,
    le, where, softmax, convert, einsum(p, c), einsum(o_lat, W_UV), view   (= GatedMLA.forward)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.graph import call
from k3compile.rewrite import inductor

log = logging.getLogger("k3compile")
aten, prims = torch.ops.aten, torch.ops.prims

# p (the softmax output) against the canonical one on random scores, relative to max |p| = 1:
# the canonical form scales and masks in fp32, a bf16 spelling may round the scaled scores first
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 5e-3}

Axis = tuple[str, int, int]  # name, size, first index of the name's range it covers


# ---- layouts: a tensor as a strided map into a root node's contiguous index space --------------

@dataclasses.dataclass(frozen=True)
class Layout:
    """`root` read through view-like ops: per dim, row-major sub-dims (size, stride) into the
    root's contiguous index space, a start offset there, and the scalar it was multiplied by."""

    root: fx.Node
    dims: tuple[tuple[tuple[int, int], ...], ...]
    offset: int = 0
    scale: float = 1.0

    @staticmethod
    def of_root(node: fx.Node) -> Layout:
        shape = [int(d) for d in node.meta["val"].shape]
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        return Layout(node, tuple(((s, t),) if s != 1 else () for s, t in zip(shape, strides)))

    @property
    def shape(self) -> list[int]:
        return [math.prod(s for s, _ in d) for d in self.dims]

    def with_dims(self, dims, offset=None, scale=None) -> Layout:
        return dataclasses.replace(self, dims=tuple(tuple(d) for d in dims),
                                   offset=self.offset if offset is None else offset,
                                   scale=self.scale if scale is None else scale)


def _merged(dim) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, t in dim:
        if s == 1:
            continue
        if out and out[-1][1] == s * t:
            out[-1] = (out[-1][0] * s, t)
        else:
            out.append((s, t))
    return out


def _reshape(lay: Layout, shape) -> Layout | None:
    subs = [st for d in lay.dims for st in _merged(d)]
    shape = list(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = math.prod(lay.shape) // known
    dims = []
    for size in shape:
        group, got = [], 1
        while got < size:
            if not subs:
                return None
            s, t = subs.pop(0)
            if got * s <= size and size % (got * s) == 0:
                group.append((s, t))
                got *= s
            elif s % (size // got) == 0:
                k = size // got
                group.append((k, t * (s // k)))
                subs.insert(0, (s // k, t))
                got = size
            else:
                return None
        dims.append(group)
    return lay.with_dims(dims) if not subs else None


def _slice(lay: Layout, dim: int, start: int, length: int, step: int = 1) -> Layout | None:
    dim %= len(lay.dims)
    subs = _merged(lay.dims[dim])
    if len(subs) != 1:
        return None if subs or length != 1 else lay
    (_, t), dims = subs[0], list(lay.dims)
    dims[dim] = [(length, t * step)]
    return lay.with_dims(dims, offset=lay.offset + start * t)


def _expand(lay: Layout, sizes) -> Layout:
    old = [()] * (len(sizes) - len(lay.dims)) + list(lay.dims)
    shape = [1] * (len(sizes) - len(lay.dims)) + lay.shape
    return lay.with_dims([d if n in (-1, s) else [(n, 0)] for d, s, n in zip(old, shape, sizes)])


def _split_piece(node: fx.Node):
    """(source, dim, start, length) of getitem(split(x, ...), i)."""
    split, i = node.args
    x, sizes, dim = (list(split.args) + [0])[:3]
    if split.target == aten.split.Tensor:
        full = int(x.meta["val"].shape[dim])
        sizes = [min(sizes, full - k) for k in range(0, full, sizes)]
    return x, dim, sum(sizes[:i]), sizes[i]


_SPLITS = {aten.split_with_sizes.default, aten.split.Tensor}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SAME = {aten.clone.default, aten.alias.default}


def _is_scalar(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def layout_source(node) -> fx.Node | None:
    """The one tensor input of a view-like op (a node `layout` looks through), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    t = node.target
    if t is operator.getitem and getattr(node.args[0], "target", None) in _SPLITS:
        return node.args[0].args[0]
    if t in _VIEWS | _SAME or t in (aten.permute.default, aten.transpose.int, aten.t.default,
                                   aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default,
                                   aten.slice.Tensor, aten.select.int):
        return node.args[0]
    if t in (aten.mul.Tensor, aten.div.Tensor) and _is_scalar(node.args[1]):
        return node.args[0]
    return None


def layout(node: fx.Node) -> Layout | None:
    """node as a Layout over the first node up its chain of view-like ops (None: not readable)."""
    src = layout_source(node)
    if src is None:
        return Layout.of_root(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
    lay = layout(src)
    return None if lay is None else _step(node, lay)


def _step(node: fx.Node, lay: Layout) -> Layout | None:  # noqa: PLR0911 (one case per op)
    t, a = node.target, node.args
    if t is operator.getitem:
        _, dim, start, length = _split_piece(node)
        return _slice(lay, dim, start, length)
    if t in _VIEWS:
        return _reshape(lay, a[1])
    if t in _SAME:
        return lay
    if t in (aten.permute.default, aten.transpose.int, aten.t.default):
        order = list(range(len(lay.dims)))
        if t == aten.permute.default:
            order = [d % len(order) for d in a[1]]
        else:
            i, j = (a[1] % len(order), a[2] % len(order)) if t == aten.transpose.int else (0, 1)
            order[i], order[j] = order[j], order[i]
        return lay.with_dims([lay.dims[d] for d in order])
    if t == aten.unsqueeze.default:
        dims = list(lay.dims)
        dims.insert(a[1] % (len(dims) + 1), ())
        return lay.with_dims(dims)
    if t == aten.squeeze.dim:
        dims = list(lay.dims)
        if lay.shape[a[1] % len(dims)] == 1:
            dims.pop(a[1] % len(dims))
        return lay.with_dims(dims)
    if t == aten.expand.default:
        return _expand(lay, list(a[1]))
    if t == aten.slice.Tensor:
        dim, start, end = (list(a[1:4]) + [0, None, None])[:3]
        size = lay.shape[dim % len(lay.dims)]
        start, end = max(0, start or 0), min(size, end if end is not None else size)
        step = a[4] if len(a) > 4 else 1
        return _slice(lay, dim, start, max(0, (end - start + step - 1) // step), step)
    if t == aten.select.int:
        cut = _slice(lay, a[1], a[2] % lay.shape[a[1] % len(lay.dims)], 1)
        if cut is None:
            return None
        return cut.with_dims([d for i, d in enumerate(cut.dims) if i != a[1] % len(cut.dims)])
    factor = a[1] if t == aten.mul.Tensor else 1.0 / a[1]
    return lay.with_dims(lay.dims, scale=lay.scale * factor)


# ---- contractions as einsums over named axes -------------------------------------------------

def _axes_strides(axes: list[Axis]) -> list[tuple[str, int, int, int]]:
    return [(n, s, st, math.prod(x[1] for x in axes[i + 1:])) for i, (n, s, st) in enumerate(axes)]


def labels(lay: Layout, axes: list[Axis]) -> list[list[Axis]] | None:
    """Each dim of `lay` as the root's named axes it walks (name, size, start); broadcast dims are
    named "*". None where a dim cuts an axis in a way no einsum over these axes reads."""
    table, starts, rest = _axes_strides(axes), {}, lay.offset
    for name, size, base, stride in table:
        starts[name], rest = base + rest // stride, rest % stride
    out, seen = [], set()
    for dim in lay.dims:
        got = []
        for s, t in reversed(_merged(dim)):
            pieces = []
            while s > 1:
                if t == 0:
                    pieces.append(("*", s, 0))
                    break
                hit = next((x for x in table if x[3] == t), None)
                if hit is None or hit[0] in seen:
                    return None
                name, size, base, _ = hit
                seen.add(name)
                if s <= size - (starts[name] - base):
                    pieces.append((name, s, starts[name]))
                    break
                if s % size or starts[name] != base:
                    return None
                pieces.append((name, size, base))
                s, t = s // size, t * size
            got = list(reversed(pieces)) + got
        out.append(got)
    return out


@dataclasses.dataclass(frozen=True)
class Term:
    """One product of a contraction: out[G, M, N] += Σ_K a[G, M, K]·b[G, K, N], a and b read from
    their roots."""

    a: Layout
    b: Layout


def _align(xs: list[Axis], ys: list[Axis]):
    """xs and ys split into pieces of equal sizes, pairwise (only broadcast axes split)."""
    xs, ys, out_x, out_y = list(xs), list(ys), [], []
    while xs and ys:
        x, y = xs.pop(0), ys.pop(0)
        if x[1] == y[1]:
            out_x.append(x), out_y.append(y)
            continue
        big, small, rest = (x, y, xs) if x[1] > y[1] else (y, x, ys)
        if big[0] != "*" or big[1] % small[1]:
            return None
        rest.insert(0, ("*", big[1] // small[1], 0))
        (out_x if big is x else out_y).append(("*", small[1], 0))
        (out_y if big is x else out_x).append(small)
    return None if xs or ys else (out_x, out_y)


def _is_contraction(node) -> bool:
    return isinstance(node, fx.Node) and node.target in (aten.bmm.default, aten.mm.default)


def terms(node: fx.Node) -> list[Term] | None:
    """The contraction `node` as products of non-cat roots: a cat along the contracted dim on
    either side splits it into one term per piece."""
    a, b = layout(node.args[0]), layout(node.args[1])
    if a is None or b is None:
        return None
    cuts = {0, a.shape[-1]}
    for lay, k in ((a, -1), (b, -2)):
        if lay.root.target == aten.cat.default:
            piece_cuts = _cat_cuts(lay, k)
            if piece_cuts is None:
                return None
            cuts |= piece_cuts
    out = []
    for lo, hi in zip(sorted(cuts), sorted(cuts)[1:]):
        pa, pb = _slice(a, -1, lo, hi - lo), _slice(b, -2, lo, hi - lo)
        pa, pb = pa and _uncat(pa), pb and _uncat(pb)
        if pa is None or pb is None:
            return None
        out.append(Term(pa, pb))
    return out


def _cat_cuts(lay: Layout, k: int) -> set[int] | None:
    """Where lay's dim k crosses from one piece of its root cat to the next (the cat axis must be
    that dim's one sub-dim)."""
    cat = lay.root
    pieces, dim = cat.args[0], (cat.args[1] if len(cat.args) > 1 else 0)
    shape = [int(s) for s in cat.meta["val"].shape]
    dim %= len(shape)
    stride = math.prod(shape[dim + 1:])
    subs = _merged(lay.dims[k])
    if len(subs) != 1 or subs[0][1] != stride or (lay.offset // stride) % shape[dim]:
        return None
    edges = [0]
    for p in pieces:
        edges.append(edges[-1] + int(p.meta["val"].shape[dim]))
    return {e for e in edges if 0 < e < subs[0][0]}


def _uncat(lay: Layout) -> Layout | None:
    """lay over a cat root -> the same tensor over the one piece it reads (composed with the
    piece's own layout); lay itself when its root is no cat."""
    cat = lay.root
    if cat.target != aten.cat.default:
        return lay
    pieces, dim = cat.args[0], (cat.args[1] if len(cat.args) > 1 else 0)
    shape = [int(s) for s in cat.meta["val"].shape]
    dim %= len(shape)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    coord = [(lay.offset // st) % n for st, n in zip(strides, shape)]
    edge = 0
    for p in pieces:
        width = int(p.meta["val"].shape[dim])
        if edge <= coord[dim] < edge + width:
            break
        edge += width
    else:
        return None
    coord[dim] -= edge
    inner = layout(p)
    return None if inner is None else _compose(lay, strides, coord, inner)


def _compose(lay: Layout, strides, coord, inner: Layout) -> Layout | None:
    """Sub-dims of `lay` (over a contiguous space of `strides`, starting at `coord`) read through
    `inner`, which maps that space's coordinates (one dim each) onto inner.root."""
    offset, dims = inner.offset, []
    inner_dims, shape = [_merged(d) for d in inner.dims], inner.shape
    for axis, c in enumerate(coord):
        if c:
            if len(inner_dims[axis]) != 1:
                return None
            offset += c * inner_dims[axis][0][1]
    for dim in lay.dims:
        group = []
        for s, t in _merged(dim):
            for axis, size, step in _by_axis(s, t, strides, shape) or [(None, 0, 0)]:
                if axis is None:
                    return None
                subs = inner_dims[axis] if step else [(1, 0)]
                if len(subs) == 1:
                    group.append((size, step * subs[0][1]))
                elif step == 1 and size == shape[axis] and not coord[axis]:
                    group += subs
                else:
                    return None
        dims.append(group)
    return Layout(inner.root, tuple(tuple(d) for d in dims), offset, lay.scale * inner.scale)


def _by_axis(s: int, t: int, strides, shape) -> list[tuple[int | None, int, int]] | None:
    """Sub-dim (s, t) of a contiguous space as (axis, size, step) pieces, row-major; a broadcast
    (t = 0) as one piece of step 0."""
    if t == 0:
        return [(0, s, 0)]
    out = []
    while s > 1:
        axis = next((i for i, st in enumerate(strides) if t % st == 0 and t // st < shape[i]), None)
        if axis is None:
            return None
        step = t // strides[axis]
        if s * step <= shape[axis]:
            out.append((axis, s, step))
            break
        inner = shape[axis] // step
        if inner * step != shape[axis] or s % inner or axis == 0:
            return None
        out.append((axis, inner, step))
        s, t = s // inner, strides[axis - 1]
    return list(reversed(out))


@dataclasses.dataclass(frozen=True)
class Einsum:
    out: list[Axis]  # the contraction's output axes, row-major
    k: list[tuple[Axis, Axis]]  # contracted: (a's axis, b's axis)
    roots: tuple[fx.Node, fx.Node]
    scale: float


def einsum(term: Term, axes: dict[fx.Node, list[Axis]], batched: bool) -> Einsum | None:
    """term read as an einsum over the named axes of its roots. An axis both sides name must be a
    batch (G) or contracted (K) axis of both, else the product is an outer product where a
    diagonal is meant; "*" (broadcast) pairs with any axis."""
    if term.a.root not in axes or term.b.root not in axes:
        return None
    la, lb = labels(term.a, axes[term.a.root]), labels(term.b, axes[term.b.root])
    if la is None or lb is None:
        return None
    g = 1 if batched else 0
    ga, m, ka = sum(la[:g], []), sum(la[g:-1], []), la[-1]
    gb, kb, n = sum(lb[:g], []), lb[-2], sum(lb[g + 1:], [])
    ga, gb = _align(ga, gb) or (None, None)
    ka, kb = _align(ka, kb) or (None, None)
    if ga is None or ka is None:
        return None
    both = {x[0] for x in sum(la, [])} & {x[0] for x in sum(lb, [])} - {"*"}
    paired = {xa[0] for xa, xb in zip(ga + ka, gb + kb) if xa[0] == xb[0]}
    if both - paired:
        return None
    out = []
    for xa, xb in zip(ga, gb):
        if "*" not in (xa[0], xb[0]) and xa != xb:
            return None
        out.append(xb if xa[0] == "*" else xa)
    return Einsum(out + m + n, list(zip(ka, kb)), (term.a.root, term.b.root),
                  term.a.scale * term.b.scale)


# ---- the site ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Site:
    read: fx.Node  # cache_out[slots]: [B, L, C + R]
    pos: fx.Node  # [B, T] positions of the written rows (the cache write's index)
    weight: fx.Node  # kv_b_proj.weight [H·(N + V), C]
    projections: list[fx.Node]  # the contractions c·W_kvbᵀ (one, or k and v apart)
    scores: list[fx.Node]  # the contractions q·kᵀ (one over cat(q, k), or nope and rope apart)
    pv: fx.Node  # p·v
    p: fx.Node  # softmax output (what pv reads)
    out: fx.Node  # o flattened [B, T, H·V]


def _forward(node: fx.Node, through) -> list[fx.Node]:
    """Contractions reached from node through users that `through` accepts."""
    seen, todo, found = set(), [node], []
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if _is_contraction(u):
                found.append(u)
            elif through(u):
                todo.append(u)
    return found


def _viewlike(n: fx.Node) -> bool:
    return layout_source(n) is not None or n.target == aten.cat.default or n.target in _SPLITS


def _cache_reads(graph: fx.Graph):
    for node in graph.nodes:
        if node.target != aten.index.Tensor or len(node.args[1]) != 1:
            continue
        write = node.args[0]
        if getattr(write, "target", None) != aten.index_put.default or len(write.args[1]) != 2:
            continue
        pos = write.args[1][1]
        if isinstance(pos, fx.Node) and node.meta["val"].dim() == 3 \
                and pos.meta["val"].dim() == 2 and pos.meta["val"].dtype == torch.int64:
            yield node, pos


def find_site(read: fx.Node, pos: fx.Node) -> Site | str:
    """The non-absorbed attention over the cache read `read`, or why there is none."""
    width = int(read.meta["val"].shape[-1])
    by_weight: dict[fx.Node, list[fx.Node]] = {}
    from_read = _forward(read, _viewlike)
    for mm in from_read:
        for term in terms(mm) or []:
            w = {term.a.root, term.b.root} - {read}
            w = next(iter(w)) if len(w) == 1 else None
            if w is not None and w.op == "placeholder" and w.meta["val"].dim() == 2 \
                    and int(w.meta["val"].shape[1]) < width:
                by_weight.setdefault(w, []).append(mm)
    if len(by_weight) != 1:
        return f"{len(by_weight)} weights project the cached latents (want one: kv_b_proj)"
    weight, projections = next(iter(by_weight.items()))
    products = {s for p in projections for s in _forward(p, _viewlike)}
    products |= set(from_read) - set(projections)
    pv = [s for s in products if _reads_softmax(s)]
    if len(pv) != 1:
        return f"{len(pv)} products of softmax probabilities with projected values (want one)"
    pv, scores = pv[0], sorted(products - {pv[0]}, key=_order(read))
    if not scores:
        return "no product of queries with the projected keys"
    out = _flat_output(pv)
    if out is None:
        return "the attention output is never flattened to [B, T, heads x v_dim]"
    p = next(t.a.root for t in terms(pv))
    return Site(read, pos, weight, projections, scores, pv, p, out)


def _order(read: fx.Node):
    return {n: i for i, n in enumerate(read.graph.nodes)}.__getitem__


def _reads_softmax(node: fx.Node) -> bool:
    """node's first operand comes from a softmax (exp over a sum of exps, maybe cast)."""
    ts = terms(node) or []
    return len(ts) == 1 and _softmax_like(ts[0].a.root)


def _softmax_like(node: fx.Node) -> bool:
    while node.target in (prims.convert_element_type.default, aten._to_copy.default):
        node = node.args[0]
    if node.target == aten._softmax.default:
        return True
    if node.target != aten.div.Tensor or not isinstance(node.args[1], fx.Node):
        return False
    total = node.args[1]
    return total.target == aten.sum.dim_IntList and total.args[0] is node.args[0] \
        and node.args[0].target == aten.exp.default


def _flat_output(pv: fx.Node) -> fx.Node | None:
    """The first node down pv's single-user view-like chain that is 3-D ([B, T, H·V])."""
    node = pv
    while len(node.users) == 1:
        node = next(iter(node.users))
        if layout_source(node) is None or node.target in (aten.mul.Tensor, aten.div.Tensor):
            return None
        if node.meta["val"].dim() == 3:
            return node
    return None


# ---- reading the site: sizes, the einsums, the softmax chain -----------------------------------

@dataclasses.dataclass(frozen=True)
class Sizes:
    B: int
    T: int
    L: int
    H: int
    N: int  # nope head dim
    R: int  # rope dim
    V: int  # value head dim
    C: int  # kv_lora_rank
    q: fx.Node  # the q_b projection's output, [B·T, H·(N + R)] or [B, T, H·(N + R)]
    term_scale: float  # what q (or k) was multiplied by before the scores


def _query(site: Site) -> fx.Node | None:
    known = {site.read, *site.projections}
    roots = {r for s in site.scores for t in terms(s) or [] for r in (t.a.root, t.b.root)} - known
    return next(iter(roots)) if len(roots) == 1 else None


def read_site(site: Site) -> tuple[Sizes, dict] | str:
    """Sizes under which every contraction of the site is the einsum non-absorbed MLA computes
    (the head count solved by trying each that fits both projections) and the named axes of
    every root and product, or why there are none."""
    B, L, width = (int(s) for s in site.read.meta["val"].shape)
    T = int(site.pos.meta["val"].shape[1])
    J, C = (int(s) for s in site.weight.meta["val"].shape)
    q = _query(site)
    if q is None:
        return "the scores do not read one query tensor"
    Jq, rem = divmod(q.meta["val"].numel(), B * T)
    if rem:
        return f"queries {list(q.meta['val'].shape)} are not [B={B}, T={T}, ...]"
    R = width - C
    tried = []
    for H in (h for h in range(math.gcd(J, Jq), 0, -1) if J % h == 0 and Jq % h == 0):
        N = Jq // H - R
        V = J // H - N
        if N <= 0 or V <= 0:
            continue
        sizes = Sizes(B, T, L, H, N, R, V, C, q, 1.0)
        why = _check_einsums(site, sizes)
        if not isinstance(why, str):
            return why
        tried.append(f"{H} heads: {why}")
    return "; ".join(tried[:3]) or f"no head count fits W_kvb [{J}, {C}] and queries of {Jq}"


def _check_einsums(site: Site, z: Sizes) -> tuple[Sizes, dict] | str:
    axes = {site.read: [("b", z.B, 0), ("l", z.L, 0), ("w", z.C + z.R, 0)],
            site.weight: [("h", z.H, 0), ("e", z.N + z.V, 0), ("c", z.C, 0)],
            z.q: [("b", z.B, 0), ("t", z.T, 0), ("h", z.H, 0), ("d", z.N + z.R, 0)]}
    for mm in site.projections:
        e = _einsums(mm, axes)
        if e is None or len(e) != 1 or _pairs(e[0]) != {("w", z.C, 0), ("c", z.C, 0)}:
            return f"{mm.name} is not c·W_kvbᵀ over all {z.C} latent channels"
        if _names(e[0].out) != _want(z, "behl") or not _full(e[0].out, z, "bhl"):
            return f"{mm.name} does not give [B, L, heads, dims]"
        axes[mm] = e[0].out
    kinds, scales = [], set()
    nope, rope = {("d", z.N, 0), ("e", z.N, 0)}, {("d", z.R, z.N), ("w", z.R, z.C)}
    for s in site.scores:
        es = _einsums(s, axes)
        if not es or any(_names(e.out) != _want(z, "bhlt") for e in es) \
                or not all(_full(e.out, z, "bhlt") for e in es) \
                or any(e.out != es[0].out for e in es):
            return f"{s.name} is not a [B, heads, T, L] score product"
        for e in es:
            kind = "nope" if _pairs(e) == nope else "rope" if _pairs(e) == rope else None
            if kind is None or (kind == "nope") != (site.weight not in e.roots and z.q in e.roots
                                                    and site.read not in e.roots):
                return f"{s.name} contracts {sorted(_pairs(e))}, not q_nope·k_nope or q_pe·k_pe"
            kinds.append(kind)
            scales.add(e.scale)
        axes[s] = es[0].out
    if sorted(kinds) != ["nope", "rope"] or len(scales) != 1:
        return f"score terms {sorted(kinds)} with scales {sorted(scales)}"
    p_axes = _probability_axes(site, axes)
    if p_axes is None:
        return "the softmax does not keep the scores' shape"
    axes[site.p] = p_axes
    e = _einsums(site.pv, axes)
    if e is None or len(e) != 1 or _pairs(e[0]) != {("l", z.L, 0)} \
            or _names(e[0].out) != _want(z, "beht") \
            or not _full(e[0].out, z, "bht") or ("e", z.V, z.N) not in e[0].out:
        return f"{site.pv.name} is not p·v over the value half of each head"
    flat = layout(site.out)
    want = [[x for x in dim if x[1] > 1] for dim in
            ([("b", z.B, 0)], [("t", z.T, 0)], [("h", z.H, 0), ("e", z.V, z.N)])]
    if flat is None or flat.root is not site.pv or flat.scale != 1.0 \
            or labels(flat, e[0].out) != want:
        return f"{site.out.name} is not o [B, T, heads·v_dim]"
    return dataclasses.replace(z, term_scale=scales.pop()), axes


def _einsums(mm: fx.Node, axes) -> list[Einsum] | None:
    ts = terms(mm)
    if ts is None:
        return None
    es = [einsum(t, axes, mm.target == aten.bmm.default) for t in ts]
    return None if any(e is None for e in es) else es


def _pairs(e: Einsum) -> set:
    return {x for pair in e.k for x in pair} if len(e.k) == 1 else {("many", 0, 0)}


def _names(out: list[Axis]) -> list[str]:
    return sorted(x[0] for x in out)


def _want(z: Sizes, names: str) -> list[str]:
    size = {"b": z.B, "h": z.H, "l": z.L, "t": z.T}
    return sorted(n for n in names if n == "e" or size[n] > 1)


def _full(out: list[Axis], z: Sizes, names: str) -> bool:
    size = {"b": z.B, "h": z.H, "l": z.L, "t": z.T}
    return all(x[1:] == (size[x[0]], 0) for x in out if x[0] in names) and \
        all(x[0] != "*" for x in out)


def _score_view(s: fx.Node) -> fx.Node:
    """The last node down s's single-user chain of pure layout ops (no scalar multiples)."""
    node = s
    while len(node.users) == 1:
        user = next(iter(node.users))
        if layout_source(user) is None or user.target in (aten.mul.Tensor, aten.div.Tensor):
            break
        node = user
    return node


def _probability_axes(site: Site, axes) -> list[Axis] | None:
    s = site.scores[0]
    view = _score_view(s)
    dims = labels(layout(view), axes[s]) if view is not s else [[x] for x in axes[s]]
    if dims is None or list(site.p.meta["val"].shape) != list(view.meta["val"].shape):
        return None
    return sum(dims, [])


def _cone(outputs: list[fx.Node], stop: set[fx.Node]) -> list[fx.Node]:
    """Nodes outputs depend on, not looking past `stop`, in graph order."""
    seen, todo = set(), list(outputs)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo += n.all_input_nodes
    order = _order(outputs[0])
    return sorted(seen, key=order)


def _chain_scale(site: Site) -> float:
    """The scalars the scores are multiplied by on their way to the softmax."""
    scale, after = 1.0, set(site.scores)
    for n in _cone([site.p], set(site.scores)):
        if n in after or not any(a in after for a in n.all_input_nodes):
            continue
        after.add(n)
        if n.target in (aten.mul.Tensor, aten.div.Tensor) and _is_scalar(n.args[1]):
            scale = scale * n.args[1] if n.target == aten.mul.Tensor else scale / n.args[1]
    return scale


def probe(site: Site, z: Sizes, axes: dict, scale: float, seed: int = 0) -> str | None:
    """Run what lies between the score products and p on random scores and positions; None when
    it equals scale -> causal mask over `pos` -> fp32 softmax -> cast (the canonical chain)."""
    nodes = _cone([site.p, site.pos], set(site.scores))
    gen = torch.Generator().manual_seed(seed)
    env: dict[fx.Node, object] = {}
    with inductor.unset_fake_temporarily():
        for n in nodes:
            val = n.meta.get("val")
            if n in site.scores:
                env[n] = torch.randn(list(val.shape), generator=gen).to(val.dtype)
            elif n.op == "placeholder":
                if val.dtype != torch.int64 or val.dim() != 1:
                    return f"the mask reads {n.name} ({val.dtype}{list(val.shape)})"
                env[n] = torch.randint(0, z.L - z.T + 1, list(val.shape), generator=gen)
            elif n.op == "call_function" and not _writes(n):
                args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = n.target(*args, **kwargs)
            else:
                return f"the softmax input depends on {n.name} ({n.op} {n.target})"
        return _compare(env[site.p], _canonical_p(site, z, axes, env, scale))


def _compare(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"p is {got.dtype}{list(got.shape)}, the canonical p {want.dtype}{list(want.shape)}"
    err = float((got.double() - want.double()).abs().max())
    if not err <= TOLERANCE.get(got.dtype, 0.0):
        return f"scale/mask/softmax differ from the canonical ones by {err:.3g}"
    return None


def _writes(n: fx.Node) -> bool:
    return n.target in (aten.index_put.default, aten.copy_.default) or \
        getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable


def _canonical_p(site: Site, z: Sizes, axes: dict, env: dict, scale: float) -> torch.Tensor:
    order = "bhtl"
    total = 0
    for s in site.scores:
        names = [x[0] for x in axes[s]]
        v = env[s].reshape([x[1] for x in axes[s]])
        v = v.permute([names.index(n) for n in order if n in names])
        total = total + v.reshape(z.B, z.H, z.T, z.L)
    dtype = env[site.scores[0]].dtype
    visible = torch.arange(z.L).view(1, 1, -1) <= env[site.pos].unsqueeze(-1)
    scores = (total.float() * scale).masked_fill(~visible.unsqueeze(1), float("-inf"))
    p = torch.softmax(scores, dim=-1).to(dtype)  # [B, H, T, L]
    names = [x[0] for x in axes[site.p]]
    full = [n for n in order if n not in names]
    p = p.permute([order.index(n) for n in full + names]).reshape(list(env[site.p].shape))
    return p


# ---- the rewrite -------------------------------------------------------------------------------

def absorbed(z: Sizes, scale: float):
    """GatedMLA.forward's attention from the q_b output to o [B, T, H·V], for tracing."""
    B, T, H, N, R, V, C, L = z.B, z.T, z.H, z.N, z.R, z.V, z.C, z.L

    def fn(q, w_kvb, cache, pos):
        if q.dim() == 2:
            q = q.view(B, T, H * (N + R))
        q_nope, q_pe = q.view(B, T, H, N + R).split([N, R], dim=-1)
        w_uk, w_uv = w_kvb.view(H, N + V, C).split([N, V], dim=1)
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)
        kv_lat, kv_pe = cache.split([C, R], dim=-1)
        scores = (torch.einsum("bthc,blc->bthl", q_lat, kv_lat)
                  + torch.einsum("bthr,blr->bthl", q_pe, kv_pe))
        scores = scores.float() * scale
        visible = torch.arange(L, device=q.device).view(1, 1, -1) <= pos.unsqueeze(-1)
        scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        o_lat = torch.einsum("bthl,blc->bthc", p, kv_lat)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * V)

    return fn


def rewrite(graph: fx.Graph, site: Site, z: Sizes, scale: float) -> str | None:
    """Splice the absorbed attention in for site.out; None when done, else why not."""
    inputs = [z.q, site.weight, site.read, site.pos]
    vals = [n.meta["val"] for n in inputs]
    mode = torch._guards.detect_fake_mode(vals)
    with mode or contextlib.nullcontext():
        gm = inductor.fwd_only_joint(absorbed(z, scale), vals)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    before = set(graph.nodes)
    with graph.inserting_before(site.out):
        new = graph.graph_copy(gm.graph, dict(zip(placeholders, inputs)))
    added = [n for n in graph.nodes if n not in before]
    old, got = site.out.meta["val"], new.meta.get("val")
    if got is None or got.dtype != old.dtype or list(got.shape) != list(old.shape):
        for n in reversed(added):
            graph.erase_node(n)
        return f"the absorbed form gives {got and got.dtype}{list(got.shape) if got is not None else ''}"
    for n in added:
        n.meta["k3_rule"] = "mla_absorb"
        if "nn_module_stack" in site.out.meta:
            n.meta["nn_module_stack"] = site.out.meta["nn_module_stack"]
    site.out.replace_all_uses_with(new)
    return None


def apply(graph: fx.Graph) -> int:
    """Rewrite every non-absorbed MLA attention over a just-written latent cache, and the rows it
    was written at into `positions.view(B, 1) + arange(T)`; returns how many sites changed. A
    site that does not read as MLA is left alone (logged at debug level, with why)."""
    done = 0
    for read, pos in list(_cache_reads(graph)):
        why = _apply_one(graph, read, pos)
        if why is not None:
            log.debug("k3 mla_absorb: %s left alone: %s", read.name, why)
        if _canonical_rows(graph, pos) or why is None:
            done += 1
    return done


def _canonical_rows(graph: fx.Graph, pos: fx.Node) -> bool:
    """The latent cache write's indices as mla_decode's search traces them: slots as
    `view(slots, [B, 1])`, pos as `add(view(positions, [B, 1]), iota(T))` (foreign code writes
    `unsqueeze(1)`, `[:, None]`, or the sum the other way round). True when it changed any."""
    write = next(u for u in pos.users if u.target == aten.index_put.default)
    changed = False
    slots = _as_column(graph, write.args[1][0])
    if slots is not None:
        write.args = (write.args[0], [slots, pos], *write.args[2:])
        changed = True
    if pos.target != aten.add.Tensor or len(pos.args) != 2 or pos.kwargs:
        return changed
    rows, steps = pos.args if getattr(pos.args[1], "target", None) == prims.iota.default \
        else reversed(pos.args)
    if getattr(steps, "target", None) != prims.iota.default:
        return changed
    column = _as_column(graph, rows)
    if column is not None or pos.args[0] is not rows:
        pos.args = (column or rows, steps)
        changed = True
    return changed


def _as_column(graph: fx.Graph, node) -> fx.Node | None:
    """A new `view(x, [B, 1])` for node when node is x [B] (int) as a column spelled otherwise;
    None when it already is that view, or is no column of a 1-D tensor."""
    lay = layout(node) if isinstance(node, fx.Node) else None
    if lay is None or lay.root is node or lay.scale != 1.0 or lay.root.meta["val"].dim() != 1:
        return None
    if node.target == aten.view.default and node.args[0] is lay.root:
        return None
    B = int(lay.root.meta["val"].shape[0])
    if list(node.meta["val"].shape) != [B, 1] or \
            labels(lay, [("b", B, 0)]) != [[("b", B, 0)] if B > 1 else [], []]:
        return None
    with graph.inserting_before(node):
        return call(graph, aten.view.default, (lay.root, [B, 1]), like=node)


def _apply_one(graph: fx.Graph, read: fx.Node, pos: fx.Node) -> str | None:
    site = find_site(read, pos)
    if isinstance(site, str):
        return site
    found = read_site(site)
    if isinstance(found, str):
        return found
    z, axes = found
    chain = _chain_scale(site)
    if why := probe(site, z, axes, chain):
        return why
    return rewrite(graph, site, z, z.term_scale * chain)


RULE = Rule(
    name="mla_absorb",
    apply=apply,
    summary="non-absorbed MLA over a latent cache (K/V up-projected, cat/two-term rope, any "
            "scale/mask/softmax spelling) -> the absorbed form (W_UK into q, W_UV after p·c)",
)
