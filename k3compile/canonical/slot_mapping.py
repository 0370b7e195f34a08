"""Rule `slot_mapping`: a state read by a per-token slot mapping that is the slots themselves (a
serving engine's flat tokens at one token per request, spell7: `kv_cache[slot_mapping]` with
`slot_mapping = slots.unsqueeze(1).expand(B, 1).reshape(-1)`) -> the read by the slots, the
node the cache write's `slots.view(B, 1)` reads, as the MLA patterns' `kv_cache[slots]` has it:

    index(x, [view(expand(unsqueeze(slots, 1), [B, 1]), [-1])])  ->  index(x, [slots])

The same values (the mapping is the slots, element for element); only the node differs. The
mapping is read by the layout reader (`canonical/layout.py`), so any view spelling of the slots
is taken; another order, an offset, a scaled slot vector or an index over other dims is not.

Not taken: T > 1 (each slot repeated T times). There `mla_absorbed` reads the N = B·T tokens
as N requests of one row each, which mla_decode must not take (its requests would share cache
slots); rule `verify_rows`, after `mla_absorbed`, views them back to [B, T]. Rewriting the read
alone to `x[slots]` broadcast over T made mla_absorbed fail on the site, so it is not done.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.layout import layout
from k3compile.graph import call

aten = torch.ops.aten


def _site(node: fx.Node):
    indices = node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    mapping = indices[0]
    val = mapping.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1 or val.dtype.is_floating_point:
        return None
    lay = layout(mapping)
    if lay is None or lay.root is mapping or lay.offset != 0 or lay.scale != 1.0:
        return None
    slots = lay.root.meta.get("val")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != val.dtype:
        return None
    B, N = int(slots.shape[0]), int(val.shape[0])
    if N != B:
        return None
    steps = [(size, stride) for size, stride in lay.dims[0] if size != 1]
    return lay.root if steps == ([(B, 1)] if B > 1 else []) else None


def _write(graph: fx.Graph, node: fx.Node, slots: fx.Node) -> None:
    with graph.inserting_before(node):
        read = call(graph, aten.index.Tensor, (node.args[0], [slots]), like=node)
    node.replace_all_uses_with(read)
    graph.erase_node(node)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.index.Tensor})


RULE = Rule("slot_mapping", apply, "x[a view chain of the slots (one token per request)] -> "
                                   "x[slots]")
