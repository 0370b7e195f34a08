"""Stage `streams`: the shared-expert branch of each MoE layer runs on a side stream, overlapped
with the routed path (vLLM does the same with an aux stream, spec §3.3 / §5.1).

    x ──► moe_front ─► route ─► experts ─► [all-reduce] ─► norm_linear ──┐
    │                                                                     add ─► delta
    └─► stream_fork ─► situ_gate_up ─► down GEMM ─► stream_join ─► [all-reduce] ─┘
                       (side stream 1)

The branch is everything the shared SiTU gate/up op starts that needs nothing from the main
stream but its input: it is moved up to right after its input is made (so the side stream starts
as early as possible), opened by `k3.stream_fork` and closed by `k3.stream_join` placed just
before the first main-stream consumer (so the main stream waits as late as possible).
Collectives always stay on the main stream. Every node's stream is recorded in
`meta["k3_stream"]` (0 = main), which the tools show and the executor honours (`runner`).

`hazards` checks the schedule: with the happens-before relation of stream order plus fork/join
events, no buffer may be read on one stream while another writes it without an event between.
"""

from __future__ import annotations

import dataclasses
import operator

import networkx as nx
import torch
from torch import fx

import k3compile.ops  # noqa: F401  (the k3 ops named below)
from k3compile.graph_edit import call

SIDE = 1
_FORK, _JOIN = torch.ops.k3.stream_fork.default, torch.ops.k3.stream_join.default
_SHARED, _FRONT = torch.ops.k3.situ_gate_up.default, torch.ops.k3.moe_front.default
_VIEWS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "slice", "select",
          "expand", "unsqueeze", "squeeze", "alias", "as_strided", "detach", "getitem"}


@dataclasses.dataclass
class Branch:
    fork: fx.Node
    join: fx.Node
    nodes: list[fx.Node]  # the side-stream compute nodes, in order


