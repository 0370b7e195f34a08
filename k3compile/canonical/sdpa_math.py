"""Rule `sdpa_math`: `F.scaled_dot_product_attention` as AOT decomposes it on CPU (its math
path) -> the explicit attention that foreign code writes by hand and rule `mla_absorb` reads
(spell6's non-absorbed MLA):

    s = bmm(q *ₛ √c, kᵀ *ₛ √c) + where(mask, 0, -inf)      (*ₛ: aten.mul.Scalar)
    p = where(not(any(s != -inf, -1)), 0, softmax(s))          -> s = bmm(q * √c, kᵀ * √c) + ...
                                                                  p = softmax(s)

Two steps, each the same values:

* The scale, split by SDPA as √c on q and on kᵀ, is written `aten.mul.Tensor` with the same
  scalar (what `q * c` traces to elsewhere), so the layout reader sees the product's scale c.
  Bit for bit.
* The guard for fully masked rows goes. SDPA returns 0 in a row whose every score is -inf, the
  explicit softmax NaN; the two agree wherever a row keeps one finite score. The guard is dropped
  only where the mask proves that: the mask is `arange(L) <= P` (or `P >= arange(L)`), so column
  0 is visible wherever P >= 0, and P is the sequence index of a state write `index_put(cache,
  [slots, P], rows)`, so the compiled step's input check (`k3compile/validate.py`) refuses a
  negative position before anything runs. (A raw score of -inf or NaN, an overflow upstream,
  makes both forms meaningless; they are not compared there.)

Left alone: any other mask (a top-left causal `tril`, a sliding window, a mask not over a written
position), a guard over something other than a softmax of the same scores. SDPA with dropout is
rewritten alike (both steps keep its values); its random mask stays between p and the product,
which `mla_absorb` refuses. In bf16 the math path upcasts q, k and v to fp32 (scores and p·v in
fp32): rule `mla_upcast` (next) reads those as the canonical bf16 products where `mla_absorb`
then takes the site.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.layout import is_scalar, layout_source
from k3compile.graph import call

aten, prims = torch.ops.aten, torch.ops.prims
_LEADING = {aten.view.default, aten.unsqueeze.default, aten.expand.default,
            aten._unsafe_view.default, aten.reshape.default}


def _is(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _full(node, value) -> bool:
    return _is(node, aten.full.default) and node.args[1] == value


def _softmax_of(p: fx.Node) -> fx.Node | None:
    """s where p is exp(s - amax(s)) / sum(exp(s - amax(s))) over the last dim."""
    if not _is(p, aten.div.Tensor) or not _is(p.args[0], aten.exp.default):
        return None
    e, total = p.args
    last = ([-1], [e.meta["val"].dim() - 1])
    if not _is(total, aten.sum.dim_IntList) or total.args[0] is not e or \
            list(total.args[1]) not in last or not (len(total.args) > 2 and total.args[2]):
        return None
    sub = e.args[0]
    if not _is(sub, aten.sub.Tensor) or not _is(sub.args[1], aten.amax.default):
        return None
    if list(sub.args[1].args[1]) not in last:
        return None
    s = sub.args[0]
    return s if sub.args[1].args[0] is s else None


def _guarded(s: fx.Node, cond) -> bool:
    """cond is not(any(not(s == -inf), -1)): a row of s all -inf."""
    if not _is(cond, aten.logical_not.default) or not _is(cond.args[0], aten.any.dim):
        return False
    inner = cond.args[0].args[0]
    if not _is(inner, aten.logical_not.default) or not _is(inner.args[0], aten.eq.Scalar):
        return False
    eq = inner.args[0]
    return eq.args[0] is s and eq.args[1] == -math.inf and cond.args[0].args[1] in (
        -1, s.meta["val"].dim() - 1)


def _last(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() else None


def _through(node, length: int | None = None):
    """node's source up views / unsqueezes / expands (with `length`, only those that keep the
    last dim `length`, so that a column of node is the same column of the source)."""
    while _is(node, *_LEADING) and (length is None or _last(node) == length == _last(
            node.args[0])):
        node = node.args[0]
    return node


def _written_position(node) -> bool:
    """node is the sequence index P of a state write index_put(cache, [slots, P], rows)."""
    return any(_is(u, aten.index_put.default) and len(u.args[1]) == 2 and u.args[1][1] is node
               and u.args[0].op == "placeholder" for u in node.users)


def _keeps_column_zero(mask, length: int) -> bool:
    """mask (bool, broadcast over leading dims) is arange(length) <= P for a written position P."""
    mask = _through(mask, length)
    if _last(mask) != length:
        return False
    if _is(mask, aten.le.Tensor):
        col, pos = mask.args
    elif _is(mask, aten.ge.Tensor):
        pos, col = mask.args
    else:
        return False
    col, pos = _through(col, length), _through(pos)  # (P: any view of it, the same values)
    if not _is(col, prims.iota.default) or col.args[0] != length or \
            col.kwargs.get("start", 0) != 0 or col.kwargs.get("step", 1) <= 0:
        return False
    # the column index runs along the scores' last dim only
    shape = list(mask.args[0 if mask.target is aten.le.Tensor else 1].meta["val"].shape)
    return shape[-1] == length and math.prod(shape) == length and _written_position(pos)


def _bias_keeps_a_column(bias, length: int) -> bool:
    """bias is where(mask, 0, -inf) or where(not mask, -inf, 0) with mask keeping column 0."""
    bias = _through(bias, length)
    if not _is(bias, aten.where.self) or _last(bias) != length:
        return False
    mask, a, b = bias.args
    if _full(a, 0) and _full(b, -math.inf):
        return _keeps_column_zero(mask, length)
    if _full(a, -math.inf) and _full(b, 0) and \
            _is(mask, aten.bitwise_not.default, aten.logical_not.default):
        return _keeps_column_zero(mask.args[0], length)
    return False


def _site(where: fx.Node):
    cond, zero, p = where.args
    if not (_full(zero, 0) or _full(zero, 0.0)):
        return None
    s = _softmax_of(p)
    if s is None or not _guarded(s, cond) or not _is(s, aten.add.Tensor):
        return None
    length = int(s.meta["val"].shape[-1])
    scores, bias = s.args
    if not _bias_keeps_a_column(bias, length):
        scores, bias = bias, scores
        if not _bias_keeps_a_column(bias, length):
            return None
    return p, scores


def _scalar_scales(scores: fx.Node) -> list[fx.Node]:
    """The mul.Scalar nodes on the way from the score product's operands up their view chains."""
    product = scores
    while product.target is not aten.bmm.default:
        product = layout_source(product)
        if product is None:
            return []
    found = []
    for operand in product.args:
        node = operand
        while isinstance(node, fx.Node) and not _is(node, aten.mul.Scalar):
            node = layout_source(node) if not _is(node, prims.convert_element_type.default) \
                else None
        if node is not None and is_scalar(node.args[1]):
            found.append(node)
    return found


def _write(graph: fx.Graph, where: fx.Node, site) -> None:
    p, scores = site
    where.replace_all_uses_with(p)
    graph.erase_node(where)
    for mul in _scalar_scales(scores):
        with graph.inserting_before(mul):
            new = call(graph, aten.mul.Tensor, tuple(mul.args), like=mul)
        mul.replace_all_uses_with(new)
        graph.erase_node(mul)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.where.self})


RULE = Rule("sdpa_math", apply, "SDPA's math decomposition (scale split as mul.Scalar on q and "
                                "kᵀ, fully-masked-row guard) -> the explicit attention, where the "
                                "mask keeps a written position per row")
