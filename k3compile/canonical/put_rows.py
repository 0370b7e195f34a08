"""Rule `put_rows`: whole rows of a state written by `Tensor.put` at flat element indices -> the
row write the state rules read: `index_put(buf, [rows], x)` (rows of dim 0: rule `state_write`'s
canonical form), or the write through the buffer's [S·L, ...] rows that rule `paged_write` (next
but one in ORDER) reads as the (slot, position) write of the MLA cache.

spell12 (`tests/models/spell12_k3.py`) builds its new states out of place by `buf.put(flat, x)`
at `flat = row[..., None] * P + arange(P)`, P the numel of one row: `slot * numel_per_slot +
arange` for KDA's states, `(slot * L + pos) * (C + R) + arange(C + R)` for the MLA cache. AOT
decomposes `put` to a write into the flattened buffer:

    view(index_put(view(buf, [N]), [add(mul(unsqueeze(X, -1), P), iota(P))], x), shape)
        -> index_put(buf, [view(X, [-1])], rows)                                   P = shape[1:]
        -> view(index_put(view(buf, [S·L, *shape[2:]]), [view(X, [-1])], rows), shape)
                                                                                    P = shape[2:]

(`mul(unsqueeze)` or `unsqueeze(mul)`, either operand order). `rows` is what x is a reshape or
contiguous copy of, shaped [X.numel(), *shape[k:]] (the copy moves no value: a conv state's
tail `window[..., -K:]` is written as that slice, the form the KDA rules read after
`state_write`), else x viewed so. Why it is faithful: with P the numel of the buffer's last
dims, flat element X·P + j (0 <= j < P) is element j of row X of the buffer viewed as
[N / P, P], and x viewed [X.numel(), P] lists row X's elements in that order: the same elements
get the same values. It holds for every X: a negative X (-N/P <= X < 0) is a flat index in
[-N, 0), which `put` wraps to X·P + j + N, the element j of row X + N / P, where index_put
wraps row X; an X out of range is refused by both. Two equal rows: either write wins, in both.
(After `paged_write` a cache position outside [0, L) is refused by the step's input check, as
that rule says; the flat write would land in a neighbouring slot's rows.)

Index dtypes: `put` takes only an int64 flat index (eager and Dynamo raise on int32), so the
rule takes only that. X itself may be int64 or int32 (an int32 X times P stays int32, plus
the int64 arange): X·P cannot wrap for an X in range where N fits X's dtype, which the rule
requires, and index_put takes both. (An X so far out of range that X·P wraps in int32: eager
writes wherever the wrapped index lands, the rewrite raises index_put's error.)

Left alone: an accumulating put, an index with another stride than a trailing block's numel,
a flat index that is not int64, an X that is not int64 or int32 (index_put reads a bool or
uint8 index as a mask and refuses int16), an offset, a `j` range that is not the whole row
(an arange of another length or start), values that are not one row per index in the index's
order, a flat write read otherwise than viewed back to the buffer's shape.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import arange_length
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten

INDEX_DTYPES = (torch.int64, torch.int32)  # index_put's row indices (not masks)


def _times(node, n: int):
    """t where node is t * n (either order)."""
    if not isinstance(node, fx.Node) or node.target is not aten.mul.Tensor or node.kwargs:
        return None
    a, b = node.args[:2]
    return a if b == n and isinstance(a, fx.Node) else b if a == n and isinstance(b, fx.Node) \
        else None


def _column(node):
    """X where node is X with a unit dim appended (unsqueeze(X, -1), or a view that does it)."""
    if not isinstance(node, fx.Node):
        return None
    shape, src = _shape(node), node.args[0] if node.args else None
    if shape is None or not shape or shape[-1] != 1 or _shape(src) != shape[:-1]:
        return None
    if node.target is aten.unsqueeze.default and node.args[1] in (-1, len(shape) - 1):
        return src
    return src if node.target in RESHAPES else None


def row_index(index: fx.Node, per: int, numel: int):
    """X where index is X[..., None] * per + arange(per), an int64 index whose X·per cannot wrap
    for a row in range of a buffer of `numel` elements, else None."""
    if not isinstance(index, fx.Node) or index.target is not aten.add.Tensor or index.kwargs \
            or index.meta["val"].dtype != torch.int64:
        return None
    for term, steps in (index.args[:2], reversed(index.args[:2])):
        if arange_length(steps) != per:
            continue
        inner = _times(term, per)
        x = _column(inner) if inner is not None else None
        if x is None:  # unsqueeze(X * per, -1)
            scaled = _column(term)
            x = _times(scaled, per) if scaled is not None else None
        dtype = x.meta["val"].dtype if x is not None else None
        if dtype in INDEX_DTYPES and numel <= torch.iinfo(dtype).max \
                and _shape(x) is not None and _shape(index) == (*_shape(x), per):
            return x
    return None


def _same_values(node: fx.Node, want: tuple[int, ...]) -> fx.Node | None:
    """The node of shape `want` farthest up node's chain of reshapes and contiguous copies (each
    lists the same elements in row-major order), node included, or None."""
    found = None
    while isinstance(node, fx.Node):
        if _shape(node) == want:
            found = node
        copy = node.target is aten.clone.default \
            and node.kwargs.get("memory_format") in (None, torch.contiguous_format)
        if node.target not in RESHAPES and not copy:
            return found
        node = node.args[0]
    return found


def _site(put: fx.Node):
    base, indices, values = put.args[:3]
    accumulate = put.args[3] if len(put.args) > 3 else put.kwargs.get("accumulate", False)
    if accumulate or len(indices) != 1 or base.target not in RESHAPES or len(put.users) != 1:
        return None
    buf, (out,) = base.args[0], put.users
    shape = _shape(buf)
    if shape is None or len(shape) < 2 or _shape(base) != (math.prod(shape),) \
            or out.target not in RESHAPES or _shape(out) != shape:
        return None
    k = next((k for k in range(1, len(shape)) if math.prod(shape[k:]) == _shape(indices[0])[-1]),
             None) if _shape(indices[0]) else None
    if k is None:
        return None
    x = row_index(indices[0], math.prod(shape[k:]), math.prod(shape))
    if x is None or _shape(values) != _shape(indices[0]):
        return None
    if not (_viewable(x, (math.prod(_shape(x)),)) and _viewable(values, _rows_shape(x, shape, k))):
        return None
    return buf, out, x, k


def _viewable(node: fx.Node, shape: tuple[int, ...]) -> bool:
    """`_viewed` can give node's values that shape: a node of it up the chain, or a view."""
    return _same_values(node, shape) is not None or node.meta["val"].is_contiguous()


