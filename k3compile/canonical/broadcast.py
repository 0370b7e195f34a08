"""Rule `broadcast`: an operand of an elementwise op that only adds the dims broadcasting adds anyway
-> the operand itself, the form `scores + bias` traces to.

K3 code writes the router's bias correction as `scores + bias.unsqueeze(0)` (transformers,
Moonshot), `bias.view(1, -1)`, `bias[None]` or `bias.expand_as(scores)`; our model and the
patterns write `scores + bias` and leave the [E] -> [1, E] -> [N, E] step to broadcasting.

Taken: an operand of a pointwise ATen op (`torch.Tag.pointwise`, not in place) that is
`unsqueeze(x, 0)`, a view/reshape of x to [1, ..., 1, *x.shape], or an expand of x (chains of
them), where x is a graph input (a parameter or buffer, or a dtype cast of one) with at least
one dim. Exact: broadcasting is that same expand, so every element reads the same value. Proved
per site on the fake values: the op on x gives the same shape, dtype and strides; a site where
broadcasting would give another shape (the op had no operand of the expanded rank) stays. A
0-dim x stays too: type promotion treats a 0-dim tensor like a scalar, so dropping its dims could
change the result's dtype.

Only graph inputs: a weight is written at its own shape in the canonical form, but computed
tensors are not. Our model (and so the patterns) views computed tensors to their broadcast rank
itself: `arange(S).view(1, 1, -1) <= pos.unsqueeze(-1)` (mla_decode), a [B, T, H, K] view that
only adds leading dims at B = T = 1 (kda_decode); taking those views away would hide the sites.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import val as _val
from k3compile.graph import fake_value

aten = torch.ops.aten
_LEADING = {aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default,
            aten.reshape.default}
_EXPANDS = {aten.expand.default}


def _is_input(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is torch.ops.prims.convert_element_type.default:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "placeholder"


def _source(node) -> fx.Node | None:
    """x if node is x with dims added that broadcasting adds anyway, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target not in _LEADING | _EXPANDS or not isinstance(node.args[0], fx.Node):
        return None
    x, out = _val(node.args[0]), _val(node)
    if x is None or out is None or x.dim() == 0:
        return None
    if node.target in _EXPANDS:
        return node.args[0]
    added = out.dim() - x.dim()
    if added <= 0 or tuple(out.shape[added:]) != tuple(x.shape):
        return None
    return node.args[0]


def _sources(node) -> list[fx.Node]:
    """node's chain of sources, innermost first, if it starts at a graph input."""
    chain = []
    while (node := _source(node)) is not None:
        chain.append(node)
    return chain[::-1] if chain and _is_input(chain[-1]) else []


def _same_result(node: fx.Node, args: tuple) -> bool:
    want = _val(node)
    try:
        got = fake_value(node.target, args, node.kwargs)
    except RuntimeError:  # shapes that do not broadcast without the added dims
        return False
    if want is None or not isinstance(got, torch.Tensor):
        return False
    if (got.shape, got.dtype) != (want.shape, want.dtype):
        return False
    return all(a == b for a, b, n in zip(got.stride(), want.stride(), want.shape) if n > 1)


def _is_elementwise(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.pointwise in target.tags and not target._schema.is_mutable)


def _narrow_operand(node: fx.Node, i: int) -> bool:
    for source in _sources(node.args[i]):
        args = (*node.args[:i], source, *node.args[i + 1:])
        if _same_result(node, args):
            node.args = args
            return True
    return False


def _write(graph: fx.Graph, node: fx.Node, _) -> int:
    return sum(_narrow_operand(node, i) for i in range(len(node.args)))


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _is_elementwise, _write, tidy=False)


RULE = Rule("broadcast", apply,
            "x.unsqueeze(0) / view(1, ..) / expand into an elementwise op -> x (broadcasting)")
