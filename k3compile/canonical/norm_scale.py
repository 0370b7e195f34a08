"""Rule `norm_scale`: an L2 norm's constant scale folded into the inverse norm,
`x * (rsqrt(sum(x², -1) + eps) * c)` with `c = d^-1/2` (d = x's last dim), ->
`(x * rsqrt(sum(x², -1) + eps)) * c`: `k3compile.math.l2norm(x) * q_scale`, the form the
`kda_decode` pattern scales q with.

spell10 (`tests/models/spell10_k3.py`) writes KDA's q as
`q * (torch.rsqrt(q.square().sum(-1, keepdim=True) + eps) * dk ** -0.5)` (one multiply of the
[.., 1] norm by the scale, then one of q); its probe `q_scale_after` multiplies q by the norm
first, then by the scale.

    mul(x, mul(rsqrt(add(sum(pow(x, 2), [-1], True), eps)), c))
    ->  mul(mul(x, rsqrt(add(sum(pow(x, 2), [-1], True), eps))), c)

Values: a reassociation of two fp32 products, each rounded once: at K3's d = 128 the two orders
differ by at most 1.43 ulp (1.7e-7 relative, 2e5 rows; `tests/canonical/test_norm_scale.py`
bounds it by 2), at d = 64 not at all (d^-1/2 = 2^-3 scales exactly). Taken only
in fp32 / fp64, with c a number equal to d^-1/2 (the attention scale KDA folds into q: the
idiom, not any product) and the scaled norm read only by that multiply. Left alone: another
constant, a tensor scale, a norm of another tensor than the one multiplied, half precision.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.l2_norm import squared_base
from k3compile.canonical.region import shape, val
from k3compile.graph import call

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.float64)


def _number(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool)


def _norm_of(inv: fx.Node) -> fx.Node | None:
    """x where inv = rsqrt(sum(x², -1, keepdim) + eps)."""
    if not (isinstance(inv, fx.Node) and inv.target is aten.rsqrt.default):
        return None
    add = inv.args[0]
    if not (isinstance(add, fx.Node) and add.target is aten.add.Tensor
            and _number(add.args[1])):
        return None
    total = add.args[0]
    if not (isinstance(total, fx.Node) and total.target is aten.sum.dim_IntList
            and total.kwargs.get("dtype") is None):
        return None
    x = squared_base(total.args[0])
    keep = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    if x is None or shape(x) is None or list(total.args[1] or ()) not in ([-1], [len(shape(x)) - 1]):
        return None
    return x if keep else None


def _site(node: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """(x, inv, c) where node = x * (inv * c), inv x's inverse L2 norm, c = d^-1/2."""
    if len(node.args) != 2 or val(node) is None or val(node).dtype not in _FLOATS:
        return None
    for x, scaled in (node.args, node.args[::-1]):
        if not (isinstance(scaled, fx.Node) and scaled.target is aten.mul.Tensor
                and len(scaled.users) == 1):
            continue
        for inv, c in (scaled.args, scaled.args[::-1]):
            if (_number(c) and _norm_of(inv) is x
                    and math.isclose(c, shape(x)[-1] ** -0.5, rel_tol=1e-6)):
                return x, inv, c
    return None


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    x, inv, c = site
    with graph.inserting_before(node):
        normed = call(graph, aten.mul.Tensor, (x, inv), like=node)
        out = call(graph, aten.mul.Tensor, (normed, c), like=node)
    node.replace_all_uses_with(out)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.mul.Tensor})


RULE = Rule("norm_scale", apply,
            "x * (rsqrt(sum(x², -1) + eps) * d^-1/2) -> (x * rsqrt(sum(x², -1) + eps)) * d^-1/2")

__all__ = ["RULE", "apply"]
