"""Rule `bias_view`: a per-channel bias added before the channels are split into heads ->
added after, on the bias viewed the same way: `(x + b).view(..., H, K)` with b [H·K] ->
`x.view(..., H, K) + b.view(H, K)`, the order `k3compile.math` writes (KDA's decay: `graw +
dt_bias` per head).

Exact: the same elements are added. Only a view that splits the last dim alone and an add whose
only user is that view, with one operand a 1-D [H·K] tensor (or its exact fp32 cast) and the
other the [..., H·K] activation. Left alone: a bias of another shape (broadcast over other dims),
a view that also merges or splits leading dims, an add read elsewhere too.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape
from k3compile.graph import call

aten = torch.ops.aten


def _site(view: fx.Node):
    add = view.args[0]
    if not (isinstance(add, fx.Node) and add.target is aten.add.Tensor and len(add.users) == 1
            and len(add.args) == 2 and not add.kwargs):
        return None
    out, src = shape(view), shape(add)
    if out is None or src is None or len(out) != len(src) + 1 or out[:-2] != src[:-1]:
        return None
    for x, b in (add.args, add.args[::-1]):
        if (isinstance(x, fx.Node) and isinstance(b, fx.Node) and shape(x) == src
                and shape(b) == (src[-1],)):
            return add, x, b
    return None


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    add, x, b = site
    out = list(shape(node))
    with graph.inserting_before(node):
        xv = call(graph, aten.view.default, (x, out), like=node)
        bv = call(graph, aten.view.default, (b, out[-2:]), like=node)
        new = call(graph, aten.add.Tensor, (xv, bv), like=add)
    node.replace_all_uses_with(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.view.default})


RULE = Rule("bias_view", apply, "(x + b[H*K]).view(..., H, K) -> x.view(..., H, K) + b.view(H, K)")

__all__ = ["RULE", "apply"]
