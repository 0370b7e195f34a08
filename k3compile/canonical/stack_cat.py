"""Rule `stack_cat`: pieces stacked on a new dim that a reshape then merges into the next dim ->
their concatenation on that dim.

    qkv = torch.stack([q, k, v])  (or a GEMM over a stacked weight, split by rule `gemm`)
    qkv.permute(1, 0, 2).reshape(B, T, 3 * W)      ==  torch.cat([q, k, v], -1).view(B, T, 3W)

A reshape depends only on the row-major order of its input's elements, and merging the stacked
dim with the dim after it keeps that order, so reshape(permute(stack(xs, d), p), s) is
reshape(cat([permute(x, p without d) ...], j), s) where j is where p put d (not the last dim).
The canonical form (`k3compile/math.py`: `torch.cat([q, k, v], dim=-1)` of the projections'
[B, T, W] outputs) then has the reshape on each piece where it keeps the concatenated dims:
    cat([view(x, s[:k] + x.shape[j:]) ...], k - len(s))     where s[k:] == cat's shape[j:]
and otherwise view(cat(...), s). A `clone` between them (contiguous copy) changes no values.
Left alone: stacks read by anything else, a stacked dim that stays a dim of its own or is
merged with the dim before it (an interleave, not a concatenation).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.graph import call

aten = torch.ops.aten
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
CLONES = {aten.clone.default}


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _shape(node: fx.Node) -> list[int]:
    return list(node.meta["val"].shape)


def _rewrite(graph: fx.Graph, stack: fx.Node) -> int:
    pieces, d = stack.args[0], stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
    rank = len(_shape(stack))
    d %= rank
    node, perm = _only_user(stack), list(range(rank))
    if node is not None and node.target is aten.permute.default:
        perm, node = [p % rank for p in node.args[1]], _only_user(node)
    if node is not None and node.target in CLONES and set(node.kwargs) <= {"memory_format"}:
        node = _only_user(node)
    if node is None or node.target not in RESHAPES:
        return 0
    j = perm.index(d)
    if j == rank - 1:
        return 0
    inner = [p - (p > d) for p in perm if p != d]
    target = _shape(node)
    with graph.inserting_before(node):
        xs = [x if inner == sorted(inner) else call(graph, aten.permute.default, (x, inner), like=x)
              for x in pieces]
        tail = _shape(xs[0])[j:]
        tail[0] *= len(xs)
        k = len(target) - len(tail)
        if k >= 0 and target[k:] == tail:
            xs = [call(graph, aten.view.default, (x, target[:k] + _shape(x)[j:]), like=node)
                  for x in xs]
            new = call(graph, aten.cat.default, (xs, k - len(target)), like=node)
        else:
            cat = call(graph, aten.cat.default, (xs, j), like=node)
            new = call(graph, aten.view.default, (cat, target), like=node)
    node.replace_all_uses_with(new)
    return 1


def apply(graph: fx.Graph) -> int:
    return sum(_rewrite(graph, n) for n in list(graph.nodes)
               if n.op == "call_function" and n.target is aten.stack.default)


RULE = Rule("stack_cat", apply,
            "stack(xs, d), permute, reshape merging d into the next dim -> cat(xs) (views per piece)")
