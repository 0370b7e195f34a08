"""Rule `expert_stack`: routed experts kept as per-expert tensors (an `nn.ModuleList` of experts,
transformers style: `experts.{e}.gate_proj.weight_packed`, ...) and selected by stacking the list
and indexing it with the top-k ids -> one stacked [E, ...] tensor indexed by the ids, the form our
model's stacked expert parameters have (`w1_packed[ids]`), which `patterns/moe_experts.py`
matches.

`torch.stack([p_0, ..., p_{E-1}])[ids]` over E graph inputs traces to
`index(view(cat([p_0 .. p_{E-1}]), [E, ...]), [ids])` (or a cat of unsqueezes); the rule puts
`k3.expert_stack([p_0 .. p_{E-1}])` in place of the stacked tensor. Why an op over the list and
not one buffer made at compile time:

* the stack must not copy every expert per step (a decode step reads k of E experts; copying all
  E is the cost MoE exists to avoid), so the result must be a view of the experts' storage;
* it must never read stale weights (issue 20): a buffer stacked once at compile time and read as a
  graph constant would miss a later `param.data = ...` of one expert and read the old bytes.

`k3.expert_stack` (k3compile/ops/expert_stack.py) returns a view where the parts lie back to back
in one buffer, checked on every call, and `torch.stack` otherwise (slow, never stale). Stage
`pack` moves each stacked group's parts into one buffer, once, so on the fast path the view is all
there is. A `torch.library` custom op may not return a view of its inputs, so the op is declared
with an alias annotation, which is fine after functionalisation, where canonicalize runs.

Taken: a stack on dim 0 of E >= 2 graph inputs of one shape, dtype and device, every use of which
is an index on dim 0 by one integer tensor. Left alone: a stack of computed tensors, of mixed
shapes or dtypes, on another dim, or used otherwise (all of it is read then; nothing to save).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import val as _val
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten


def _stack_parts(node: fx.Node) -> list[fx.Node] | None:
    """The parts p_0..p_{E-1} if node is stack(parts) on dim 0 (a cat of unsqueeze(p, 0), or a
    view [E, *shape] of a cat of the parts), else None."""
    if node.op != "call_function":
        return None
    if node.target in RESHAPES:
        cat, out = node.args[0], _val(node)
        if not (isinstance(cat, fx.Node) and cat.target is aten.cat.default and out is not None
                and _cat_dim(cat) == 0 and len(cat.users) == 1):
            return None
        parts = list(cat.args[0])
        first = _val(parts[0]) if parts and isinstance(parts[0], fx.Node) else None
        if first is None or tuple(out.shape) != (len(parts), *first.shape):
            return None
        return parts
    if node.target is aten.cat.default and _cat_dim(node) == 0:
        parts = []
        for u in node.args[0]:
            if not (isinstance(u, fx.Node) and u.target is aten.unsqueeze.default
                    and u.args[1] == 0 and len(u.users) == 1):
                return None
            parts.append(u.args[0])
        return parts
    return None


def _cat_dim(cat: fx.Node) -> int:
    return cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)


def _same_inputs(parts: list) -> bool:
    vals = [_val(p) for p in parts]
    if len(parts) < 2 or any(v is None for v in vals):
        return False
    if any(not isinstance(p, fx.Node) or p.op != "placeholder" for p in parts):
        return False
    first = vals[0]
    return all(v.shape == first.shape and v.dtype == first.dtype and v.device == first.device
               for v in vals) and len(set(parts)) == len(parts)


def _gathered_by_ids(node: fx.Node) -> bool:
    """Every use indexes dim 0 by one integer tensor (the routed ids)."""
    for u in node.users:
        if u.target is not aten.index.Tensor or u.args[0] is not node:
            return False
        indices = u.args[1]
        ids = indices[0] if len(indices) == 1 else None
        if _val(ids) is None or _val(ids).dtype not in (torch.int64, torch.int32):
            return False
    return bool(node.users)


def _site(node: fx.Node) -> list[fx.Node] | None:
    parts = _stack_parts(node)
    return parts if parts is not None and _same_inputs(parts) and _gathered_by_ids(node) else None


def _write(graph: fx.Graph, node: fx.Node, parts: list[fx.Node]) -> None:
    with graph.inserting_before(node):
        stacked = call(graph, torch.ops.k3.expert_stack.default, (parts,), like=node)
    node.replace_all_uses_with(stacked)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write)


RULE = Rule("expert_stack", apply,
            "stack / cat of E per-expert graph inputs indexed by the routed ids -> "
            "k3.expert_stack(parts)[ids] (a view of one packed buffer; stage pack stores it so)")

__all__ = ["RULE", "apply"]
