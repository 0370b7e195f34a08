"""Stage `streams`: the shared-expert branch of each MoE layer runs on a side stream, overlapped
with the routed path (vLLM does the same with an aux stream, spec §3.3 / §5.1).

    x ──► moe_front ─► route ─► experts ─► [all-reduce] ─► norm_linear ──┐
    │                                                                     add ─► delta
    └─► stream_fork ─► situ_gate_up ─► down GEMM ─► stream_join ─► [all-reduce] ─┘
                       (stream=1)      (stream=1)

The branch is everything the shared SiTU gate/up op starts that needs nothing from the main
stream but its input and that can run on a side stream: views (no kernel) and ops whose schema
takes `stream` (`k3.situ_gate_up`, `k3.linear`). Each of its ops carries its stream in the call
(`stream=1`): its CUDA implementation launches and allocates on that side stream
(`ops.side_streams`). So the graph alone says where every kernel runs, and both executors run the same thing: the aten
executor in graph order, Inductor in whatever order its wrapper picks. `meta["k3_stream"]` records
the same for the tools and `hazards`, which checks that the two agree.

Correct in every order, by data dependence only (an Inductor wrapper keeps producers before
consumers, nothing else):
- `k3.stream_fork` (main records an event, the side stream waits for it) returns aliases of x:
  the branch reads x only through it, so every branch launch comes after the fork. The main
  stream's readers of x read it through the fork too, so the fork comes before them (the side
  stream then waits for nothing of the routed path).
- `k3.stream_join` (the side stream records, main waits) takes every value the branch made, x's
  alias, and the main-stream activations its first consumer reads; its outputs replace the
  branch's outputs for the main stream. So it comes after every branch launch, and after the
  routed path (Inductor's `reorder_for_locality` would otherwise pull the routed path below it,
  making it wait for the branch), and the main stream reads nothing of the branch before it.
- Main-stream ops can land anywhere, between fork and join included: the side stream never reads
  what they make (it only waited at the fork), and they read the branch only after the join.

Memory, the caching allocator and Inductor's buffer reuse (which knows nothing of streams):
- x, read on the side stream: the join holds an alias of it (Inductor treats fork/join outputs as
  aliases), so neither the allocator nor Inductor's planner hands its block out before the main
  stream has waited for the branch.
- What the branch makes is allocated on the side stream. The join holds all of it, so Inductor
  reuses none of it for a main-stream buffer while the side stream may still touch it.
- After the join such a block may serve the main stream (a joined output, or a buffer Inductor
  put in it) up to a point the side stream knows nothing of, and a later side-stream allocation
  could take it back while the main stream still reads it (Inductor may launch main work between
  the next fork and a branch op). So the side-stream ops mark their outputs used by the caller's
  stream (`record_stream`, in `ops.side_streams.on_stream`): the allocator hands such a block out
  again only after the main stream has passed its free (within a CUDA-graph capture: not before the
  capture ends). Side-stream temporaries freed inside an op stay on the side stream: in order.

`hazards` checks the schedule: with the happens-before relation of stream order plus fork/join
events, no buffer may be read on one stream while another writes it without an event between;
collectives stay on the main stream; each node's stream argument equals its `k3_stream`.
"""

from __future__ import annotations

import dataclasses
import operator

import networkx as nx
import torch
from torch import fx

import k3compile.ops  # noqa: F401  (the k3 ops named below)
from k3compile.graph import call

SIDE = 1
_FORK, _JOIN = torch.ops.k3.stream_fork.default, torch.ops.k3.stream_join.default
_PREFETCH = torch.ops.k3.prefetch_l2.default
_SHARED = torch.ops.k3.situ_gate_up.default
_FRONTS = (torch.ops.k3.moe_front.default, torch.ops.k3.moe_front_route.default)
_VIEWS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "slice", "select",
          "expand", "unsqueeze", "squeeze", "alias", "as_strided", "detach", "getitem"}
# multi-output views: each output (a getitem) views the input, so gate|up weights chunked from one
# parameter (`w.chunk(2)`) are weights, free to read on the side stream
_SPLITS = {"split", "split_with_sizes", "unbind", "chunk"}


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
    return node.op == "call_function" and (_name(node) in _VIEWS | _SPLITS
                                           or node.target in (_FORK, _JOIN))


