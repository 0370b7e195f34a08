"""Rule `group_limit`: a group-limited top-k whose group mask keeps every expert -> the scores
themselves, the form a router without groups (K3's, ours) traces to.

DeepSeek-V3-style gates (transformers' `get_topk_indices`, vLLM's `grouped_topk`) always build
the group mask, also for K3's `num_expert_group=1, topk_group=1`:

    group_scores = s.view(n, G, -1).topk(2)[0].sum(-1)        # or .max(-1).values
    group_idx = topk(group_scores, topk_group, sorted=False)[1]
    mask = zeros_like(group_scores).scatter_(1, group_idx, 1)  # [n, G]
    s = s.masked_fill(~mask.unsqueeze(-1).expand(n, G, E // G).reshape(n, E).bool(), 0.0)

With one group, the scatter writes a 1 into every element of the [n, 1] mask, whatever the
scores are, so the mask keeps everything and the masked_fill is the identity. This rule proves
that from the graph, not from names: it reads a mask's value where every element is known
(`known_value`: a fill, a scatter that writes every element of its target — its dim has size 1,
or the index is a top-k of that whole dim — and the views, casts, `~` and comparisons on it), and
rewrites `where(c, a, b)` with c all True / all False, `masked_fill(x, m, v)` with m all False and
`x * m` with m all 1 into the operand they return, where that operand already has the result's
shape and dtype. Exact: the same tensor. A real group limit (G > topk_group) selects per row:
its mask is not known and stays.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.region import val as _val

aten = torch.ops.aten
_FILLS = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
          aten.scalar_tensor.default: 0}
_CONSTANTS = {aten.zeros.default: 0, aten.zeros_like.default: 0, aten.new_zeros.default: 0,
              aten.ones.default: 1, aten.ones_like.default: 1, aten.new_ones.default: 1}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
          aten.squeeze.dims, aten.permute.default, aten.clone.default, aten.alias.default,
          aten.t.default, aten.transpose.int, aten.slice.Tensor, aten.select.int}
_SCATTERS = {aten.scatter.value: "value", aten.scatter.src: "src"}
_NOTS = {aten.bitwise_not.default, aten.logical_not.default}
_COMPARES = {aten.eq.Scalar: operator.eq, aten.ne.Scalar: operator.ne}


def _cast(value, dtype: torch.dtype):
    return torch.tensor(value).to(dtype).item()


def known_value(node) -> bool | int | float | None:
    """The value every element of node's tensor holds whatever the graph's inputs are, or None."""
    if not isinstance(node, fx.Node):
        return node if isinstance(node, (bool, int, float)) else None
    if node.op != "call_function" or _val(node) is None:
        return None
    target, args = node.target, node.args
    if target in _CONSTANTS:
        value = _CONSTANTS[target]
    elif target in _FILLS:
        value = args[_FILLS[target]]
    elif target in _VIEWS:
        value = known_value(args[0])
    elif target in _SCATTERS:
        value = _scatter_value(node)
    elif target is torch.ops.prims.convert_element_type.default or target is aten._to_copy.default:
        value = known_value(args[0])
    elif target in _NOTS and _val(node).dtype == torch.bool:
        value = None if (v := known_value(args[0])) is None else not v
    elif target in _COMPARES:
        value = None if (v := known_value(args[0])) is None else _COMPARES[target](v, args[1])
    else:
        return None
    return None if value is None else _cast(value, _val(node).dtype)


def _scatter_value(node: fx.Node):
    """scatter(self, dim, index, value/src): the written value where it reaches every element of
    self, or self's own where it writes that value too."""
    self, dim, index, written = node.args[:4]
    value = known_value(written)
    if value is None:
        return None
    if _writes_every_element(self, dim, index) or known_value(self) == value:
        return value
    return None


def _writes_every_element(target, dim: int, index) -> bool:
    shape, idx_shape = _shape(target), _shape(index)
    if shape is None or idx_shape is None or len(shape) != len(idx_shape):
        return False
    dim %= len(shape)
    if any(i != s for d, (i, s) in enumerate(zip(idx_shape, shape)) if d != dim):
        return False
    if shape[dim] == 1:
        return idx_shape[dim] >= 1  # a valid index into one slot is that slot
    return _is_whole_topk(index, dim, shape[dim])


def _is_whole_topk(index, dim: int, size: int) -> bool:
    """index is the indices of a top-k taking all `size` elements of `dim`: distinct, so all."""
    if not (isinstance(index, fx.Node) and index.target is operator.getitem and index.args[1] == 1):
        return False
    topk = index.args[0]
    if not (isinstance(topk, fx.Node) and topk.target is aten.topk.default):
        return False
    source, k = _shape(topk.args[0]), topk.args[1]
    topk_dim = {**dict(zip(("dim",), topk.args[2:3])), **topk.kwargs}.get("dim", -1)
    return source is not None and k == size and topk_dim % len(source) == dim


# ---- the ops a known mask makes the identity ----------------------------------------------------


def _kept_operand(node: fx.Node) -> fx.Node | None:
    target, args = node.target, node.args
    if target is aten.where.self:
        cond = known_value(args[0])
        return None if cond is None else (args[1] if cond else args[2])
    if target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        return args[0] if isinstance(args[1], fx.Node) and known_value(args[1]) is False else None
    if target is aten.mul.Tensor:  # by a mask tensor: a literal `* 1.0` is a scaling, not a mask
        for mask, kept in ((args[0], args[1]), (args[1], args[0])):
            if isinstance(mask, fx.Node) and known_value(mask) == 1:
                return kept
    return None


def _erase_unused(node) -> None:
    if isinstance(node, fx.Node) and node.op == "call_function" and not node.users \
            and not node.is_impure():
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        for inp in inputs:
            _erase_unused(inp)


def _site(node: fx.Node) -> fx.Node | None:
    """The operand node passes on unchanged, where it has node's shape and dtype."""
    if node.op != "call_function":
        return None
    kept, want = _kept_operand(node), _val(node)
    if kept is None or want is None or _val(kept) is None:
        return None
    return kept if (_val(kept).shape, _val(kept).dtype) == (want.shape, want.dtype) else None


def _write(graph: fx.Graph, node: fx.Node, kept: fx.Node) -> None:
    node.replace_all_uses_with(kept)
    _erase_unused(node)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, tidy=False)


RULE = Rule("group_limit", apply,
            "group-limited top-k whose mask keeps every expert (one group) -> the scores")
