"""Rule `norm_rms`: the square of a *scaled* L2 norm -> the scaled sum of squares under it, so
that an RMS spelled through `torch.linalg.vector_norm` reaches the form rule `rms_forms` reads.

spell12 (`tests/models/spell12_k3.py`) writes every RMSNorm as
`x * rsqrt((vector_norm(x, dim=-1, keepdim=True) / sqrt(d)).square() + eps)`:

    pow(div(pow(sum(pow(x, 2), [-1], True), 0.5), c), 2)   ->   div(sum(pow(x, 2), [-1], True), c²)

(also `sqrt(s)` for the root, `x * x` for either square, `mul(root, r)` for the scale, giving
`mul(s, r²)`), after which `rms_forms` makes `x * rsqrt(mean(x²) + eps)` of it. Rule
`norm_square` takes the unscaled square; this one the scale between root and square.

To rounding: the root, the scale and the square each round once in fp32, the division of the
sum once: measured <= 2 ulps relative apart on the result (tests/canonical/test_norm_rms.py
bounds it by 4), the spelling of the same function of x. c² is formed in double and rounded
to the nearest integer where it is one to 1e-12 (c = sqrt(d): `math.sqrt(7168)` squares to
7168 only to 1e-16). fp32 only (the canonical norm's arithmetic). Taken only where s is a sum
of squares (never negative, so the root is real) and the constant is a positive number. Left
alone: a root of anything else, a tensor scale, other powers, half precision.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.norm_square import root_of, square_of
from k3compile.canonical.region import val
from k3compile.graph import call

aten = torch.ops.aten


def _number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and a > 0


def _site(node: fx.Node):
    """(s, target, c²) where node = (root(s) op c)², s a sum of squares, else None."""
    if val(node) is None or val(node).dtype != torch.float32:
        return None
    scaled = square_of(node)
    if not isinstance(scaled, fx.Node) or scaled.target not in (aten.div.Tensor, aten.mul.Tensor):
        return None
    if len(scaled.args) != 2 or scaled.kwargs or not _number(scaled.args[1]):
        return None
    s = root_of(scaled.args[0])
    if s is None or s.target is not aten.sum.dim_IntList or not isinstance(s.args[0], fx.Node):
        return None
    if square_of(s.args[0]) is None:
        return None
    c2 = float(scaled.args[1]) ** 2
    if abs(c2 - round(c2)) <= 1e-12 * c2:
        c2 = float(round(c2))
    return s, scaled.target, c2


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    s, target, c2 = site
    with graph.inserting_before(node):
        out = call(graph, target, (s, c2), like=node)
    node.replace_all_uses_with(out)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.pow.Tensor_Scalar, aten.mul.Tensor})


RULE = Rule("norm_rms", apply, "(root(Σx²) / c)² -> Σx² / c² (fp32; vector_norm RMS)")

__all__ = ["RULE", "apply"]