def takes_stream(node: fx.Node) -> bool:
    """An op that runs on the stream its `stream` argument names (a k3 op's CUDA path)."""
    schema = getattr(node.target, "_schema", None)
    return (node.op == "call_function" and schema is not None
            and any(a.name == "stream" and a.kwarg_only for a in schema.arguments))


def set_stream(node: fx.Node, stream: int) -> None:
    """Schedule node on `stream`: its call's stream argument (ops that take one) and its meta."""
    if takes_stream(node):
        node.kwargs = {**node.kwargs, "stream": stream}
    node.meta["k3_stream"] = stream


def written_inputs(graph: fx.Graph) -> set[fx.Node]:
    return {root(b) for n in graph.nodes if n.op == "call_function" for b in _writes(n)}


def _free(node, written) -> bool:
    """A weight: a view chain down to a graph input that nothing writes."""
    r = root(node)
    return isinstance(r, fx.Node) and r.op == "placeholder" and r not in written


def fork(graph: fx.Graph, x: fx.Node, stream: int, like: fx.Node,
         main_users: list[fx.Node]) -> fx.Node:
    """`k3.stream_fork([x], stream)` at the insertion point; returns x's alias for the side stream.
    `main_users` read x through the fork's other alias from then on, so in every order of the
    graph they come after the fork (and the side stream does not wait for them)."""
    node = call(graph, _FORK, ([x], stream), like=like)
    x_side = call(graph, operator.getitem, (node, 0), like=like)
    x_main = call(graph, operator.getitem, (node, 0), like=like)
    for user in main_users:
        user.replace_input_with(x, x_main)
    node.meta["k3_stream"] = x_main.meta["k3_stream"] = 0
    x_side.meta["k3_stream"] = stream
    return x_side


def join(graph: fx.Graph, values: list[fx.Node], stream: int, before: fx.Node,
         like: fx.Node) -> fx.Node:
    """`k3.stream_join` just before `before`, over the side stream's `values` and, to pin it
    after them in every order of the graph, the main-stream activations `before` reads."""
    pins = [a for a in before.all_input_nodes if a not in values and _activation(a)
            and a.meta.get("k3_stream", 0) == 0]
    with graph.inserting_before(before):
        node = call(graph, _JOIN, ([*values, *pins], stream), like=like)
    node.meta["k3_stream"] = 0
    return node


def _activation(node: fx.Node) -> bool:
    r = root(node)
    return (isinstance(node.meta.get("val"), torch.Tensor) and isinstance(r, fx.Node)
            and r.op != "placeholder")


# ---- the stage -----------------------------------------------------------------------------------

def schedule_shared_experts(graph: fx.Graph) -> list[Branch]:
    """Put every MoE layer's shared-expert branch on the side stream; returns the branches."""
    written = written_inputs(graph)
    branches = []
    # the values the routed paths start from; code that flattens the tokens once for the router
    # and again for the shared experts (Moonshot: `view(-1, D)`, and `nn.Linear` on [B, T, D])
    # reads two views of one value
    routed = {_unviewed(n.args[0]) for n in graph.nodes if n.target in _FRONTS}
    for seed in [n for n in graph.nodes if n.target is _SHARED]:
        x = seed.args[0]
        if _unviewed(x) not in routed:
            continue  # the dense layer-0 MLP: no routed path to overlap with
        _merge_same_views(x)  # so the router reads x through the fork too
        x = seed.args[0]
        branches.append(_split_off(graph, seed, written))
    for node in graph.nodes:
        node.meta.setdefault("k3_stream", 0)
    return branches


def _unviewed(node):
    """The value node is a view (chain) of: through views, not through a multi-output op's
    getitem (two outputs of one op are two values)."""
    while (isinstance(node, fx.Node) and node.op == "call_function" and _is_view(node)
           and node.target is not operator.getitem):
        node = node.args[0]
    return node


def _merge_same_views(x: fx.Node) -> None:
    """The views of x's input that are x's own (the same op, input and sizes) become one node,
    the first in graph order, so every reader (the router too) reads it through the fork."""
    if not (x.op == "call_function" and _is_view(x) and x.target is not operator.getitem):
        return
    same = [v for v in x.args[0].users
            if v.target is x.target and v.args == x.args and v.kwargs == x.kwargs]
    first = min(same, key=_position(x.graph))
    for view in same:
        if view is not first:
            view.replace_all_uses_with(first)


