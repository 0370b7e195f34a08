"""Rule `rms_forms`: the algebraic spellings of an fp32 RMS normalisation over the last dim -> the
form `k3compile.math.rms_norm` traces to, `x * rsqrt(mean(x², -1, keepdim) + eps)`.

    x * c / sqrt(Σx² + k)          (vLLM-style: c = sqrt(d), k = d·eps)
    x / sqrt(mean(x²) + eps)
    x * rsqrt(Σx² / d + eps)       (Σx² · (1/d) too), x / sqrt(...) * c, c * x / sqrt(...)
    ->  x * rsqrt(mean(x², -1, keepdim) + eps)       eps = k / s

where the sum of squares is scaled by s relative to the mean (s = d for Σ, d / n for Σ / n,
d·f for Σ·f, 1 for a mean) and c² = s (in double precision, to 1e-12: `math.sqrt(d)` and
`d ** 0.5` both qualify): only spellings that are the same function of x, eps included. Only on
fp32 x (the canonical norm's arithmetic: `math.rms_norm` normalises `x.float()`); a bf16 / fp16
row normalised in its own dtype is left alone, its rounding is not the canonical one.

To rounding, not exact: the canonical form divides the sum by d in the mean and adds eps, where
the spelling adds d·eps to the sum and divides by sqrt(d) after: a few fp32 ulps apart in an
element (measured <= 4 ulps relative, tests/canonical/test_rms_forms.py), far inside the
verify tolerance of fp32 (1e-4) and below any later rounding to bf16 but for ties. eps is
recovered as k / s in double; the fused ops round it to fp32 anyway (`F.rms_norm`'s eps reaches
them float32-rounded, so patterns compare eps as float32).

Left alone: a norm over another dim or without keepdim, eps added outside the sqrt
(`x / (||x|| + eps)`: another function), a factor c with c² != s, a row of another dtype, a
square of something other than x, the canonical form itself.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape, val
from k3compile.graph import call

aten = torch.ops.aten


def _float(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _squares(node, x) -> bool:
    return _call(node, aten.pow.Tensor_Scalar, aten.mul.Tensor) and node.args[0] is x and (
        (node.target is aten.pow.Tensor_Scalar and node.args[1] == 2)
        or (node.target is aten.mul.Tensor and node.args[1] is x))


def _last_keepdim(node, x) -> bool:
    """node reduces over x's last dim only, keeping it."""
    args = [*node.args, None, None][:3]
    dims, keep = args[1], node.kwargs.get("keepdim", args[2])
    rank = len(shape(x))
    return (isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] % rank == rank - 1
            and bool(keep))


def _mean_scale(node, x) -> float | None:
    """s where node = s · mean(x², -1, keepdim) in one of the spellings, else None."""
    d = shape(x)[-1]
    if _call(node, aten.mean.dim) and _squares(node.args[0], x) and _last_keepdim(node, x):
        return 1.0
    if _call(node, aten.sum.dim_IntList) and _squares(node.args[0], x) and _last_keepdim(node, x):
        return float(d)
    if _call(node, aten.div.Tensor, aten.mul.Tensor) and _float(node.args[1]) and node.args[1]:
        inner = node.args[0]
        if (_call(inner, aten.sum.dim_IntList) and _squares(inner.args[0], x)
                and _last_keepdim(inner, x)):
            f = node.args[1]
            return d / f if node.target is aten.div.Tensor else d * f
    return None


def _inv_root(node, x, root) -> tuple[float, float] | None:
    """(s, k) where node = root(s · mean(x²) + k) (root: sqrt or rsqrt), else None."""
    if not _call(node, root):
        return None
    add = node.args[0]
    if not _call(add, aten.add.Tensor) or not _float(add.args[1]) or add.kwargs:
        return None
    s = _mean_scale(add.args[0], x)
    return None if s is None or s <= 0 or add.args[1] < 0 else (s, float(add.args[1]))


def _factor(node) -> tuple[fx.Node, float] | None:
    """(x, c) for node = x * c or c * x with a number c, else (node, 1.0)."""
    if _call(node, aten.mul.Tensor) and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, fx.Node) and _float(b):
            return a, float(b)
        if isinstance(b, fx.Node) and _float(a):
            return b, float(a)
    return node, 1.0


def _normalised(node) -> tuple[fx.Node, float, float, float, bool] | None:
    """(x, c, s, k, canonical) where node = x · c / sqrt(s · mean(x²) + k), else None."""
    if _call(node, aten.div.Tensor) and len(node.args) == 2 and isinstance(node.args[0], fx.Node):
        for x, c in ((node.args[0], 1.0), _factor(node.args[0])):
            found = _inv_root(node.args[1], x, aten.sqrt.default)
            if found is not None:
                return x, c, *found, False
        return None
    if _call(node, aten.mul.Tensor) and len(node.args) == 2:
        for num, inv in (node.args, reversed(node.args)):
            if not isinstance(num, fx.Node):
                continue
            for x, c in ((num, 1.0), _factor(num)):
                found = _inv_root(inv, x, aten.rsqrt.default)
                if found is not None:
                    return x, c, *found, c == 1.0 and _call(inv.args[0].args[0], aten.mean.dim)
    return None


def _site(node: fx.Node):
    """(x, eps) where node is an fp32 RMS normalisation of x over its last dim, not canonical."""
    found = _normalised(node)
    outer = 1.0
    if found is None:  # x / sqrt(...) * c: the factor outside
        inner, c = _factor(node)
        if inner is node or len(inner.users) != 1:
            return None
        found, outer = _normalised(inner), c
        if found is None:
            return None
    x, c, s, k, canonical = found
    c *= outer
    if canonical and outer == 1.0:
        return None
    if val(x) is None or val(x).dtype != torch.float32 or val(node).dtype != torch.float32:
        return None
    if shape(node) != shape(x) or not shape(x) or not math.isclose(c * c, s, rel_tol=1e-12):
        return None
    return x, k / s


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    x, eps = site
    with graph.inserting_before(node):
        square = call(graph, aten.pow.Tensor_Scalar, (x, 2), like=node)
        mean = call(graph, aten.mean.dim, (square, [-1], True), like=node)
        inv = call(graph, aten.rsqrt.default, (call(graph, aten.add.Tensor, (mean, eps), like=node),),
                   like=node)
        out = call(graph, aten.mul.Tensor, (x, inv), like=node)
    node.replace_all_uses_with(out)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.div.Tensor, aten.mul.Tensor})


RULE = Rule("rms_forms", apply, "x·c / sqrt(Σx² + k), x / sqrt(mean + eps), ... (fp32, c² = d) "
            "-> x · rsqrt(mean(x², -1, keepdim) + eps)")
