"""Small graph edits for the stages after `fuse`: insert a call with its `meta["val"]` computed on
the fake values of its inputs (the engine's invariant: every node has one), attributed to the
model module of a neighbour so per-layer tools and the contract count it where it belongs."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

# the ops that only reshape (a view of the same elements in the same order)
RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                      torch.ops.aten.reshape.default})


def fake_value(target, args: tuple, kwargs: dict | None = None,
               graph: fx.Graph | None = None) -> Any:
    """What `target` returns on the fake values of args, run under their fake mode; for a call
    with no tensor argument (an iota, a full) `graph`'s inputs' mode, so that the value mixes
    with the graph's others; a fresh mode where neither has one."""
    vals = fx.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    if target is operator.getitem:
        return vals[0][0][vals[0][1]]
    fake_mode = torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(vals))
    if fake_mode is None and graph is not None:
        fake_mode = torch._guards.detect_fake_mode(
            [n.meta.get("val") for n in graph.find_nodes(op="placeholder")])
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
    with fake_mode:
        return target(*vals[0], **vals[1])


def call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None,
         like: fx.Node | None = None) -> fx.Node:
    """graph.call_function at the current insertion point, with meta["val"] and, from `like`,
    the module stack."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta["val"] = fake_value(target, args, kwargs, graph)
    if like is not None and "nn_module_stack" in like.meta:
        node.meta["nn_module_stack"] = like.meta["nn_module_stack"]
    return node


def weight_root(node: Any) -> fx.Node | None:
    """The graph input a weight operand is a view of (through permute/view/slice/t), if any."""
    views = {"permute", "view", "slice", "t", "transpose", "expand", "_unsafe_view", "reshape",
             "alias", "unsqueeze", "squeeze"}
    while isinstance(node, fx.Node) and node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name not in views:
            return None
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


# views that take whole rows of a weight, in the order it stores them (narrow is a slice in ATen)
ROW_VIEWS = frozenset({
    torch.ops.aten.select.int, torch.ops.aten.slice.Tensor, torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
    torch.ops.aten.alias.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
    torch.ops.aten.squeeze.default, torch.ops.aten.unsqueeze.default,
    # several views, read by getitem: `q, k, v = w.unbind(0)` / `.split(W)` / `.chunk(3)`
    torch.ops.aten.unbind.int, torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
    operator.getitem})


def input_view(node: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """(graph input, [view, ...]) where node is a graph input (no views) or a chain of ROW_VIEWS
    of one whose other arguments are constants, e.g. `select(qkv_weight, 0, 1)`: the same chain
    replayed on the real input gives node's value. None otherwise."""
    chain = []
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target not in ROW_VIEWS or any(
                isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
            return None
        chain.insert(0, node)
        node = node.args[0]
    return (node, chain) if isinstance(node, fx.Node) and node.op == "placeholder" else None


def replay(chain: list[fx.Node], value: torch.Tensor) -> torch.Tensor:
    """The views of `input_view`'s chain applied to a real value of its input."""
    for node in chain:
        value = node.target(value, *node.args[1:], **node.kwargs)
    return value


def written_in_place(node: fx.Node) -> bool:
    """Some op of the graph writes `node` in place (a state buffer's write-back: copy_,
    index_put_), read off the users' schemas."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        for i, arg in enumerate(schema.arguments if schema is not None else ()):
            bound = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
            if bound is node and arg.alias_info is not None and arg.alias_info.is_write:
                return True
    return False


CHOOSERS = frozenset({torch.ops.aten.topk.default, torch.ops.aten.sort.default,
                      torch.ops.aten.sort.stable})


def feeds_top_k(node: fx.Node, depth: int) -> bool:
    """`node`'s value reaches a top-k or sort (a router's choice) through at most `depth` ops."""
    frontier = {node}
    for _ in range(depth):
        frontier = {u for n in frontier for u in n.users}
        if any(u.target in CHOOSERS for u in frontier):
            return True
    return False


def reads_state(node: fx.Node, boundaries: frozenset, limit: int = 4000) -> bool | None:
    """Whether `node` is computed from a state buffer (a graph input that some op writes in place:
    the KDA state, the MLA cache, so an attention's output), walking its inputs back to the
    nearest `boundaries` (op names, `str(target)`, that end a layer's part: the norm before the
    attention or the MLP): True if it reads one; False if it reaches a boundary without; None if neither (its
    inputs are plain graph inputs, or the walk passed `limit` nodes)."""
    seen, todo, bounded = {node}, [node], False
    while todo and len(seen) <= limit:
        n = todo.pop()
        if n.op == "placeholder":
            if written_in_place(n):
                return True
            continue
        if n is not node and str(n.target) in boundaries:
            bounded = True
            continue
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return False if bounded and not todo else None