def _grow(seed: fx.Node, written) -> list[fx.Node]:
    """seed and every view or stream-taking op after it that reads only the branch and weights
    (a collective or any other op stays on the main stream, after the join)."""
    branch = {seed}
    for node in seed.graph.nodes:  # graph order: a node's inputs are decided before it
        if node in branch or not (_is_view(node) or takes_stream(node)) or is_collective(node):
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
    with graph.inserting_before(x.next):
        x_side = fork(graph, x, SIDE, seed, [u for u in x.users if u not in nodes])
    anchor = x_side.next  # x_main
    for node in [*dict.fromkeys(weights), *nodes]:
        anchor.append(node)
        anchor = node
    for node in nodes:
        node.replace_input_with(x, x_side)
    for node in [*weights, *nodes]:
        set_stream(node, SIDE)
    _check_inputs(nodes, x_side, written)
    # the join just before the first main-stream consumer of anything the branch made; it holds
    # all the branch made and x_side: none of it may be reused before the main stream waited
    outs = [n for n in nodes if any(u not in nodes for u in n.users)]
    made = [n for n in nodes if not _is_view(n) and n not in outs]
    consumers = [u for n in outs for u in n.users if u not in nodes]
    first = min(consumers, key=_position(graph))
    node = join(graph, [*outs, *made, x_side], SIDE, first, like=outs[-1])
    with graph.inserting_before(first):
        joined = [call(graph, operator.getitem, (node, i), like=outs[-1])
                  for i in range(len(outs))]
    for out, new in zip(outs, joined):
        for user in [u for u in out.users if u not in nodes and u is not node]:
            user.replace_input_with(out, new)
    for n in joined:
        n.meta["k3_stream"] = 0
    return Branch(x_side.args[0], node, nodes)


def _check_inputs(nodes: list[fx.Node], x_side: fx.Node, written) -> None:
    """The side stream waited only at the fork: a branch op may read the forked x, the branch's
    own values and weights, nothing else the main stream makes."""
    inside = set(nodes)
    for n in nodes:
        for i in n.all_input_nodes:
            if not (i in inside or i is x_side or _free(i, written)):
                raise AssertionError(f"streams: {n.name} on stream {SIDE} reads {i.name}, which "
                                     f"does not come through the fork")
        if not (_is_view(n) or takes_stream(n)):
            raise AssertionError(f"streams: {n.name} has no stream argument")


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


# ---- the hazard check ----------------------------------------------------------------------------

def root(node):
    """The buffer a value lives in: through views and fork/join/prefetch aliases to the node that
    made it (for one output of a multi-output op, that op)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is operator.getitem:
            src = node.args[0]
            if src.target is _PREFETCH:
                node = src.kwargs["after"][node.args[1]]
            elif src.target in (_FORK, _JOIN):
                node = src.args[0][node.args[1]]
            elif _name(src) in _SPLITS:  # a piece of a split views the split's input
                node = src.args[0]
            else:
                return src
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
    order and events orders, every collective off the main stream, and every node whose stream
    argument is not its `k3_stream` (what runs is the argument; what was checked, the meta)."""
    problems = [f"{n.name}: collective on stream {n.meta['k3_stream']}" for n in graph.nodes
                if is_collective(n) and n.meta.get("k3_stream", 0) != 0]
    problems += _disagreements(graph)
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


def _disagreements(graph: fx.Graph) -> list[str]:
    out = []
    for n in graph.nodes:
        meta = n.meta.get("k3_stream", 0)
        if takes_stream(n) and n.kwargs.get("stream", 0) != meta:
            out.append(f"{n.name}: scheduled on stream {meta}, runs on stream "
                       f"{n.kwargs.get('stream', 0)} (its stream argument)")
        elif (meta and n.op == "call_function" and not takes_stream(n) and not _is_view(n)
              and not is_collective(n)):
            out.append(f"{n.name}: scheduled on stream {meta}, but has no stream argument: "
                       "runs on the main stream")
    return out


def streams(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage (on with `Options.side_streams`): each MoE layer's shared experts on stream 1."""
    ctx.notes["streams"] = schedule_shared_experts(gm.graph)
    gm.recompile()
    return gm
