"""Rule `index_slice`: a write at one constant index, `torch.index_copy(bank, d, tensor([j]), v)`
(JAX's `bank.at[..., j, :].set(v)` ported out of place) -> `slice_scatter(bank, v, d, j, j + 1)`,
the form slice assignment (`bank[..., j, :] = v`) traces to.

spell9 keeps the AttnRes block bank as a preallocated zeros tensor and writes each finished
block with `index_copy` of a literal index; it decomposes to

    index_put(bank, [None, ..., None, full([1], j)], v)

which rule `depth_mix` does not read as a bank write (it follows `slice_scatter` /
`select_scatter` chains to the block each index holds), so the mixes over the bank stay
unfused. Taken only where the one index is a constant `full([1], j)` of an integer dtype with
-size <= j < size on dim d (an index out of range raises in eager; it is left so), no
accumulate, and v has the slice's exact shape and the bank's dtype (no broadcast). Exact: the
same elements written.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.graph import call

aten = torch.ops.aten


def _constant_index(node) -> int | None:
    """j if node is `full([1], j)` of an integer dtype, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is aten.full.default and list(node.args[0]) == [1]):
        return None
    j, dtype = node.args[1], node.kwargs.get("dtype")
    if not isinstance(j, int) or isinstance(j, bool) or dtype not in (torch.int64, torch.int32):
        return None
    return j


def _site(node: fx.Node) -> tuple[int, int] | None:
    """(dim, start) of node = index_put(bank, [None] * dim + [full([1], j)], v)."""
    bank, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate or not indices or any(i is not None for i in indices[:-1]):
        return None
    dim, j = len(indices) - 1, _constant_index(indices[-1])
    shape, vshape = _shape(bank), _shape(values)
    if j is None or shape is None or vshape is None or not -shape[dim] <= j < shape[dim]:
        return None
    start = j % shape[dim]
    if vshape != (*shape[:dim], 1, *shape[dim + 1:]) or _val(values).dtype != _val(bank).dtype:
        return None
    return dim, start


def _write(graph: fx.Graph, node: fx.Node, site: tuple[int, int]) -> None:
    dim, start = site
    bank, _, values = node.args[:3]
    with graph.inserting_before(node):
        new = call(graph, aten.slice_scatter.default, (bank, values, dim, start, start + 1),
                   like=node)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.index_put.default})


RULE = Rule("index_slice", apply, "index_copy / index_put at one constant index "
            "(full([1], j)) -> slice_scatter(bank, v, dim, j, j + 1)")
