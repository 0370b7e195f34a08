"""Rule `cast_view`: a dtype cast of a head split -> the cast, then the split.

Splitting the last dim into heads and casting commute (a cast is elementwise, a view moves no
value), and code does them in either order. Moonshot's KDA layer splits q, k, v and the decay
input into heads in the activations' dtype (`rearrange(x, '... (h d) -> ... h d')`), and fla's
kernels cast to fp32 inside; `k3compile/math.py` and the `kda_decode` pattern cast first
(`x.float().view(B, T, H, D)`):
    view(x, [B, T, H, D]) -> convert_element_type(fp32)      (Moonshot + fla)
    convert_element_type(x, fp32) -> view([B, T, H, D])     (canonical)
Exact: the same values, dtype and shape.

Taken: a `convert_element_type` to another dtype whose input is a view / reshape that keeps the
leading dims and splits the last one in two (into more than one head). Left alone: casts after other views (a linear's
`[N, O] -> [B, T, O]` before `b.float()`, which the patterns bind as the value itself), casts to
the view's own dtype, and a split also read whole elsewhere keeps its view for those reads.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CAST
from k3compile.canonical.region import val as _val
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten


def same_size(a, b) -> bool:
    return statically_known_true(a == b)


def _head_split(view) -> bool:
    """view: [..., H·D] -> [..., H, D], the leading dims kept."""
    if not (isinstance(view, fx.Node) and view.op == "call_function" and view.target in RESHAPES):
        return False
    src, out = _val(view.args[0]), _val(view)
    if src is None or out is None or src.dim() < 1 or out.dim() != src.dim() + 1:
        return False
    lead = all(same_size(a, b) for a, b in zip(src.shape[:-1], out.shape[:-2], strict=True))
    # a size-1 "head" dim is no split (at batch 1, `[N, O] -> [B, T, O]` looks like one)
    return (lead and same_size(out.shape[-2] * out.shape[-1], src.shape[-1])
            and not same_size(out.shape[-1], src.shape[-1]))


def _site(node: fx.Node) -> bool:
    if not (node.op == "call_function" and node.target is CAST and _head_split(node.args[0])):
        return False
    val, src = _val(node), _val(node.args[0])
    return val is not None and src is not None and val.dtype != src.dtype


def swap(graph: fx.Graph, outer: fx.Node) -> None:
    """outer(inner(x, *a), *b) -> inner(outer(x, *b), *a), read by outer's users; inner is left
    for its other readers (rule cast_squeeze swaps a view after a cast the same way)."""
    inner = outer.args[0]
    with graph.inserting_before(outer):
        first = call(graph, outer.target, (inner.args[0], *outer.args[1:]), outer.kwargs,
                     like=outer)
        second = call(graph, inner.target, (first, *inner.args[1:]), inner.kwargs, like=outer)
    outer.replace_all_uses_with(second)
    graph.erase_node(outer)


def cast_first(graph: fx.Graph, cast: fx.Node, _) -> None:
    swap(graph, cast)  # the cast, then the split


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, cast_first, tidy=False)


RULE = Rule("cast_view", apply, "a dtype cast after a head split (view [..., H·D] -> "
                                "[..., H, D]) -> the cast, then the split")
