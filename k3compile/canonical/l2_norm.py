"""Rule `l2_norm`: an L2 normalisation over the last dim with the eps inside the square root,
spelled `x / sqrt((x * x).sum(-1, keepdim=True) + eps)` (or `x.pow(2)`, `x ** 2`, `torch.square`)
-> `x * rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)`, `k3compile.math.l2norm` (KDA's q and k).

To rounding: x / sqrt(s) and x · rsqrt(s) differ by an ulp or two in fp32 (x · x and x.pow(2)
are the same product). fp32 only (the canonical form normalises in fp32). Left alone: `F.normalize`
(x / max(‖x‖, eps): the eps outside the root, another function), a sum over another dim or not
kept, a square of another tensor than the one divided.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape, val
from k3compile.graph import call

aten = torch.ops.aten


def squared_base(node) -> fx.Node | None:
    """x if node is x * x or x ** 2."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is aten.mul.Tensor and node.args[0] is node.args[1]:
        return node.args[0]
    if node.target is aten.pow.Tensor_Scalar and node.args[1] == 2:
        return node.args[0]
    return None


def _site(div: fx.Node):
    """(x, eps) if div is x / sqrt(sum(x², -1, keepdim) + eps)."""
    x, root = div.args
    if not (isinstance(root, fx.Node) and root.target is aten.sqrt.default
            and val(div) is not None and val(div).dtype == torch.float32):
        return None
    add = root.args[0]
    if add.target is not aten.add.Tensor or not isinstance(add.args[1], float):
        return None
    total = add.args[0]
    if total.target is not aten.sum.dim_IntList or total.kwargs.get("dtype") is not None:
        return None
    rank = len(shape(x))
    dims = total.args[1]
    keep = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    if list(dims or ()) not in ([-1], [rank - 1]) or not keep or squared_base(total.args[0]) is not x:
        return None
    if any(len(n.users) != 1 for n in (root, add, total, total.args[0])):
        return None
    return x, add.args[1]


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    x, eps = site
    with graph.inserting_before(node):
        sq = call(graph, aten.pow.Tensor_Scalar, (x, 2), like=node)
        total = call(graph, aten.sum.dim_IntList, (sq, [-1], True), like=node)
        inv = call(graph, aten.rsqrt.default,
                   (call(graph, aten.add.Tensor, (total, eps), like=node),), like=node)
        out = call(graph, aten.mul.Tensor, (x, inv), like=node)
    node.replace_all_uses_with(out)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.div.Tensor})


RULE = Rule("l2_norm", apply, "x / sqrt(sum(x*x, -1) + eps) -> x * rsqrt(x.pow(2).sum(-1) + eps)")

__all__ = ["RULE", "apply"]
