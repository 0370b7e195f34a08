"""Rule `norm_square`: the square of an L2 norm -> the sum of squares under it, the form
`k3compile.math.l2norm` writes (`x.pow(2).sum(-1, keepdim=True)`), which rule `l2_norm` and the
kda_decode pattern read.

    torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()      (spell6's l2 norm)
    traces to  pow(pow(sum(pow(x, 2), [-1], True), 0.5), 2)   ->   sum(pow(x, 2), [-1], True)

To rounding: sqrt(s)² and s differ by an ulp or so in fp32. fp32 only (the canonical form
normalises in fp32). Taken: `pow(pow(s, 0.5), 2)` (or `sqrt(s)` squared, by `pow` or `x * x`)
where s is a `sum` of `pow(x, 2)` or `x * x`: never negative, so the root is real. Left alone:
a root of anything else (a value that may be negative, where sqrt gives NaN), other powers.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import val

aten = torch.ops.aten


def square_of(node: fx.Node) -> fx.Node | None:
    """x if node is x ** 2 or x * x."""
    if node.target is aten.pow.Tensor_Scalar and node.args[1] == 2:
        return node.args[0]
    if node.target is aten.mul.Tensor and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def root_of(node) -> fx.Node | None:
    """s if node is s ** 0.5 or sqrt(s)."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is aten.pow.Tensor_Scalar and node.args[1] == 0.5:
        return node.args[0]
    if node.target is aten.sqrt.default:
        return node.args[0]
    return None


def _site(node: fx.Node) -> fx.Node | None:
    if val(node) is None or val(node).dtype != torch.float32:
        return None
    root = square_of(node)
    s = root_of(root)
    if s is None or s.target is not aten.sum.dim_IntList:
        return None
    inner = s.args[0]
    return s if isinstance(inner, fx.Node) and square_of(inner) is not None else None


def _write(graph: fx.Graph, node: fx.Node, s: fx.Node) -> None:
    node.replace_all_uses_with(s)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.pow.Tensor_Scalar, aten.mul.Tensor})


RULE = Rule("norm_square", apply, "vector_norm(x)² = pow(pow(sum(x²), 0.5), 2) -> sum(x²)")

__all__ = ["RULE", "apply"]
