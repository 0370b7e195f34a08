"""Rule `scatter_rows`: a paged cache-row write spelled as `scatter_` along the rows (a serving
file's `cache.view(-1, R).scatter_(0, flat.unsqueeze(-1).expand(N, R), rows)`, spell7) -> the
`index_put` that `cache.view(-1, R).index_copy_(0, flat, rows)` traces to, which rule
`paged_write` (next in ORDER) turns into the (slot, position) write the MLA patterns read:

    scatter(view(cache, [S*L, R]), 0, expand(unsqueeze(flat, -1), [N, R]), rows)
        -> index_put(view(cache, [S*L, R]), [flat], rows)

The same values: an index whose every column is `flat` writes row `rows[i]` whole at row
`flat[i]`, what index_put writes (two equal indices: either row, in both). Taken only where
`paged_write` then takes the write (the base a flat view of a graph input, the index `s * L +
p` for that input's L, one index per row), so the compiled step's input check (validate.py)
refuses positions outside the cache before any state is written: a negative flat index, which
`scatter_` refuses in eager and `index_put` would wrap, never reaches the write.

The flat index may also be a [N, 1] view of the [B, T] mapping itself (spell6's `(slots[:, None] *
L + pos).reshape(-1, 1)`); it is then viewed to [N] for the index_put.

Left alone: a scatter along another dim, an index not one column broadcast over the row, rows
of another shape than the index, a scatter_add / reduce, a flat index not `s * L + p`.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.paged_write import VIEWS, slot_and_position
from k3compile.canonical.region import shape as _shape
from k3compile.graph import call

aten = torch.ops.aten


def flat_column(index: fx.Node, n: int) -> fx.Node | None:
    """flat (n elements) where index is flat broadcast over the row: expand of unsqueeze(flat,
    -1) with flat [n], or of a [n, 1] view of flat of any shape (spell6: the [B, T] mapping
    `reshape(-1, 1)`)."""
    if index.target is not aten.expand.default:
        return None
    col = index.args[0]
    unsqueezed = col.target is aten.unsqueeze.default and col.args[1] in (1, -1)
    if not (unsqueezed or col.target in VIEWS and _shape(col) == (n, 1)):
        return None
    flat = col.args[0]
    shape = _shape(flat)
    return flat if shape == (n,) or not unsqueezed and shape and math.prod(shape) == n else None


def _site(node: fx.Node):
    base, dim, index, rows = node.args[:4]
    if node.kwargs.get("reduce") or len(node.args) > 4 or not isinstance(index, fx.Node):
        return None
    shape = _shape(base)
    if shape is None or len(shape) != 2 or dim % 2 != 0 or _shape(index) != _shape(rows):
        return None
    if _shape(rows) is None or _shape(rows)[1] != shape[1]:
        return None
    flat = flat_column(index, _shape(rows)[0])
    if flat is None or base.target not in VIEWS or base.args[0].op != "placeholder":
        return None
    cache = _shape(base.args[0])
    if cache is None or len(cache) < 3 or slot_and_position(flat, cache[1]) is None:
        return None
    return base, flat, rows


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    base, flat, rows = site
    with graph.inserting_before(node):
        if _shape(flat) != _shape(rows)[:1]:
            flat = call(graph, aten.view.default, (flat, [_shape(rows)[0]]), like=flat)
        new = call(graph, aten.index_put.default, (base, [flat], rows), like=node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.scatter.src})


RULE = Rule("scatter_rows", apply, "cache.view(-1, R).scatter(0, flat[:, None].expand(N, R), "
                                   "rows) -> index_put(view, [flat], rows)")
