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
A stack may come as `cat(xs, d)` viewed with dim d split into [G, x's] (a decomposition's):
taken alike.
Left alone: stacks read by anything else, a stacked dim that stays a dim of its own or is
merged with the dim before it (an interleave, not a concatenation).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape as _shape
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten
CLONES = {aten.clone.default}


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _stacked(node: fx.Node) -> tuple[list[fx.Node], int] | None:
    """(pieces, dim) where node is `stack(pieces, dim)`, or `view(cat(pieces, dim), shape)` that
    splits the concatenated dim into [G, piece's] (a stack as decompositions write it)."""
    if node.target is aten.stack.default:
        return node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if node.target in RESHAPES and isinstance(cat := node.args[0], fx.Node) and \
            cat.target is aten.cat.default and len(cat.users) == 1 and \
            isinstance(cat.args[0], (list, tuple)) and cat.args[0]:
        pieces, shapes = cat.args[0], {_shape(x) for x in cat.args[0]}
        if len(shapes) == 1:
            shape = shapes.pop()
            c = (cat.args[1] if len(cat.args) > 1 else 0) % len(shape)
            if _shape(node) == (*shape[:c], len(pieces), *shape[c:]):
                return pieces, c
    return None


def _rewrite(graph: fx.Graph, stack: fx.Node, found: tuple[list[fx.Node], int]) -> int:
    pieces, d = found
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
        tail = (_shape(xs[0])[j] * len(xs), *_shape(xs[0])[j + 1:])
        k = len(target) - len(tail)
        if k >= 0 and target[k:] == tail:
            xs = [x if _shape(x) == target[:k] + _shape(x)[j:] else
                  call(graph, aten.view.default, (x, [*target[:k], *_shape(x)[j:]]), like=node)
                  for x in xs]
            new = call(graph, aten.cat.default, (xs, k - len(target)), like=node)
        else:
            cat = call(graph, aten.cat.default, (xs, j), like=node)
            new = call(graph, aten.view.default, (cat, list(target)), like=node)
    node.replace_all_uses_with(new)
    return 1


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, lambda n: n.op == "call_function" and _stacked(n), _rewrite,
                         tidy=False)


RULE = Rule("stack_cat", apply,
            "stack(xs, d), permute, reshape merging d into the next dim -> cat(xs) (views per piece)")
