"""Rule `head_rows`: a delta rule run on [B*H, ...] rows (per-head tensors `flatten(0, 1)`-ed,
the rank-1 write a `bmm` of a column and a row) -> the same ops on the [B, H, ...] tensors the
rows were viewed from, the form `state_transpose` and `delta_einsum` read.

vLLM-style ports merge the batch and head dims before the recurrence (tests/models/spell6_k3.py:
`ssm[slots].flatten(0, 1)`, `k[:, t].flatten(0, 1)`, `beta[:, t].reshape(-1, 1)`, the write
`torch.baddbmm(S, u[..., None], k[:, None])`, the output `.view(B, H, d)`; tests/models/
spell7_k3.py: `baddbmm(state.reshape(B*H, d, d), u.reshape(B*H, d, 1), k.reshape(B*H, 1, d))
.view(B, H, d, d)`); after rule `baddbmm_split` the write is `S + bmm(a, c)`. Row n of a merged
tensor is element (n // H, n % H) of the per-head one, so every op that is row-wise on dim 0
computes on [B, H, ...] exactly what it computed on the rows.

Found structurally. Seeds: a view / reshape of a floating [B, H, *r] tensor to [B*H, *r'] (r' = r up
to unit dims: a row `[B*H, K]`, a column `[B*H, K, 1]`, β as `[B*H, 1]`), whose per-head form is
the source (through clones, which only made the view possible) with r''s unit dims inserted.
The region: what is computed from the seeds by ops that are row-wise on dim 0 (pointwise ops
with numbers, other merged tensors of its rank and tensors of lower rank, which broadcast over
trailing dims only; casts; unsqueezes and sums not on dim 0; a `bmm` of a column [N, M, 1] and a
row [N, 1, P], which is their product, one term per element), with one (B, H) throughout. A
node read by anything other than the region or a view back to [B, H, ...] leaves the region
(and what reads it: `region.closed_region`, shared with `delta_einsum`'s batch-merged form);
a region with no `bmm` left is not taken (a lone pointwise op on merged rows is no delta
rule). Each region node is written again on [B, H, ...] (dims shifted by one,
the `bmm` as `a * c`), and the views back read it. Bit for bit: the same products and sums on
the same elements (a sum over dims after the first adds the same terms in the same order).
Left alone: a `bmm` with an inner dim > 1 (a read, taken by `delta_einsum`'s batch-merged form),
rows merged from differently split tensors, an op over dim 0, a merged row read elsewhere.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.canonical.region import CASTS, closed_region, refresh, shape, val
from k3compile.graph import call

aten = torch.ops.aten
_MERGES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_BINARY = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor}
_UNARY = {aten.exp.default, aten.neg.default, aten.sigmoid.default, aten.rsqrt.default,
          aten.sqrt.default, aten.tanh.default, aten.pow.Tensor_Scalar, aten.clone.default}
_SUMS = {aten.sum.dim_IntList, aten.mean.dim}


def _no_units(dims) -> list[int]:
    return [d for d in dims if d != 1]


def _merge(node: fx.Node):
    """((B, H), source, r') where node views a floating [B, H, *r] tensor as [B*H, *r'], r and r'
    equal up to unit dims; source is the per-head tensor before any clone."""
    out, src = shape(node), node.args[0]
    if node.target not in _MERGES or out is None or not isinstance(src, fx.Node):
        return None
    s = shape(src)
    if (s is None or len(s) < 2 or s[0] * s[1] != out[0] or s[1] < 2 or out[0] < 2
            or _no_units(s[2:]) != _no_units(out[1:]) or not val(node).dtype.is_floating_point):
        return None
    while src.target is aten.clone.default and len(src.users) == 1:
        src = src.args[0]
    return (s[0], s[1]), src, tuple(out[1:])


def _dim(d: int, rank: int) -> int | None:
    """dim d of a merged tensor of `rank` on its per-head form; None for dim 0."""
    if d < 0:
        return d
    return None if d == 0 or d > rank else d + 1


def _kind(node: fx.Node, heads: dict):
    """(B, H) where node is row-wise on dim 0 of the merged tensors it reads."""
    out, v = shape(node), val(node)
    if out is None or not out or v is None or not v.dtype.is_floating_point:
        return None
    args = [a for a in node.args if isinstance(a, fx.Node)]
    merged = [a for a in args if a in heads]
    if not merged or len({heads[a] for a in merged}) != 1:
        return None
    bh = heads[merged[0]]
    if out[0] != bh[0] * bh[1]:
        return None
    t = node.target
    if t in _BINARY and len(node.args) == 2 and not node.kwargs:
        for a in node.args:
            s = shape(a) if isinstance(a, fx.Node) else ()
            if isinstance(a, fx.Node) and a in heads:
                if len(s) != len(out) or s[0] != out[0]:
                    return None
            elif isinstance(a, fx.Node) and (s is None or len(s) >= len(out)):
                return None
        return bh
    if t in _UNARY and node.args[0] in heads and len(args) == 1:
        return bh
    if t in CASTS and set(node.kwargs) <= {"dtype"} and len(args) == 1:
        return bh
    if t is aten.unsqueeze.default and _dim(node.args[1], len(out) - 1) is not None:
        return bh
    if t in _SUMS and len(node.args) >= 2 and len(args) == 1 and set(node.kwargs) <= {"dtype"}:
        rank = len(shape(node.args[0]))
        return bh if all(_dim(d, rank - 1) is not None for d in node.args[1]) else None
    if t is aten.bmm.default and len(merged) == 2 == len(args):
        sa, sc = shape(args[0]), shape(args[1])
        return bh if sa[2] == 1 == sc[1] else None  # a column times a row: one term each
    return None


def _exit(user: fx.Node, node: fx.Node, bh) -> bool:
    """user views node [B*H, *r] back to [B, H, *r'] (r, r' equal up to unit dims)."""
    out = shape(user)
    return (user.target in _MERGES and user.args[0] is node and out is not None
            and tuple(out[:2]) == bh and _no_units(out[2:]) == _no_units(shape(node)[1:]))


_UNIT_VIEWS = {*_MERGES, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default}


def _per_head(graph, src: fx.Node, bh, rest, like) -> fx.Node:
    """src [B, H, *r] as [B, H, *rest] (r, rest equal up to unit dims): src itself, or src with a
    unit dim inserted, or a view; src is first taken back through views that only insert or
    drop unit dims (spell7's `k.unsqueeze(-1)` viewed as a row is `k.unsqueeze(-2)`)."""
    while (src.target in _UNIT_VIEWS and isinstance(src.args[0], fx.Node)
           and shape(src.args[0]) is not None and tuple(shape(src.args[0])[:2]) == tuple(bh)
           and _no_units(shape(src.args[0])[2:]) == _no_units(rest)):
        src = src.args[0]
    s = tuple(shape(src)[2:])
    if s == rest:
        return src
    if len(rest) == len(s) + 1:
        for i in range(len(rest)):
            if rest[i] == 1 and rest[:i] + rest[i + 1:] == s:
                return call(graph, aten.unsqueeze.default, (src, i - len(rest)), like=like)
    return call(graph, aten.reshape.default, (src, [*bh, *rest]), like=like)


def apply(graph: fx.Graph) -> int:
    heads, merges, region = closed_region(graph, _merge, _kind, _exit)
    if not any(n.target is aten.bmm.default for n in region):
        return 0
    four, exits = {}, []

    def lifted(a, like):
        if not isinstance(a, fx.Node) or a not in heads:
            return a
        if a not in four:  # a seed, lifted where first read
            bh, src, rest = merges[a]
            with graph.inserting_after(a):
                four[a] = _per_head(graph, src, bh, rest, like)
        return four[a]

    for n in region:
        bh, rank = heads[n], len(shape(n)) - 1
        with graph.inserting_before(n):
            args = [lifted(a, n) for a in n.args]
            t = n.target
            if t is aten.bmm.default:
                new = call(graph, aten.mul.Tensor, tuple(args), like=n)
            elif t is aten.unsqueeze.default:
                new = call(graph, t, (args[0], _dim(n.args[1], rank)), like=n)
            elif t in _SUMS:
                in_rank = len(shape(n.args[0])) - 1
                dims = [_dim(d, in_rank) for d in n.args[1]]
                new = call(graph, t, (args[0], dims, *args[2:]), n.kwargs, like=n)
            else:
                new = call(graph, t, tuple(args), n.kwargs, like=n)
        four[n] = new
        for u in list(n.users):
            if u in four or u in region:
                continue
            out = tuple(shape(u)[2:])
            with graph.inserting_before(u):
                back = _per_head(graph, new, bh, out, like=u) if shape(new)[2:] != out else new
            u.replace_all_uses_with(back)
            exits.append(back)
    graph.eliminate_dead_code()
    refresh(exits)
    return len(region)


RULE = Rule("head_rows", apply,
            "a delta rule on flatten(0, 1)-ed [B*H, ...] rows (bmm of a column and a row) -> "
            "the same ops on the [B, H, ...] tensors")

__all__ = ["RULE", "apply"]
