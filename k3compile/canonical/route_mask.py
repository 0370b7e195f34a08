"""Rule `route_mask`: the routing weights renormalised over a dense [N, E] row masked to the top-k
by a boolean mask, then read at the top-k ids -> the ids' scores gathered first and renormalised
(`k3compile.math.route_top_k`), the form `patterns/moe_route.py` matches.

spell6 (`tests/models/spell6_k3.py`) writes the router's unbiased weights as

    chosen = torch.zeros_like(s, dtype=torch.bool).scatter(1, ids, True)
    dense = torch.where(chosen, s, 0.0)
    dense = dense / (dense.sum(-1, keepdim=True) + eps) * scale
    weights = dense.gather(1, ids)

which traces to `gather(mul(div(W, add(sum(W, [-1], True), eps)), scale), 1, ids)` with `W =
where(scatter(full(False), 1, ids, True), s, 0)`; the rule writes `gather(s, -1, ids)`, its sum,
`+ eps`, the division and `* scale` as `route_top_k` traces (`* scale` only where it was).

Values: where the mask is true W is s, elsewhere 0, so W's row sum is the sum of the k chosen
scores and `gather(W / t * c, ids) == gather(s, ids) / t * c` elementwise; only the sum's order
differs (E terms, zeros exact, in index order, against k terms in top-k order): a few fp32 ulps
(`tests/canonical/test_route_mask.py` bounds it at 4 * 2^-23). Taken only when the mask is set at
the same `ids` node the gather reads, along the last dim, with True, over an all-False tensor, and
the masked-out value is 0; the dense row may not be read elsewhere (it would still be computed).
Left alone: a mask from other ids, a fill other than 0, a mask of other positions, half-precision
weights (the sum rounds to 8 / 11 bits in another order: other values).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.graph import call

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.float64)


def _call(node, target, users: int | None = 1):
    """node's args if it calls target (with `users` users, None: any), else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is target):
        return None
    return node.args if users is None or len(node.users) == users else None


def _last(dim, node) -> bool:
    rank = node.meta["val"].dim()
    return isinstance(dim, int) and dim % rank == rank - 1


def is_constant(node, value) -> bool:
    """node is a full(...) or scalar_tensor of `value` (a scalar `value` itself too)."""
    if isinstance(node, (int, float, bool)):
        return node == value and type(node) is type(value)
    full = _call(node, aten.full.default, None)
    if full is not None:
        return full[1] == value and type(full[1]) is type(value)
    st = _call(node, aten.scalar_tensor.default, None)
    return st is not None and st[0] == value


def _site(node: fx.Node):
    """(s, ids, eps, scale or None) of a masked-dense routing read, or None."""
    dense, dim, ids = (node.args + (None,))[:3]
    if node.kwargs or not isinstance(dense, fx.Node) or not _last(dim, dense):
        return None
    scale = None
    mul = _call(dense, aten.mul.Tensor)
    if mul is not None and isinstance(mul[1], float):
        dense, scale = mul
    div = _call(dense, aten.div.Tensor)
    if div is None:
        return None
    w, denom = div
    add = _call(denom, aten.add.Tensor)
    if add is None or not isinstance(add[1], float) or len(add) != 2:
        return None
    total, eps = add
    summed = _call(total, aten.sum.dim_IntList)
    if summed is None or summed[0] is not w or len(summed) != 3 or summed[2] is not True:
        return None
    if not (len(summed[1]) == 1 and _last(summed[1][0], w)):
        return None
    masked = _call(w, aten.where.self, users=2)
    if masked is None or w.meta["val"].dtype not in _FLOATS:
        return None
    mask, s, zero = masked
    if not (is_constant(zero, 0.0) or is_constant(zero, 0)):
        return None
    scatter = _call(mask, aten.scatter.value)
    if scatter is None or scatter[2] is not ids or scatter[3] is not True:
        return None
    if not (is_constant(scatter[0], False) and _last(scatter[1], mask)):
        return None
    sval = s.meta.get("val") if isinstance(s, fx.Node) else None
    if sval is None or sval.shape != w.meta["val"].shape or sval.dtype != w.meta["val"].dtype:
        return None
    return s, ids, eps, scale


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    s, ids, eps, scale = site
    with graph.inserting_before(node):
        picked = call(graph, aten.gather.default, (s, -1, ids), like=node)
        total = call(graph, aten.sum.dim_IntList, (picked, [-1], True), like=node)
        denom = call(graph, aten.add.Tensor, (total, eps), like=node)
        out = call(graph, aten.div.Tensor, (picked, denom), like=node)
        if scale is not None:
            out = call(graph, aten.mul.Tensor, (out, scale), like=node)
    node.replace_all_uses_with(out)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.gather.default})


RULE = Rule("route_mask", apply, "gather(where(top-k mask, s, 0) renormalised, ids) -> "
            "gather(s, ids) renormalised")

__all__ = ["RULE", "apply"]
