"""Rule `where_scatter`: one entry of a tensor along dim k written by a one-hot `where` over an
`arange` along k -> the `select_scatter` that slice assignment (`bank[j] = x`) functionalises to,
the write rule `depth_mix` reads a preallocated AttnRes block bank through.

spell13 (`tests/models/spell13_k3.py`, `forward`) writes each finished block into a zero bank
[NB, T, B, D] so:

    depth = torch.arange(NB)[:, None, None, None]
    bank = torch.where(depth == j, prefix[None], bank)

    where(eq(unsqueeze*(arange(n)), j), unsqueeze(x, k), bank)  ->  select_scatter(bank, x, k, j)

Exact: the mask is true at index j of dim k alone, so the where takes x's row there and the bank
everywhere else, as the select_scatter does (bit for bit, any dtype). Taken: the mask `arange(n)`
(prims.iota or aten.arange, 0..n-1 by 1) viewed to [.., n, ..] with only unit dims added, compared
by `eq` with a static int j, 0 <= j < n; the bank of the where's own shape and dtype; the other
operand of that dtype and the bank's shape with a unit dim at k (or, for k = 0, that dim left
out). Left alone: the operands swapped (the entry keeps the bank, the rest is x), a mask of
another comparison or along several dims, j out of range (the where is then the bank), x
broadcast along another dim, a dtype promotion.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import arange_length, static_shape, val
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten
_UNIT_VIEWS = RESHAPES | {aten.unsqueeze.default}


def _one_hot(mask) -> tuple[int, int, int] | None:
    """(k, n, j) where mask is `arange(n) == j` with the arange along dim k, unit dims around."""
    if not isinstance(mask, fx.Node) or mask.target is not aten.eq.Scalar:
        return None
    idx, j = mask.args
    shape = static_shape(idx)
    if shape is None or not isinstance(j, int) or isinstance(j, bool):
        return None
    big = [d for d, size in enumerate(shape) if size != 1]
    if len(big) != 1:
        return None
    (k,), n = big, shape[big[0]]
    node = idx
    while arange_length(node) is None:  # views of an n-vector that only add unit dims
        if node.op != "call_function" or node.target not in _UNIT_VIEWS:
            return None
        node = node.args[0]
        if val(node) is None or val(node).numel() != n:
            return None
    if arange_length(node) != n or val(node).dtype.is_floating_point or not 0 <= j < n:
        return None
    return k, n, j


def _site(where: fx.Node):
    mask, x, bank = where.args
    out, xs = static_shape(where), static_shape(x)
    hot = _one_hot(mask)
    if hot is None or out is None or xs is None or static_shape(bank) != out:
        return None
    if not (val(x).dtype == val(bank).dtype == val(where).dtype):
        return None
    k, n, j = hot
    k += len(out) - len(static_shape(mask))
    if k < 0 or out[k] != n:
        return None
    rest = list(out[:k] + out[k + 1:])
    if len(xs) == len(out) and xs[k] == 1 and [*xs[:k], *xs[k + 1:]] == rest:
        return k, j, rest, True
    if len(xs) == len(out) - 1 and k == 0 and list(xs) == rest:
        return k, j, rest, False
    return None


def _write(graph: fx.Graph, where: fx.Node, site) -> None:
    k, j, rest, unit = site
    _, x, bank = where.args
    with graph.inserting_before(where):
        if not unit:
            row = x
        elif x.target is aten.unsqueeze.default and static_shape(x.args[0]) == tuple(rest):
            row = x.args[0]
        else:
            row = call(graph, aten.squeeze.dim, (x, k), like=where)
        new = call(graph, aten.select_scatter.default, (bank, row, k, j), like=where)
    where.replace_all_uses_with(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.where.self})


RULE = Rule("where_scatter", apply,
            "where(arange(n)[.., :, ..] == j, x.unsqueeze(k), bank) -> "
            "select_scatter(bank, x, k, j)")

__all__ = ["RULE", "apply"]
