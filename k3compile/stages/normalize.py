"""Stage `normalize`: the graph as the patterns expect to find it: dead code gone, and
`add.Scalar(x, c)` (F.rms_norm's decomposition adds its eps so) as `add.Tensor(x, c)`, the form
`h + eps` traces to and the patterns search for. Runtime asserts that the bucket's concrete sizes
already decided (`_assert_scalar(True, ...)`, left by an unbacked batch symbol) go too; a runtime
check on values (`_assert_async`, e.g. F.one_hot's index range) stays, with the None it returns
as its `meta["val"]` (AOT leaves it without one)."""

from __future__ import annotations

import torch
from torch import fx


def normalize(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    drop_decided_asserts(gm.graph)
    value_asserts_return_none(gm.graph)
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


def drop_decided_asserts(graph: fx.Graph) -> None:
    """`_assert_scalar(True, msg)`: a size check (e.g. `u0 >= 0` on an unbacked batch) that the
    bucket's concrete batch already proved; it computes nothing and has no value to propagate."""
    for node in list(graph.nodes):
        if node.target is torch.ops.aten._assert_scalar.default and node.args[0] is True:
            graph.erase_node(node)


def value_asserts_return_none(graph: fx.Graph) -> None:
    """`_assert_async(cond, msg)` checks a value at run time (eager raises on the same input);
    it returns None, the `meta["val"]` every call must carry."""
    for node in graph.nodes:
        if node.target in (torch.ops.aten._assert_async.msg, torch.ops.aten._assert_async.default):
            node.meta.setdefault("val", None)
