"""Stage `normalize`: the graph as the patterns expect to find it: dead code gone, and
`add.Scalar(x, c)` (F.rms_norm's decomposition adds its eps so) as `add.Tensor(x, c)`, the form
`h + eps` traces to and the patterns search for."""

from __future__ import annotations

import torch
from torch import fx


def normalize(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    scalar_adds_as_tensor_adds(gm.graph)
    gm.recompile()
    return gm


def scalar_adds_as_tensor_adds(graph: fx.Graph) -> None:
    """`add.Scalar(x, c)` as `add.Tensor(x, c)` for a float constant c (the same op)."""
    for node in graph.nodes:
        if (node.target is torch.ops.aten.add.Scalar and len(node.args) == 2 and not node.kwargs
                and isinstance(node.args[1], float)):
            node.target = torch.ops.aten.add.Tensor