def _name(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", str(t)).split(".")[0]


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("_c10d_functional.")


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and (_name(node) in _VIEWS or node.target in (_FORK, _JOIN))


def written_inputs(graph: fx.Graph) -> set[fx.Node]:
    return {root(b) for n in graph.nodes if n.op == "call_function" for b in _writes(n)}


def _free(node, written) -> bool:
    """A weight: a view chain down to a graph input that nothing writes."""
    r = root(node)
    return isinstance(r, fx.Node) and r.op == "placeholder" and r not in written


# ---- the stage -----------------------------------------------------------------------------------

def schedule_shared_experts(graph: fx.Graph) -> list[Branch]:
    """Put every MoE layer's shared-expert branch on the side stream; returns the branches."""
    written = written_inputs(graph)
    branches = []
    for seed in [n for n in graph.nodes if n.target is _SHARED]:
        x = seed.args[0]
        if not any(u.target is _FRONT for u in x.users):
            continue  # the dense layer-0 MLP: no routed path to overlap with
        branches.append(_split_off(graph, seed, written))
    for node in graph.nodes:
        node.meta.setdefault("k3_stream", 0)
    return branches


def _grow(seed: fx.Node, written) -> list[fx.Node]:
    """seed and every node after it that reads only the branch and weights (no collectives)."""
    branch = {seed}
    for node in seed.graph.nodes:  # graph order: a node's inputs are decided before it
        if node in branch or node.op != "call_function" or is_collective(node):
            continue
        inputs = node.all_input_nodes
        if any(i in branch for i in inputs) and all(i in branch or _free(i, written)
                                                    for i in inputs):
            branch.add(node)
    return [n for n in seed.graph.nodes if n in branch]


def _split_off(graph: fx.Graph, seed: fx.Node, written) -> Branch:
    nodes = _grow(seed, written)
    x = seed.args[0]
    weights = [v for n in nodes for i in n.all_input_nodes if i not in nodes and i is not x
               for v in view_chain(i)]
    # the fork right after x, then the branch (and the weight views it reads) right after it
    with graph.inserting_after(x):
        fork = call(graph, _FORK, ([x], SIDE), like=seed)
    with graph.inserting_after(fork):
        x_side = call(graph, operator.getitem, (fork, 0), like=seed)
    anchor = x_side
    for node in [*dict.fromkeys(weights), *nodes]:
        anchor.append(node)
        anchor = node
    for node in nodes:
        node.replace_input_with(x, x_side)
    for node in [x_side, *weights, *nodes]:
        node.meta["k3_stream"] = SIDE
    fork.meta["k3_stream"] = 0
    # the join just before the first main-stream consumer of anything the branch made
    outs = [n for n in nodes if any(u not in nodes for u in n.users)]
    consumers = [u for n in outs for u in n.users if u not in nodes]
    first = min(consumers, key=_position(graph))
    with graph.inserting_before(first):  # x_side too: it must live until the main stream waited
        join = call(graph, _JOIN, ([*outs, x_side], SIDE), like=outs[-1])
        joined = [call(graph, operator.getitem, (join, i), like=outs[-1])
                  for i in range(len(outs))]
    for out, new in zip(outs, joined):
        for user in [u for u in out.users if u not in nodes and u is not join]:
            user.replace_input_with(out, new)
    for n in (join, *joined):
        n.meta["k3_stream"] = 0
    return Branch(fork, join, nodes)


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


# ---- the hazard check ----------------------------------------------------------------------------

def root(node):
    """The buffer a value lives in: through views and fork/join aliases to the node that made it
    (for one output of a multi-output op, that op)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is operator.getitem:
            src = node.args[0]
            if src.target not in (_FORK, _JOIN):
                return src
            node = src.args[0][node.args[1]]
        elif _is_view(node):
            node = node.args[0]
        else:
            break
    return node


def view_chain(node) -> list[fx.Node]:
    """The view nodes between node and the graph input it views, outermost last."""
    chain = []
    while node.op == "call_function" and _is_view(node):
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def _writes(node: fx.Node) -> list:
    """The arguments a call writes to in place, by its schema (`Tensor(a!)`)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            val = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            out += val if isinstance(val, (list, tuple)) else [val]
    return [v for v in out if isinstance(v, fx.Node)]


def happens_before(graph: fx.Graph) -> nx.DiGraph:
    """Edges a -> b where b cannot start before a finishes: stream order, fork and join events."""
    hb, last, pending_fork = nx.DiGraph(), {}, {}
    for node in graph.nodes:
        if node.op != "call_function" or (_is_view(node) and node.target not in (_FORK, _JOIN)):
            continue
        stream = node.meta.get("k3_stream", 0)
        hb.add_node(node)
        if stream in last:
            hb.add_edge(last[stream], node)
        if stream in pending_fork:
            hb.add_edge(pending_fork.pop(stream), node)
        if node.target is _FORK:
            pending_fork[node.args[1]] = node
        elif node.target is _JOIN and node.args[1] in last:
            hb.add_edge(last[node.args[1]], node)
        last[stream] = node
    return hb


def hazards(graph: fx.Graph) -> list[str]:
    """Every cross-stream access pair to one buffer (one of them a write) that no chain of stream
    order and events orders, and every collective off the main stream."""
    problems = [f"{n.name}: collective on stream {n.meta['k3_stream']}" for n in graph.nodes
                if is_collective(n) and n.meta.get("k3_stream", 0) != 0]
    hb = happens_before(graph)
    accesses: dict[fx.Node, list[tuple[fx.Node, bool]]] = {}
    for node in hb.nodes:
        if node.target in (_FORK, _JOIN):
            continue
        written = {root(w) for w in _writes(node)}
        for arg in node.all_input_nodes:
            r = root(arg)
            if r not in written:
                accesses.setdefault(r, []).append((node, False))
        for r in written | {node}:
            accesses.setdefault(r, []).append((node, True))
    order = {n: i for i, n in enumerate(graph.nodes)}
    reach: dict[fx.Node, set] = {}
    for buf, acc in accesses.items():
        acc.sort(key=lambda a: order[a[0]])
        for i, (a, a_writes) in enumerate(acc):
            for b, b_writes in acc[i + 1:]:
                if a is b or not (a_writes or b_writes):
                    continue
                if a.meta.get("k3_stream", 0) == b.meta.get("k3_stream", 0):
                    continue
                if b not in reach.setdefault(a, nx.descendants(hb, a)):
                    what = "written" if a_writes else "read"
                    problems.append(
                        f"{buf.name}: {what} by {a.name} (stream {a.meta.get('k3_stream', 0)}), "
                        f"{'written' if b_writes else 'read'} by {b.name} "
                        f"(stream {b.meta.get('k3_stream', 0)}) with no event between")
    return problems


# ---- the executor --------------------------------------------------------------------------------

class _StreamInterpreter(fx.Interpreter):
    def run_node(self, n: fx.Node):
        stream = n.meta.get("k3_stream", 0)
        if stream and n.op == "call_function":
            from k3compile.ops.sched import side_stream

            with torch.cuda.stream(side_stream(torch.device("cuda"), stream)):
                return super().run_node(n)
        return super().run_node(n)


def runner(gm: fx.GraphModule):
    """The graph's callable: its own forward, or on CUDA with side-stream nodes an interpreter
    that launches each node on its stream (CUDA graphs then replay it without the Python)."""
    on_cuda = any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_cuda
                  for n in gm.graph.nodes if n.op == "placeholder")
    if not on_cuda or not any(n.meta.get("k3_stream", 0) for n in gm.graph.nodes):
        return gm.forward
    interpreter = _StreamInterpreter(gm)
    return lambda *args: interpreter.run(*args)
