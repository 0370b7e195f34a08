"""Rule `state_transpose`: a delta rule on a V-major state [B, H, V, K] -> the K-major delta rule
on the transpose of the gathered rows, transposed back where it is written (the form of
`patterns/kda_decode.py` with `state_v_major`).

Several ports keep a head's recurrent state as the matrix that maps k to v, [V, K] (fla's
`transpose_state_layout`, tests/models/spell6_k3.py): the decay multiplies along the last dim
(`S * a.unsqueeze(-2)`), the reads sum over it (`(S * k.unsqueeze(-2)).sum(-1)`), the rank-1
write adds `k.unsqueeze(-2) * u.unsqueeze(-1)`. Written on Sᵀ these are the canonical K-major
step (`k3compile.math.delta_rule_step`); the buffer keeps its layout, so the gathered rows are
transposed once after the gather and the new state once before the write.

Site: a gather `index(buf, [slots])` of fp32 [B, H, d, d] rows whose region (the 4-D pointwise
ops computed from it: mul, add, sub of the same shape) is read only by sums over its last dim
(the V-major reads, at least one) and by state writes (`index_put`'s value, through views; at
least one). Every region node
n is written again on Sᵀ as nᵀ: its other operands transposed (a unit dim inserted at -2 moves to
-1 and back; an outer product of two such views swaps its factors' unit dims; anything else gets
a permute), a last-dim sum of n as a sum of nᵀ over dim -2; the readers outside the region read
`permute(nᵀ, [0, 1, 3, 2])`, the same values. The pointwise ops are bit for bit; a sum over dim
-2 of nᵀ adds the same elements as the sum over -1 of n, in an order torch picks from the strides
(fp32, an ulp; the test allows 1e-6 relative). Left alone: a
region with a sum over another dim (a K-major state's reads), a product (bmm, einsum), any other
reader, or no read at all.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import VIEWS, shape, val
from k3compile.graph import call

aten = torch.ops.aten
SWAP = [0, 1, 3, 2]
_POINTWISE = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor}
_SUM = aten.sum.dim_IntList


def _is_last_dim_sum(node: fx.Node) -> bool:
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return (node.target is _SUM and len(node.args) > 1 and not keep
            and [d % 4 for d in node.args[1]] == [3] and "dtype" not in node.kwargs)


def _writes(node: fx.Node, user: fx.Node) -> bool:
    """user writes node into a state buffer (`index_put`'s value), directly or through views."""
    if user.target in VIEWS:
        return all(_writes(user, u) for u in user.users)
    return user.target is aten.index_put.default and user.args[2] is node \
        and user.args[0] is not node


def _site(read: fx.Node):
    """(region nodes in graph order, sums) of a V-major state gather, or None."""
    v = val(read)
    if not (isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype == torch.float32
            and v.shape[2] == v.shape[3]):
        return None
    region, sums, written, todo = {read}, [], False, [read]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in region:
                continue
            if user.target in _POINTWISE and shape(user) == tuple(v.shape) and \
                    val(user).dtype == torch.float32:
                region.add(user)
                todo.append(user)
            elif _is_last_dim_sum(user) and user.args[0] is node:
                sums.append(user)
            elif _writes(node, user):
                written = True
            else:
                return None
    if not sums or not written:
        return None
    order = {n: i for i, n in enumerate(read.graph.nodes)}
    return sorted(region, key=order.__getitem__), sums


def _unit_view(node) -> tuple[fx.Node, int] | None:
    """(x, dim) where node = unsqueeze(x, dim) of a 3-D x, dim -2 or -1 of the 4-D result."""
    if not (isinstance(node, fx.Node) and node.target is aten.unsqueeze.default
            and len(shape(node.args[0]) or ()) == 3):
        return None
    d = node.args[1] % 4
    return (node.args[0], d) if d in (2, 3) else None


def _swapped(graph: fx.Graph, node, like: fx.Node):
    """node's values with the last two dims swapped, as a canonical form would write them."""
    if not isinstance(node, fx.Node) or len(shape(node) or ()) < 2:
        return node  # a scalar, or broadcast along both swapped dims
    if unit := _unit_view(node):
        x, d = unit
        return call(graph, aten.unsqueeze.default, (x, -1 if d == 2 else -2), like=like)
    if node.target is aten.mul.Tensor and len(node.args) == 2 and all(map(_unit_view, node.args)):
        a, b = (_swapped(graph, arg, like) for arg in node.args)
        if _unit_view(a)[1] == 2:  # the column first, as the K-major write `k[..., None] * u`
            a, b = b, a
        return call(graph, aten.mul.Tensor, (a, b), like=like)
    if len(shape(node)) != 4:
        return call(graph, aten.transpose.int, (node, -1, -2), like=like)
    return call(graph, aten.permute.default, (node, SWAP), like=like)


def _write(graph: fx.Graph, read: fx.Node, site) -> None:
    region, sums = site
    twin = {}
    with graph.inserting_after(read):
        twin[read] = call(graph, aten.permute.default, (read, SWAP), like=read)
    for node in region[1:]:
        with graph.inserting_before(node):
            args = [twin.get(a) if a in twin else _swapped(graph, a, node) for a in node.args]
            twin[node] = call(graph, node.target, tuple(args), node.kwargs, like=node)
    for total in sums:
        with graph.inserting_before(total):
            new = call(graph, _SUM, (twin[total.args[0]], [-2]), like=total)
        total.replace_all_uses_with(new)
    new = set(twin.values())
    for node in region:
        outside = [u for u in node.users if u not in twin and u not in new and u not in sums]
        if not outside:
            continue
        with graph.inserting_after(twin[node]):
            back = call(graph, aten.permute.default, (twin[node], SWAP), like=node)
        for user in outside:
            user.replace_input_with(node, back)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.index.Tensor})


RULE = Rule("state_transpose", apply,
            "delta rule on a V-major state [B, H, V, K] -> the K-major rule on its transpose")

__all__ = ["RULE", "apply"]
