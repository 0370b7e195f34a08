"""Rule `state_write`: the spellings of a whole-row write into a state buffer (KDA's conv and
recurrent state, MLA's latent cache) as what our model's `buf[slots] = x` traces to,
`index_put(buf, [slots], x)` (then the `copy_` write-back AOT adds, unchanged).

In the functional graph a write into a graph input is a functional computation of the new
buffer plus a final `copy_(buf, new)`. Spellings and what AOT makes of them:

    buf[slots] = x, buf.index_put_((slots,), x),     index_put(buf, [slots], x)   (canonical)
    buf.index_copy_(0, slots, x)                      (index_copy is decomposed to it)
    buf[slots, :, -L:] = x   (L = buf's last size)   slice_scatter(buf, index_put(slice(buf, 2,
                                                         -L, end), [slots], x), 2, -L, end)
    buf.scatter_(0, slots.view(-1, 1, 1)             scatter(buf, 0, expand(view(slots)), x)
                 .expand_as(x), x)
    buf[:, :, -L:].copy_(y)                           slice_scatter(buf, y, 2, -L, end)

The canonical value has no leading size-1 dims: `buf[slots] = x` (Tensor.__setitem__) views them
away before index_put, so at batch 1 our model writes index_put(buf, [slots], view(x, x[0].shape))
where `index_copy_`, `index_put_` or a scatter write x itself. index_put broadcasts its value
over the indexed rows, and broadcasting prepends size-1 dims, so the view changes no value.

A slice_scatter whose slice is the whole buffer is its source (a whole-range write), and
index_put into the whole slice of buf is index_put into buf; a scatter along dim 0 whose index
is one slot per row, broadcast over whole rows, is index_put(buf, [slots], x); an index_copy
that survives decomposition is index_put(buf, [idx], src). Only writes whose result reaches a
state write-back (`copy_` into a graph input) are touched.

Left alone: partial writes (`buf[slots, :, -k:] = ...` with k < L, row ranges `buf[0:2]`,
`buf[i]` with a Python int), scatters whose index varies within a row, and `buf[slots].copy_(x)`:
advanced indexing makes a copy in eager, so that write goes nowhere; AOT drops it the same way
and this rule never invents it.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape as _shape
from k3compile.graph import call

aten = torch.ops.aten

# functional writes that compute a new buffer from their first argument
WRITES = {aten.index_put.default, aten.slice_scatter.default, aten.select_scatter.default,
          aten.scatter.src, aten.index_copy.default}
# views that keep the values of a 1-D index tensor, one per row
INDEX_VIEWS = {aten.view.default, aten.unsqueeze.default, aten.reshape.default}


def reaches_state(node: fx.Node) -> bool:
    """node's value is (part of) a new state buffer: it reaches `copy_(graph input, ·)` through
    functional writes."""
    for user in node.users:
        if (user.target is aten.copy_.default and user.args[1] is node
                and user.args[0].op == "placeholder"):
            return True
        if user.target in WRITES and node in user.args and reaches_state(user):
            return True
    return False


def _whole_slice_scatter(graph: fx.Graph, node: fx.Node) -> bool:
    """slice_scatter(buf, V) over the whole of buf -> V (and index_put(slice(buf)) in V ->
    index_put(buf))."""
    base, src = node.args[:2]
    if _shape(src) is None or _shape(src) != _shape(base):
        return False
    if src.target is aten.index_put.default and len(src.users) == 1:
        sliced = src.args[0]
        if (sliced.target is aten.slice.Tensor and sliced.args[0] is base
                and _shape(sliced) == _shape(base)):
            src.replace_input_with(sliced, base)
    node.replace_all_uses_with(src)
    graph.erase_node(node)
    return True


def _row_index(index: fx.Node, src: fx.Node) -> fx.Node | None:
    """The 1-D slot index a scatter index holds, if it is one slot per row broadcast over
    whole rows (expand of a [B, 1, ..., 1] view)."""
    if index.target is not aten.expand.default or _shape(index) != _shape(src):
        return None
    lead = index.args[0]
    shape = _shape(lead)
    if shape is None or len(shape) != len(_shape(src)) or any(s != 1 for s in shape[1:]):
        return None
    if lead.target in INDEX_VIEWS and len(_shape(lead.args[0]) or ()) == 1:
        return lead.args[0]
    return lead


def _scatter_rows(graph: fx.Graph, node: fx.Node) -> bool:
    """scatter(buf, 0, slots broadcast over rows, x) with x whole rows -> index_put."""
    buf, dim, index, src = node.args[:4]
    if node.kwargs or dim not in (0, -len(_shape(buf) or ())):
        return False
    if _shape(src) is None or _shape(src)[1:] != _shape(buf)[1:]:
        return False
    slots = _row_index(index, src)
    if slots is None:
        return False
    with graph.inserting_before(node):
        if len(_shape(slots)) != 1:
            slots = call(graph, aten.view.default, (slots, [_shape(src)[0]]), like=node)
        put = call(graph, aten.index_put.default, (buf, [slots], src), like=node)
    node.replace_all_uses_with(put)
    graph.erase_node(node)
    return True


def _index_copy(graph: fx.Graph, node: fx.Node) -> bool:
    """index_copy(buf, 0, idx, src) -> index_put(buf, [idx], src)."""
    buf, dim, idx, src = node.args[:4]
    if dim not in (0, -len(_shape(buf) or ())):
        return False
    with graph.inserting_before(node):
        put = call(graph, aten.index_put.default, (buf, [idx], src), like=node)
    node.replace_all_uses_with(put)
    graph.erase_node(node)
    return True


def _leading_ones(shape: tuple) -> int:
    lead = 0
    while lead < len(shape) and shape[lead] == 1:
        lead += 1
    return lead


def _strip_leading_ones(graph: fx.Graph, node: fx.Node, _) -> bool:
    """index_put(buf, idx, x) with x [1, .., 1, *rest] -> index_put(buf, idx, view(x, rest)), the
    value as Tensor.__setitem__ hands it over."""
    value = node.args[2]
    shape = _shape(value)
    lead = _leading_ones(shape) if shape is not None else 0
    if not lead:
        return False
    with graph.inserting_before(node):
        stripped = call(graph, aten.view.default, (value, list(shape[lead:])), like=node)
    node.replace_input_with(value, stripped)
    return True


REWRITES = {
    aten.slice_scatter.default: _whole_slice_scatter,
    aten.scatter.src: _scatter_rows,
    aten.index_copy.default: _index_copy,
}


def _rewrite(graph: fx.Graph, node: fx.Node, _) -> bool:
    return REWRITES[node.target](graph, node)


def apply(graph: fx.Graph) -> int:
    done = rewrite_sites(graph, reaches_state, _rewrite, targets=REWRITES.keys(), tidy=False)
    # every state write's value, the ones made above too
    return done + rewrite_sites(graph, reaches_state, _strip_leading_ones,
                                targets={aten.index_put.default}, tidy=False)


RULE = Rule("state_write", apply, "whole-row state writes (whole-range slice_scatter, row "
                                  "scatter, index_copy) -> index_put(buf, [slots], x), x without "
                                  "leading size-1 dims")
