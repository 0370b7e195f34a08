"""Reading a compiled graph layer by layer: which nodes belong to which layer (the first
`<container>.<int>` of the module path, `k3compile.layers`),
which of them launch a kernel (`KERNEL_RULE`), each layer's kernel graph and its
Weisfeiler-Lehman hash (what groups layers into templates), side streams and prefetch points,
and the before/after drawing of a layer."""

from __future__ import annotations

import collections
import re
import warnings
from collections import Counter

import networkx as nx
import torch
from torch import fx

from k3compile import layers
from k3compile.rewrite import module_path
from k3compile.rewrite.near_miss import op_label, value_type
from k3compile.tools.diff.report import DrawNode, PrefetchPoint

KERNEL_RULE = ("kernels: one per call of an ATen/prims/k3/collective op other than views and "
               "metadata (view, reshape, permute, expand, slice, select, split, [un]squeeze, "
               "transpose, alias, detach, empty) and stream events (wait_tensor, stream_fork, "
               "stream_join); Python operators (getitem, SymInt math) launch nothing. An upper "
               "bound (Inductor fuses pointwise chains): read the change, not the level.")

_NO_LAUNCH = frozenset({
    "view", "reshape", "_unsafe_view", "permute", "unsqueeze", "squeeze", "expand", "slice",
    "select", "split", "split_with_sizes", "unbind", "t", "transpose", "alias", "detach",
    "as_strided", "empty", "empty_like", "empty_strided", "sym_size", "sym_stride", "sym_numel",
    "wait_tensor", "stream_fork", "stream_join", "expert_stack"})  # events; a packed stack view
_SYNC = re.compile(r"fork|join|event|stream")
# the pseudo-layer of the nodes outside every layer (embedding, lm_head, state copies); the
# contract's FINAL
OUTSIDE = layers.FINAL


def launches(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname not in _NO_LAUNCH
    return isinstance(t, torch._ops.HigherOrderOperator)


def layer_index(path: str) -> int:
    index = layers.layer_index(path)
    # the final depth mix + norm too: the model's, not a layer's (contract.FINAL)
    return OUTSIDE if index is None else index


def suffix(module: str) -> str:
    """The module path below the layer (`self_attn.q_proj`; `(layer)`: the layer's own code)."""
    below = layers.below_layer(module)
    return (below or "(layer)") if below is not None else module or "(top)"


def split_layers(graph: fx.Graph) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = collections.defaultdict(list)
    for n in graph.nodes:
        if n.op == "call_function":
            out[layer_index(module_path(n))].append(n)
    return out


def kernel_graph(nodes: list[fx.Node]) -> nx.DiGraph:
    """The launches of one layer, edges followed through the views between them."""
    inside, memo = set(nodes), {}
    graph = nx.DiGraph()

    def sources(a: fx.Node) -> list[fx.Node]:
        if a not in memo:
            memo[a] = ([] if a not in inside else [a] if launches(a) else
                       [s for b in a.all_input_nodes for s in sources(b)])
        return memo[a]

    for n in nodes:
        if launches(n):
            graph.add_node(n.name, label=op_label(n))
            for a in n.all_input_nodes:
                for s in sources(a):
                    graph.add_edge(s.name, n.name)
    return graph


def wl_hash(nodes: list[fx.Node]) -> str:
    graph = kernel_graph(nodes)
    with warnings.catch_warnings():  # networkx >= 3.5 notes that its directed hashes changed
        warnings.simplefilter("ignore", UserWarning)
        return nx.weisfeiler_lehman_graph_hash(graph, node_attr="label", iterations=3)[:8]


def input_names(compiled, graph: fx.Graph) -> dict[str, str]:
    """ATen placeholder -> the parameter or buffer it is (`layers.1.mlp.experts.w1_packed`):
    the ATen graph takes the Dynamo graph's inputs in order, but for the expert stacks stage
    `stack_inputs` made one input each (`meta["k3_parts"]`: the parts' positions; named by the
    first part's name and the count)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    stacked = {i for n in placeholders for i in n.meta.get("k3_parts", ())}
    dotted = [layers.input_path(inp.name) for inp in compiled.inputs]
    kept = iter(i for i in range(len(dotted)) if i not in stacked)
    out = {}
    for n in placeholders:
        if parts := n.meta.get("k3_parts"):
            out[n.name] = f"{dotted[parts[0]]} (stack of {len(parts)})"
        elif (i := next(kept, None)) is not None:
            out[n.name] = dotted[i]
    if next(kept, None) is not None or len(out) < len(placeholders):
        return {}
    return out


def stream_info(nodes: list[fx.Node], inputs: dict[str, str]) -> tuple[Counter, list, list]:
    """Side-stream ops (meta['k3_stream']), stream fork/join/event ops, prefetch points."""
    streams, sync, prefetch = Counter(), [], []
    for n in nodes:
        label = op_label(n)
        stream = n.meta.get("k3_stream")
        if stream not in (None, 0, "main", "default"):
            streams[(str(stream), label)] += 1
        if "prefetch" in label:
            meta = n.meta.get("k3_prefetch") or {}
            names = meta.get("weights") or [a.name for a in n.all_input_nodes]
            prefetch.append(PrefetchPoint(label, module_path(n) or "?",
                                          [inputs.get(w, w) for w in names], meta.get("bytes"),
                                          meta.get("before", ""), meta.get("stream", 0)))
        elif _SYNC.search(label) and label != "wait_tensor":
            sync.append(f"{label} @ {module_path(n) or '?'}")
    return streams, sync, prefetch


def drawing(before: list[fx.Node], after: list[fx.Node]) -> tuple[list[DrawNode], list[DrawNode]]:
    """The layer's kernel graphs, before and after; nodes the pipeline removed or added marked
    (rewrites edit the graph in place, so a node keeps its name across the stages)."""

    def draw(nodes, other, gone):
        names, graph = {n.name for n in other}, kernel_graph(nodes)
        return [DrawNode(n.name, op_label(n), tuple(graph.predecessors(n.name)), value_type(n),
                         "kept" if n.name in names else gone)
                for n in nodes if launches(n)]

    return draw(before, after, "removed"), draw(after, before, "new")
