"""Rule `view_add`: two GEMM outputs viewed the same way, then added -> added, then viewed:
`a.view(S) + b.view(S)` with a, b [N, D] `mm` outputs -> `(a + b).view(S)`.

LatentMoE's last step adds the shared experts to the routed output. K3 (and our model) add the
two [N, D] results and view the sum back to the input's shape; Moonshot's `KimiSparseMoeBlock`
views the routed output back first (`y.view(*orig_shape)`) and adds the shared experts computed
on the [B, T, D] input (`nn.Linear` on 3-D: a view, `mm`, a view back). The canonical form is the
first, which pattern `norm_linear_residual` folds into the up-projection's epilogue (and stage
`streams` then puts the shared experts on the side stream).

Exact: the same elements are added. Taken: an `add.Tensor` without alpha whose two operands are
views (`view` / `_unsafe_view` / `reshape`) to one shape of two `mm` outputs of one shape and
dtype, neither computed from the other: two parallel branches, as the routed and the shared
experts are. Left alone: a residual sum of two sublayers' GEMMs (the second sublayer reads the
first one's output: the patterns of the mixes after o_proj read that sum as it is), other sources
(a view of an activation plus another is how residuals are written), sources of different shapes
or dtypes (broadcast or promotion), views to different shapes.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import val
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten


def _source(view) -> fx.Node | None:
    """The `mm` that `view` re-shapes, or None."""
    if not (isinstance(view, fx.Node) and view.op == "call_function" and view.target in RESHAPES):
        return None
    src = view.args[0]
    return src if isinstance(src, fx.Node) and src.target is aten.mm.default else None


def _site(add: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(a, b, the first view) where `add` adds two same views of same-shaped mm outputs."""
    if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    views, sources = add.args, [_source(v) for v in add.args]
    if None in sources:
        return None
    (va, vb), (a, b) = [val(v) for v in views], [val(s) for s in sources]
    if None in (va, vb, a, b) or va.shape != vb.shape:
        return None
    if a.shape != b.shape or a.dtype != b.dtype:
        return None
    if _reads(sources[0], sources[1]) or _reads(sources[1], sources[0]):
        return None
    return sources[0], sources[1], views[0]


def _reads(node: fx.Node, other: fx.Node) -> bool:
    """Whether `node` is computed from `other` (other is among its ancestors)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for i in n.all_input_nodes:
            if i is other:
                return True
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return False


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    a, b, view = site
    with graph.inserting_before(node):
        total = call(graph, aten.add.Tensor, (a, b), like=node)
        # the view's own size argument: symbolic sizes stay the graph's nodes
        new = call(graph, aten.view.default, (total, view.args[1]), like=node)
    node.replace_all_uses_with(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.add.Tensor})


RULE = Rule("view_add", apply, "a.view(S) + b.view(S) (a, b mm outputs) -> (a + b).view(S)")

__all__ = ["RULE", "apply"]
