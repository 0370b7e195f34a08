"""Rule `norm_keepdim`: a sum of squares over the last dim taken without keepdim and unsqueezed
back -> the same sum with `keepdim=True`, the form `k3compile.math.l2norm` traces to (rule
`l2_norm` then reads the norm).

spell12 (`tests/models/spell12_k3.py`, `KDA.l2`) normalises q and k as
`x * rsqrt(torch.linalg.vecdot(x, x)[..., None] + eps)`; vecdot traces to `sum(x * x, [-1])`
(rule `square` makes the product `pow(x, 2)`), and `[..., None]` to an unsqueeze:

    unsqueeze(sum(pow(x, 2), [-1]), -1)  ->  sum(pow(x, 2), [-1], True)

Exact: the same sums, the same [.., 1] shape. Taken only where the sum is over the last dim
alone, of a square (`pow(x, 2)` or `x * x`) in fp32, read only by the unsqueeze, which puts the
dim back at the end. Left alone: sums over other dims, of other products, unsqueezed elsewhere,
or read unsqueezed too.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape, val
from k3compile.graph import call

aten = torch.ops.aten


def _square(node) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.target is aten.pow.Tensor_Scalar:
        return node.args[1] == 2
    return node.target is aten.mul.Tensor and node.args[0] is node.args[1]


def _site(unsq: fx.Node):
    total = unsq.args[0]
    if not (isinstance(total, fx.Node) and total.target is aten.sum.dim_IntList
            and len(total.users) == 1 and len(total.args) == 2 and not total.kwargs):
        return None
    sq, dims = total.args
    src = shape(sq)
    if (src is None or not _square(sq) or val(sq).dtype != torch.float32 or dims is None
            or len(dims) != 1 or dims[0] % len(src) != len(src) - 1):
        return None
    if unsq.args[1] % len(src) != len(src) - 1:
        return None
    return sq, dims


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    sq, dims = site
    with graph.inserting_before(node):
        new = call(graph, aten.sum.dim_IntList, (sq, list(dims), True), like=node)
    node.replace_all_uses_with(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.unsqueeze.default})


RULE = Rule("norm_keepdim", apply,
            "unsqueeze(sum(x², [-1]), -1) -> sum(x², [-1], keepdim=True)")

__all__ = ["RULE", "apply"]