def _rows_shape(x: fx.Node, shape: tuple[int, ...], k: int) -> tuple[int, ...]:
    return (math.prod(_shape(x)), *shape[k:])


def _write(graph: fx.Graph, put: fx.Node, site) -> None:
    buf, out, x, k = site
    shape = _shape(buf)
    with graph.inserting_before(put):
        flat = _viewed(graph, x, (math.prod(_shape(x)),), put)
        rows = _viewed(graph, put.args[2], _rows_shape(x, shape, k), put)
        if k == 1:
            new = call(graph, aten.index_put.default, (buf, [flat], rows), like=put)
        else:
            base = call(graph, aten.view.default, (buf, [math.prod(shape[:k]), *shape[k:]]),
                        like=put)
            new = call(graph, aten.index_put.default, (base, [flat], rows), like=put)
            new = call(graph, aten.view.default, (new, list(shape)), like=put)
    out.replace_all_uses_with(new)
    graph.erase_node(out)
    graph.erase_node(put)


def _viewed(graph: fx.Graph, node: fx.Node, shape: tuple, like: fx.Node) -> fx.Node:
    """node's values shaped `shape`: a node up its chain of reshapes and copies, else a view."""
    found = _same_values(node, shape)
    return found if found is not None else call(graph, aten.view.default, (node, list(shape)),
                                                like=like)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.index_put.default})


RULE = Rule("put_rows", apply, "Tensor.put of whole rows at X[..., None] * P + arange(P) -> "
                               "index_put of the rows X")

__all__ = ["RULE", "apply", "row_index"]
