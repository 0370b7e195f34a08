"""Rule `layer_positions`: the verify rows' positions computed once for every layer -> one copy
per layer that reads them.

A decode step whose model computes each request's T positions once, at the top, and passes them
to every layer (gpt-fast's `input_pos`, spell14: `positions[:, None] + arange(T)`) has one index
node read by every MLA layer's cache write and mask; `k3compile/math.py` computes them in each
layer, and the mla_decode pattern absorbs them as an intermediate of its own (two users: the
write and the mask), so a node also read by another layer is an escape it refuses:
    p = view(positions, [B, 1]) + iota(T);  layer 2 reads p;  layer 3 reads p          (spell14)
    p2 = view(positions, [B, 1]) + iota(T) in layer 2;  p3 = the same in layer 3        (canonical)
Exact: the copies compute the same integers from the same input.

Taken: an integer `add` of a [B, 1] view / unsqueeze of a graph input and an `iota` (or `arange`)
of T (either operand order), read from two or more layers (module paths `<container>.<int>`); each
layer but the first gets its own copy of the three nodes, placed before its first reader. Left
alone: positions read by one layer, reads outside every layer (they keep the original), other
index arithmetic.
"""

from __future__ import annotations

import collections

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import val as _val
from k3compile.layers import layer_index
from k3compile.rewrite.near_miss import module_path

aten = torch.ops.aten
VIEWS = {aten.view.default, aten.reshape.default, aten.unsqueeze.default}
RANGES = {torch.ops.prims.iota.default, aten.arange.default, aten.arange.start}


def _column(node) -> bool:
    """node is a [B, 1] view of a graph input."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEWS):
        return False
    val = _val(node)
    return (isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
            and val is not None and val.dim() == 2 and val.shape[1] == 1)


def _steps(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in RANGES
            and not node.all_input_nodes)


def _readers_by_layer(node: fx.Node) -> dict[int, list[fx.Node]]:
    out = collections.defaultdict(list)
    for user in node.users:
        layer = layer_index(module_path(user))
        if layer is not None:
            out[layer].append(user)
    return out


def _site(node: fx.Node):
    if not (node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2):
        return None
    val = _val(node)
    if val is None or val.dtype.is_floating_point or val.dtype == torch.bool:
        return None
    a, b = node.args
    if not ((_column(a) and _steps(b)) or (_column(b) and _steps(a))):
        return None
    readers = _readers_by_layer(node)
    return readers if len(readers) > 1 else None


def copy_per_layer(graph: fx.Graph, add: fx.Node, readers: dict[int, list[fx.Node]]) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    for layer in sorted(readers)[1:]:
        users = readers[layer]
        first = min(users, key=order.__getitem__)
        copies: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(first):
            for n in (*add.all_input_nodes, add):
                if n.op == "placeholder":
                    continue
                copies[n] = graph.node_copy(n, lambda a, c=copies: c.get(a, a))
                copies[n].meta["nn_module_stack"] = first.meta.get("nn_module_stack", {})
        for user in users:
            user.replace_input_with(add, copies[add])


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, copy_per_layer, tidy=False)


RULE = Rule("layer_positions", apply, "positions + arange(T) read by several layers -> one copy "
                                      "per layer")
