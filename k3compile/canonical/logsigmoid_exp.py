"""Rule `logsigmoid_exp`: `exp(logsigmoid(x))` -> `sigmoid(x)`, fp32 / fp64.

spell10 (`tests/models/spell10_k3.py`) writes KDA's β as `F.logsigmoid(b).exp()`, where our model
and the `kda_decode` pattern write `torch.sigmoid(b.float())` (its probe `beta_sigmoid`).
`F.logsigmoid` decomposes to `min(0, x) - log1p(exp(-|x|))`, so the graph holds

    exp(sub(minimum(0, x), log1p(exp(neg(abs(x))))))       (the 0 a `full([], 0)` scalar)

and the rule writes `sigmoid(x)`.

Values: equal in real arithmetic (exp(min(0, x) - log(1 + e^-|x|)) = 1 / (1 + e^-x) for either
sign of x); in floating point the written form rounds in exp, log1p, sub and the outer exp, the
op once: at most 5.0 ulp apart in fp32 over 2e5 values in [-30, 30] (5.9e-7 relative;
`tests/canonical/test_logsigmoid_exp.py` bounds it by 8 ulp), far inside the fp32 tolerances
(`TOL["aten_cpu"]` 1e-4). Taken only where every op of the form is fp32 or fp64 (β is computed
in fp32 in both of spell10's dtypes); in half precision each op rounds to 8 or 11 bits.
Left alone: a logsigmoid not followed by exp (log-space code needs it), a form whose
intermediate values are read elsewhere, `exp(-logsigmoid(x))`, `exp(softplus(x))`.

Runs before `token_view`, which then moves the [N, H] -> [B, T, H] view above the sigmoid as it
does for a sigmoid written as such (after it, the view stays below and kda_decode misses).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.sigmoid import write_sigmoid

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.float64)


def _op(node, target, users: int | None = 1) -> bool:
    """node calls target, holds a fp32 / fp64 value and (users not None) has that many users."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is target
            and isinstance(val, torch.Tensor) and val.dtype in _FLOATS
            and (users is None or len(node.users) == users))


def _zero(node) -> bool:
    """a 0-dim `full([], 0)` or the number 0."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return node == 0
    return (isinstance(node, fx.Node) and node.target is aten.full.default
            and list(node.args[0]) == [] and node.args[1] == 0)


def _site(exp: fx.Node) -> fx.Node | None:
    """x, where exp = exp(minimum(0, x) - log1p(exp(-abs(x)))) in fp32 / fp64."""
    sub = exp.args[0]
    if not (_op(exp, aten.exp.default, None) and _op(sub, aten.sub.Tensor)
            and sub.kwargs.get("alpha", 1) == 1 and len(sub.args) == 2):
        return None
    low, log1p = sub.args
    if not (_op(low, aten.minimum.default) and _op(log1p, aten.log1p.default)):
        return None
    zero, x = low.args
    inner = log1p.args[0]
    if not (_zero(zero) and _op(inner, aten.exp.default)):
        return None
    neg = inner.args[0]
    if not _op(neg, aten.neg.default):
        return None
    absolute = neg.args[0]
    if not (_op(absolute, aten.abs.default) and absolute.args[0] is x):
        return None
    if x.meta["val"].dtype != exp.meta["val"].dtype or x.meta["val"].shape != exp.meta["val"].shape:
        return None
    return x


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, write_sigmoid, targets={aten.exp.default})


RULE = Rule("logsigmoid_exp", apply,
            "exp(logsigmoid(x)) (min(0, x) - log1p(exp(-|x|)), fp32) -> sigmoid(x)")

__all__ = ["RULE", "apply"]
