"""Rule `cache_block`: a functional cache update (spell9, a JAX port's `.at[b, pos].set`): the
requests' whole cache block gathered, the new rows put into the block out of place, the block
read, and the block written back whole -> the row write our model's `cache[slots, pos] = rows`
traces to, and the block's reads as reads of the written cache, the form the MLA rules and
patterns take:

    block = index_put(index(cache, [slots]), [b, pos], rows)       b[i, t] = i (an arange)
    index_put(cache, [slots], block)   (the write-back; `index_copy_` after rule state_write)
        -> new = index_put(cache, [view(slots, [B, 1]), pos], rows);  block -> index(new, [slots])

Exact where the slots are pairwise distinct: the block is then the slots' rows of the written
cache, and writing the whole block back changes, besides the rows put in, only rows it copied
unchanged. With a slot twice, eager writes back one of two blocks (the other request's rows are
lost) and each request reads only its own rows; the rewritten graph keeps both. The compiled step
never runs on such slots: the input check (`k3compile/validate.py`) reads `slots` as indexing a
state buffer's rows (the gather and the write-back both do) and refuses duplicates before any
state is written. A position indexes dim 1 of the block and of the cache alike (both of size L),
so out-of-range positions fail, or wrap, the same way in both forms.

Left alone: a block changed otherwise before the write-back (two puts, arithmetic), gathered from
another buffer or by other slots than it is written back at, rows put at a batch index that is
not the block's own row (`arange(B)` broadcast over the tokens), an accumulating put, a block
that is not written back into a graph input.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.layout import layout
from k3compile.canonical.region import arange_length
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.state_write import reaches_state
from k3compile.graph import call

aten = torch.ops.aten
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _plain_put(node) -> bool:
    if not isinstance(node, fx.Node) or node.target is not aten.index_put.default:
        return False
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    return not accumulate and all(isinstance(i, fx.Node) for i in node.args[1])


def _integer(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and not val.dtype.is_floating_point


def _block_rows(index: fx.Node, batch: int) -> bool:
    """index[i, ...] == i: an arange over the block's rows, broadcast over the other dims."""
    lay = layout(index)
    if lay is None or lay.offset != 0 or lay.scale != 1.0 or arange_length(lay.root) != batch:
        return False
    first = [(s, t) for s, t in lay.dims[0] if s != 1]
    rest = [t for dim in lay.dims[1:] for s, t in dim if s != 1]
    return first == ([(batch, 1)] if batch > 1 else []) and all(t == 0 for t in rest)


def _site(write: fx.Node):
    """(cache, slots, pos, rows, block, view) of a whole block written back at `write`."""
    if not _plain_put(write) or len(write.args[1]) != 1 or write.args[0].op != "placeholder":
        return None
    cache, (slots,), value = write.args[:3]
    block, view = value, None
    if getattr(value, "target", None) in VIEWS and len(value.users) == 1 \
            and _plain_put(value.args[0]):
        # batch 1: rule state_write hands index_put the block without its leading size-1 dim
        block, view = value.args[0], value
        if tuple(d for d in _shape(block) if d != 1) != tuple(d for d in _shape(view) if d != 1):
            return None
    if not _plain_put(block) or len(block.args[1]) != 2 or not reaches_state(write):
        return None
    gather, (rows_at, pos), rows = block.args[:3]
    if gather.target is not aten.index.Tensor or gather.args[0] is not cache \
            or list(gather.args[1]) != [slots]:
        return None
    slots_shape, pos_shape = _shape(slots), _shape(pos)
    if not (_integer(slots) and _integer(pos) and _integer(rows_at)) or len(slots_shape) != 1:
        return None
    B = slots_shape[0]
    if not isinstance(B, int) or _shape(gather) != (B, *_shape(cache)[1:]):
        return None
    if len(pos_shape) not in (1, 2) or pos_shape[0] != B or len(_shape(rows_at)) > len(pos_shape):
        return None
    if torch.broadcast_shapes(_shape(rows_at), pos_shape) != pos_shape:
        return None
    if not _block_rows(rows_at, B):
        return None
    return cache, slots, pos, rows, block, view


def _write(graph: fx.Graph, write: fx.Node, site) -> None:
    cache, slots, pos, rows, block, view = site
    with graph.inserting_before(block.next):  # the block's readers come after it
        column = slots
        if len(_shape(pos)) == 2:
            column = call(graph, aten.view.default, (slots, [_shape(slots)[0], 1]), like=block)
        new = call(graph, aten.index_put.default, (cache, [column, pos], rows), like=block)
        read = call(graph, aten.index.Tensor, (new, [slots]), like=block)
    write.replace_all_uses_with(new)
    graph.erase_node(write)
    if view is not None:
        graph.erase_node(view)
    block.replace_all_uses_with(read)
    graph.erase_node(block)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.index_put.default})


RULE = Rule("cache_block", apply, "a gathered cache block with rows put in and written back "
                                  "whole -> index_put(cache, [slots, pos], rows), the block's "
                                  "reads as cache_out[slots]")
