"""Rule `sigmoid`: the logistic function written out, `1 / (1 + exp(-x))` -> `aten.sigmoid(x)`.

Code written from a paper spells σ by hand: the red-team spelling's KDA decay is
`exp(bound / (1.0 + exp(-z)))` (`tests/models/redteam_k3.py`), where our model and the
`kda_decode` pattern write `exp(bound * torch.sigmoid(z))`. `c / t` of a Python scalar traces to
`reciprocal(t) * c` (Tensor.__rtruediv__), so the graph holds

    reciprocal(add(exp(neg(x)), 1))          (1 + exp(-x) in either operand order)

and the rule writes `sigmoid(x)`; a following `* c` is then the canonical `c * σ(x)`.
(`torch.special.expit` and `F.sigmoid` already trace to aten.sigmoid; SiLU's decomposition
`x / (1 + exp(-x))` divides x itself and is left alone.)

Values: equal in real arithmetic; in floating point torch's sigmoid kernel rounds differently
from the three rounded ops (neg is exact; exp, add and the reciprocal each round), a few ulp
apart (measured in fp32 over 2e6 values in [-30, 30]: at most 2.3 * 2^-23 relative, 2.7e-7;
`tests/canonical/test_sigmoid.py` bounds it by 4 * 2^-23): far inside the fp32 tolerances the
spelling tests use (compiled vs eager `TOL["aten_cpu"]` = 1e-4, 1e-4 for a canonical rewrite under
verify). Taken only where every op of the form is fp32 or fp64 (the
exp and the add in fp32 add no rounding beyond those ulps); in half precision each op rounds to
8 or 11 bits, which sigmoid does once: different values, left alone. Also left alone: 1 + exp(x)
(no negation: that is σ(-x)), 2 + exp(-x), exp(-x) / (1 + exp(-x)), a form whose intermediate
values are read elsewhere (they would still be computed; nothing gained).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.graph import call

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.float64)


def _one_user(node, target) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is target
            and len(node.users) == 1)


def _float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in _FLOATS


def _one_plus(add: fx.Node) -> fx.Node | None:
    """The exp(-x) node of add = 1 + exp(-x) (either order, alpha 1), or None."""
    if len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    a, b = add.args
    for one, e in ((a, b), (b, a)):
        if isinstance(one, (int, float)) and not isinstance(one, bool) and one == 1:
            return e
    return None


def _site(node: fx.Node) -> fx.Node | None:
    """x, where node = reciprocal(1 + exp(-x)) computed in fp32/fp64 from a tensor x."""
    add = node.args[0]
    if not (_one_user(add, aten.add.Tensor) and _float(node) and _float(add)):
        return None
    e = _one_plus(add)
    if not (_one_user(e, aten.exp.default) and _float(e)):
        return None
    neg = e.args[0]
    if not (_one_user(neg, aten.neg.default) and _float(neg)):
        return None
    x = neg.args[0]
    if not (isinstance(x, fx.Node) and _float(x)) or x.meta["val"].dtype != node.meta["val"].dtype:
        return None
    return x


def write_sigmoid(graph: fx.Graph, node: fx.Node, x: fx.Node) -> None:
    """node's uses read sigmoid(x) instead (also rule `logsigmoid_exp`'s ending)."""
    with graph.inserting_before(node):
        sig = call(graph, aten.sigmoid.default, (x,), like=node)
    node.replace_all_uses_with(sig)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, write_sigmoid, targets={aten.reciprocal.default})


RULE = Rule("sigmoid", apply, "reciprocal(1 + exp(-x)) (1 / (1 + exp(-x)), fp32) -> sigmoid(x)")

__all__ = ["RULE", "apply", "write_sigmoid"]
