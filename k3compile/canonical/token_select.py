"""Rule `token_select`: a token selected from a KDA short conv's output before the per-token
feature math (a cell scanned over T selects its token first, then splits q|k|v, views heads and
L2-normalises; spell9 after rule `cell_conv`) -> the same math on [B, T, ...] with the token
selected after it, where `patterns/kda_decode.py` selects it (`delta_rule_step`'s `q[:, t]`):

    f(select(x, 1, t))  ->  select(f(x), 1, t)      x = the conv output [B, T, C] (T = 1)

for f a pointwise op (its other operands scalars, or selects of the same token of tensors of
the same rank), a split / chunk of the last dim, a view splitting the last dim into heads
[.., H, K] (H, K > 1), or a sum / mean over last dims with keepdim. Exact: each element is
computed from the same elements by the same op. Repeated until nothing moves, so the select
comes to rest before the first op of another kind (the delta rule's unsqueezes and GEMMs).

Only at T = 1 (x's dim 1 has size 1: the math on [B, 1, ...] is the math on the token) and only
below a depthwise `convolution` (the select's input is the conv output through ops this rule
moves, permutes and casts): elsewhere a token select is left where it is.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import refresh, shape, val
from k3compile.canonical.short_conv import products_conv
from k3compile.graph import call

aten = torch.ops.aten
POINTWISE = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor,
             aten.sigmoid.default, aten.neg.default, aten.exp.default, aten.rsqrt.default,
             aten.sqrt.default, aten.reciprocal.default, aten.pow.Tensor_Scalar,
             aten.silu.default, torch.ops.prims.convert_element_type.default}
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
UP = POINTWISE | REDUCTIONS | SPLITS | {aten.view.default, aten.permute.default,
                                        aten.select.int, operator.getitem}


def _token(node) -> tuple[fx.Node, int] | None:
    """(x, d) of `select(x, d, 0)` with x's dim d of size 1, else None."""
    if not isinstance(node, fx.Node) or node.target is not aten.select.int:
        return None
    x, d, i = node.args
    s = shape(x)
    if s is None or not 0 <= d < len(s) or s[d] != 1 or i not in (0, -1):
        return None
    return x, d


def _from_conv(node: fx.Node, limit: int = 48) -> bool:
    for _ in range(limit):
        if node.target is aten.convolution.default or products_conv(node) is not None:
            return True
        if node.op != "call_function" or node.target not in UP:
            return False
        node = node.args[0]
    return False


def _heads(view: fx.Node, s: tuple) -> bool:
    out = shape(view)
    return (len(out) == len(s) + 1 and out[:-2] == s[:-1] and out[-2] > 1 and out[-1] > 1
            and out[-2] * out[-1] == s[-1])


def _site(node: fx.Node):
    """(the op, its rewritten args, the select's dim) where a select can move below node."""
    if node.op != "call_function" or node.target not in UP - {aten.select.int, operator.getitem,
                                                              aten.permute.default}:
        return None
    first = _token(node.args[0])
    if first is None or not _from_conv(first[0]):
        return None
    x, d = first
    rank = len(shape(node.args[0]))
    t = node.target
    if t in POINTWISE:
        args = [x]
        for a in node.args[1:]:
            if isinstance(a, fx.Node):
                other = _token(a)
                if other is None or other[1] != d or len(shape(a)) != rank:
                    return None
                args.append(other[0])
            else:
                args.append(a)
        return tuple(args), d
    if t in SPLITS:
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if dim not in (-1, rank - 1) or not all(u.target is operator.getitem for u in node.users):
            return None
        return (x, node.args[1], -1), d
    if t in REDUCTIONS:
        dims = node.args[1]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if not keep or node.kwargs.get("dtype") is not None or not dims or \
                any(not -(rank - d) <= k < rank for k in dims):
            return None  # a negative dim must count from the end past d
        return (x, [k if k < 0 or k < d else k + 1 for k in dims], True), d
    if t is aten.view.default and _heads(node, shape(node.args[0])):
        s = list(shape(node))
        return (x, s[:d] + [1] + s[d:]), d
    return None


def _write(graph: fx.Graph, node: fx.Node, site) -> bool:
    args, d = site
    with graph.inserting_before(node):
        moved = call(graph, node.target, args, dict(node.kwargs), like=node)
        if node.target in SPLITS:
            for u in list(node.users):
                with graph.inserting_before(u):
                    part = call(graph, operator.getitem, (moved, u.args[1]), like=u)
                    sel = call(graph, aten.select.int, (part, d, 0), like=u)
                u.replace_all_uses_with(sel)
                graph.erase_node(u)
            graph.erase_node(node)
            refresh([moved])
            return True
        sel = call(graph, aten.select.int, (moved, d, 0), like=node)
    # erased, not left for dead-code removal as `region.splice_if_same` leaves its copy: `moved`
    # reads node's inputs, and the rules after this one count their readers
    if shape(sel) != shape(node) or val(sel).dtype != val(node).dtype:
        graph.erase_node(sel)
        graph.erase_node(moved)
        return False
    node.replace_all_uses_with(sel)
    graph.erase_node(node)
    return True


def apply(graph: fx.Graph) -> int:
    total = 0
    while done := rewrite_sites(graph, _site, _write, targets=UP):
        total += done
    return total


RULE = Rule("token_select", apply,
            "a T = 1 token selected from the short conv's output before split / head view / "
            "L2 norm -> the select after them, where the KDA pattern selects each token")

__all__ = ["RULE", "apply"]
