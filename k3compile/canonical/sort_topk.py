"""Rule `sort_topk`: the first k of a descending sort over the last dim -> `topk(x, k)`, the
router's top-k as `moe_route` reads it.

spell12 (`tests/models/spell12_k3.py`) routes by
`torch.sort(s + bias, -1, descending=True).indices[:, :k]`:

    getitem(sort(x, -1, True), 1)[..., :k]  (and the values' [..., :k])   ->   topk(x, k)

Why it is faithful: an unstable sort's (`stable=False`, the default) order among equal
elements is unspecified, so its first k are one valid result of "the k largest, in descending
order" (NaN sorts as the largest in both), which is `topk`'s contract; where values tie at the
k-th place, either call may pick either element, eager CPU itself included. Without ties the two
are equal (values and indices). Taken only where every use of the sort is a slice [0:k] of its
values or indices over the same last dim with the same k (k at most the dim's size). Left alone:
a stable sort (`stable=True` promises the lower index first among ties; topk does not), an
ascending sort, another dim, a slice from elsewhere than 0 or with a step, a sort whose whole
order is read, and two slices with different k.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape
from k3compile.graph import call

aten = torch.ops.aten


def _last(dim, rank: int) -> bool:
    return isinstance(dim, int) and rank > 0 and dim % rank == rank - 1


def _prefix(node: fx.Node, rank: int) -> int | None:
    """k where node = t[..., 0:k] over the last dim, else None."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor or node.kwargs:
        return None
    _, dim, start, end, step = (*node.args, *(0, None, None, 1)[len(node.args) - 1:])
    if not _last(dim, rank) or start not in (0, None) or step != 1 or not isinstance(end, int):
        return None
    return end


def _site(node: fx.Node):
    """(x, k, {0 or 1: [slices]}) where node is a prefix-read descending unstable sort."""
    if node.target is aten.sort.default:
        x, dim, descending = (*node.args, *(-1, False)[len(node.args) - 1:])
        stable = False
    elif node.target is aten.sort.stable:
        x, stable, dim, descending = (node.args[0], node.kwargs.get("stable"),
                                      node.kwargs.get("dim", -1),
                                      node.kwargs.get("descending", False))
    else:
        return None
    if node.kwargs and node.target is aten.sort.default:
        return None
    rank = len(shape(x) or ())
    if stable or descending is not True or not _last(dim, rank) or not node.users:
        return None
    slices, ks = {}, set()
    for item in node.users:
        if item.target is not operator.getitem or item.args[1] not in (0, 1):
            return None
        for use in item.users:
            k = _prefix(use, rank)
            if k is None:
                return None
            ks.add(k)
            slices.setdefault(item.args[1], []).append(use)
    if len(ks) != 1 or not 0 < (k := ks.pop()) <= shape(x)[-1]:
        return None
    return x, k, slices


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    x, k, slices = site
    with graph.inserting_before(node):
        top = call(graph, aten.topk.default, (x, k), like=node)
        for i, uses in slices.items():
            item = call(graph, operator.getitem, (top, i), like=node)
            for use in uses:
                use.replace_all_uses_with(item)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.sort.default, aten.sort.stable})


RULE = Rule("sort_topk", apply,
            "sort(x, -1, descending)[..., :k] -> topk(x, k) (an unstable sort's ties are free)")

__all__ = ["RULE", "apply"]
