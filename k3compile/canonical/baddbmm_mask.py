"""Rule `baddbmm_mask`: scores as one `baddbmm` of an additive 0 / -inf mask bias -> the scaled
product masked by `masked_fill`, the form the attention rules (mla_upcast, mla_absorbed) read.

spell12 (`tests/models/spell12_k3.py`) writes MLA's scores over the latent cache as

    bias = where(visible, 0, -inf)   (viewed / expanded to [B, T·H, L], cast)
    scores = baddbmm(bias, q, cacheᵀ, alpha=scale)

    baddbmm(bias, a, c, beta=β, alpha=α)   ->   masked_fill(α · bmm(a, c), ~visible, -inf)

(the bias's views replayed on `visible`; α = 1: no multiply). Why it is faithful: baddbmm is
β·bias + α·(a @ c); where the bias is 0, β·0 = 0 and x + 0 = x, so the element is α·(a @ c);
where it is -inf, β·(-inf) = -inf for β > 0 and x + (-inf) = -inf for every finite x, which is
what masked_fill writes. β = 0: baddbmm ignores its input (no NaN or inf from it propagates), so
the result is α·(a @ c), unmasked. Rounding: the products are the same reduction, but a fused
baddbmm may apply α inside the GEMM where the rewrite rounds the product first: measured on CPU
fp32 bit-equal at inner dim <= 80, <= 1 ulp at 576; bf16 one rounding more (the product rounded
to bf16 before the scale, as the canonical MLA form's bf16 product is). A product that
overflows to +inf at a masked key gives NaN in the baddbmm and -inf here (eager's softmax row is
NaN then; no finite input reaches it).

Taken: a `baddbmm` whose input is, through views, expands and casts, `where(c, 0, -inf)` or
`where(c, -inf, 0)` with literal values (± 0 both), β >= 0 finite. Left alone: a bias of other
values (a finite mask value such as -1e4, a bias that is not 0 where visible), β < 0 (the bias
becomes +inf), a bias that is not a `where` of literals, a `where` that broadcasts its values
past the condition's shape.

Before: where(c, full(0), full(-inf)), unsqueeze, expand, view, baddbmm(bias, a, c, alpha=s)
After:  bitwise_not(c), unsqueeze, expand, view, bmm(a, c), mul(s), masked_fill(-inf)
"""

from __future__ import annotations

import math

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CASTS
from k3compile.graph import call

aten = torch.ops.aten

# ops a bias passes through on its way from the where to the baddbmm: views replayed on the
# condition, casts dropped (a 0 / -inf value is the same in every float dtype)
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.unsqueeze.default, aten.expand.default, aten.permute.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.squeeze.default, aten.clone.default, aten.alias.default}


def _literal(a) -> float | None:
    """The value of a where operand that is a literal: a Python number or a `full` / scalar
    tensor node."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return float(a)
    if isinstance(a, fx.Node) and a.op == "call_function":
        if a.target is aten.full.default and len(a.args) == 2:
            return float(a.args[1]) if isinstance(a.args[1], (int, float)) else None
        if a.target is aten.scalar_tensor.default:
            return float(a.args[0])
    return None


def _cast(n: fx.Node) -> bool:
    if n.target is aten._to_copy.default:
        return set(n.kwargs) <= {"dtype"}
    return n.target in CASTS


def _bias_mask(bias) -> tuple[fx.Node, bool, list[fx.Node]] | None:
    """(c, masked_where_true, the views from the where to the bias) where bias is, through views
    and casts, where(c, 0, -inf) (masked where c is False) or where(c, -inf, 0)."""
    chain = []
    node = bias
    while isinstance(node, fx.Node) and node.op == "call_function" and \
            (node.target in _VIEWS or _cast(node)):
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in (
            aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar) \
            or len(node.args) != 3:
        return None
    cond, yes, no = node.args
    values = (_literal(yes), _literal(no))
    if not isinstance(cond, fx.Node) or cond.meta["val"].dtype != torch.bool \
            or list(cond.meta["val"].shape) != list(node.meta["val"].shape):
        return None
    if values == (0.0, -math.inf):
        masked_where_true = False
    elif values == (-math.inf, 0.0):
        masked_where_true = True
    else:
        return None
    return cond, masked_where_true, [n for n in reversed(chain) if n.target in _VIEWS]


def _site(node: fx.Node):
    if len(node.args) != 3 or not set(node.kwargs) <= {"beta", "alpha"}:
        return None
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in (beta, alpha)) or beta < 0:
        return None
    mask = _bias_mask(node.args[0])
    return None if mask is None else (mask, beta, alpha)


def _write(graph: fx.Graph, node: fx.Node, site) -> bool:
    (cond, masked_where_true, views), beta, alpha = site
    _, a, c = node.args
    before = set(graph.nodes)
    with graph.inserting_before(node):
        out = call(graph, aten.bmm.default, (a, c), like=node)
        if alpha != 1:
            out = call(graph, aten.mul.Tensor, (out, alpha), like=node)
        if beta != 0:
            mask = cond if masked_where_true else call(graph, aten.bitwise_not.default, (cond,),
                                                       like=node)
            for v in views:
                mask = call(graph, v.target, (mask, *v.args[1:]), dict(v.kwargs), like=node)
            out = call(graph, aten.masked_fill.Scalar, (out, mask, float("-inf")), like=node)
    old, new = node.meta["val"], out.meta["val"]
    if new.dtype != old.dtype or new.shape != old.shape:  # a bias broadcast past the product
        for n in reversed([n for n in graph.nodes if n not in before]):
            graph.erase_node(n)
        return False
    node.replace_all_uses_with(out)
    return True


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.baddbmm.default})


RULE = Rule("baddbmm_mask", apply,
            "baddbmm(where(c, 0, -inf), a, b, alpha=s) -> masked_fill(s * bmm(a, b), ~c, -inf)")

__all__ = ["RULE", "apply"]
