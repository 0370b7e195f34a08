"""Structural reading of tensor code in the functional ATen graph, for canonical rules: a tensor as
a strided read of a root node through view-like ops (`Layout`: view/reshape, permute, transpose,
expand, unsqueeze/squeeze, slice/select/split, clone, multiples by a scalar), and an `mm`/`bmm` as
an einsum over named axes of its roots (`terms`, `einsum`), a `cat` along the contracted dim split
into one product per piece.

Why: einsum, matmul, F.linear and hand-written transposes lower to one of many equivalent view
chains around a bmm; reading them as index maps over a root compares what is computed, not how
it was spelled (rule mla_absorb: kv = c·W_kvbᵀ, q·kᵀ, p·v in any layout). Nothing here edits a
graph.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch import fx

aten = torch.ops.aten

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


def merged_dims(dim) -> list[tuple[int, int]]:
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
    subs = [st for d in lay.dims for st in merged_dims(d)]
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
    subs = merged_dims(lay.dims[dim])
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


SPLITS = {aten.split_with_sizes.default, aten.split.Tensor}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SAME = {aten.clone.default, aten.alias.default}


def is_scalar(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def layout_source(node) -> fx.Node | None:
    """The one tensor input of a view-like op (a node `layout` looks through), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    t = node.target
    if t is operator.getitem and getattr(node.args[0], "target", None) in SPLITS:
        return node.args[0].args[0]
    if t in _VIEWS | _SAME or t in (aten.permute.default, aten.transpose.int, aten.t.default,
                                   aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default,
                                   aten.slice.Tensor, aten.select.int):
        return node.args[0]
    if t in (aten.mul.Tensor, aten.div.Tensor) and is_scalar(node.args[1]):
        return node.args[0]
    return None


def layout(node: fx.Node) -> Layout | None:
    """node as a Layout over the first node up its chain of view-like ops (None: not readable)."""
    src = layout_source(node)
    if src is None:
        return Layout.of_root(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
    lay = layout(src)
    return None if lay is None else step(node, lay)


def step(node: fx.Node, lay: Layout) -> Layout | None:
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
        for s, t in reversed(merged_dims(dim)):
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


def flat(dims) -> list[Axis]:
    return [x for d in dims for x in d]


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


def is_contraction(node) -> bool:
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
    subs = merged_dims(lay.dims[k])
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
    inner_dims, shape = [merged_dims(d) for d in inner.dims], inner.shape
    for axis, c in enumerate(coord):
        if c:
            if len(inner_dims[axis]) != 1:
                return None
            offset += c * inner_dims[axis][0][1]
    for dim in lay.dims:
        group = []
        for s, t in merged_dims(dim):
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
    ga, m, ka = flat(la[:g]), flat(la[g:-1]), la[-1]
    gb, kb, n = flat(lb[:g]), lb[-2], flat(lb[g + 1:])
    ga, gb = _align(ga, gb) or (None, None)
    ka, kb = _align(ka, kb) or (None, None)
    if ga is None or ka is None:
        return None
    both = {x[0] for x in flat(la)} & {x[0] for x in flat(lb)} - {"*"}
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


__all__ = ["SPLITS", "Axis", "Einsum", "Layout", "Term", "einsum", "flat", "is_contraction",
           "is_scalar", "labels", "layout", "layout_source", "terms"]
