"""Rule `cast_squeeze`: an upcast between a bmm's output views and the view that drops their size-1
dims -> that view first, then the upcast.

An einsum lowers to a bmm whose output is viewed and permuted back to the operands' dims, and
ends, where the einsum's output has fewer dims, with a view dropping the size-1 ones; the
patterns trace the user's `.float()` after the einsum, so after that view (moe_experts' FC2,
`y.float()` before the weighted finalize). spell9's vmapped experts cast their output
(`policy.cast_to_compute(ys)`) before its reshape, and once the rules have composed that
reshape chain the graph reads
    view(convert_element_type(permute(view(bmm)), fp32), [N, k, L])    (spell9 bf16)
    convert_element_type(view(permute(view(bmm)), [N, k, L]), fp32)    (canonical)
Exact: a cast is elementwise, a view moves no value. The same direction as the canonical form's
other upcasts (after views; rule `cast_merge` moves only downcasts ahead of head merges).

Taken: a view / reshape that only drops or inserts size-1 dims, of an upcast (bf16 / fp16 ->
fp32) that nothing else reads, whose input is a bmm's output through views and permutes only.
Left alone: an upcast of anything else (a norm's input, a weight), a downcast, a view that
moves a non-unit dim, and an upcast also read before its view.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.cast_view import swap
from k3compile.canonical.region import CAST, LOW, val
from k3compile.graph import RESHAPES

aten = torch.ops.aten
_BMM_VIEWS = RESHAPES | {aten.permute.default}


def _squeeze(view: fx.Node) -> bool:
    """view only drops or inserts size-1 dims."""
    src, out = val(view.args[0]), val(view)
    if src is None or out is None:
        return False
    return [d for d in src.shape if d != 1] == [d for d in out.shape if d != 1]


def _from_bmm(node: fx.Node) -> bool:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _BMM_VIEWS:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.target is aten.bmm.default


def _site(view: fx.Node) -> bool:
    cast = view.args[0]
    if not (isinstance(cast, fx.Node) and cast.target is CAST and len(cast.users) == 1
            and _squeeze(view)):
        return False
    src, out = val(cast.args[0]), val(cast)
    return (src is not None and out is not None and src.dtype in LOW
            and out.dtype == torch.float32 and _from_bmm(cast.args[0]))


def _write(graph: fx.Graph, view: fx.Node, _) -> None:
    cast = view.args[0]
    swap(graph, view)  # the view, then the upcast
    graph.erase_node(cast)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets=RESHAPES)


RULE = Rule("cast_squeeze", apply, "an upcast of a bmm's output views before the view dropping "
                                   "their size-1 dims -> the view, then the upcast")
