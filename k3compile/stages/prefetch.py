"""Stage `prefetch`: where the main stream only waits, read ahead the weights of the GEMMs that
come next, so that they come from L2 instead of HBM when those GEMMs run.

The main stream waits on a collective (`wait_tensor` of an all-reduce or all-gather, which runs
on the communication stream) and on the side stream (`k3.stream_join`). A `k3.prefetch_l2` goes
just before each such wait, so its read overlaps what is being waited for:

    r = all_reduce(partial) ; k3.prefetch_l2([W_up[r], W_q|k|v, ...], nbytes) ; wait_tensor(r)

At world size > 1 the fuse stage folds the attention output's all-reduce and its wait into a k3
op (`k3.allreduce_attn_res_mix_norm`) whose collective runs on the main stream: no wait is left,
and a prefetch queued before that op on the main stream would only delay the collective. So
there the prefetch runs on its own side stream, forked on the op's input and joined at the end
of the span it covers (the next anchor, or the graph output: a CUDA-graph capture must see the
side stream rejoined):

    p = fork([partial], 2)[0] ; allreduce_attn_res_mix_norm(p, ..)
    ; q = prefetch_l2([W_a, W_b, ...], nbytes, stream=2, after=[p])[0] ; the GEMMs ...
    ; join([q, <the span end's inputs>], 2) ; the span's end

The prefetch carries its stream in the call (`stream=2`), so both executors run it there. Its
place holds in every order Inductor's wrapper may pick, by data dependence alone: it reads the
fork's alias (`after`: launched after the fork), the join reads its output (the join after it),
the op reads its input through the fork (the fork before the op: stream 2 does not wait for the
collective), and the join takes the main-stream activations the span's end reads (the join not
before the GEMMs it is meant to leave alone). In graph order the prefetch comes after the op, so
that under the aten executor the collective is launched first; on stream 2 it waits only for the
fork, and in a CUDA graph only the dependencies count. (A main-stream prefetch before a wait has
no such anchor: Inductor may launch it earlier than the wait; it only reads weights.)

Stream 2, not the shared experts' 1: on one stream the prefetch would queue behind a shared-expert
branch still running, and its join would make the main stream wait for that branch early.

Each prefetch names, in graph order, the weights (graph inputs nothing writes, ≥ 2-D, floating
point) of the GEMMs and fused ops after its anchor, up to the next anchor, within a byte budget: a
share of the L2 (`Options.l2_bytes`; the rest keeps the activations and what the GEMMs stream
through). Routed experts are not named: which of them run is decided by the routing at run time.
What each prefetch covers is recorded in `meta["k3_prefetch"]`.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

import k3compile.ops  # noqa: F401  (the k3 ops named below)
from k3compile.graph import call
from k3compile.stages.streams import (
    fork,
    is_collective,
    join,
    root,
    set_stream,
    view_chain,
    written_inputs,
)

H200_L2_BYTES = 60 * 2**20
SHARE = 0.5  # of the L2 one prefetch may fill
SIDE = 2  # the stream of the prefetches that overlap a fused collective
_PREFETCH = torch.ops.k3.prefetch_l2.default
_JOIN = torch.ops.k3.stream_join.default
_NOT_GEMMS = {"moe_route", "moe_experts", "stream_fork", "stream_join", "prefetch_l2"}
_TRANSPOSES = {"permute", "t", "transpose"}


@dataclasses.dataclass
class Prefetch:
    node: fx.Node
    before: str  # the wait or fused collective it overlaps
    weights: list[str]  # graph inputs read ahead
    nbytes: int
    gemms: list[str]  # the nodes that will read them
    stream: int = 0


def l2_bytes(option: int | None, graph: fx.Graph) -> int:
    """The L2 size: the option, else the GPU's, else an H200's (CPU compiles)."""
    if option:
        return option
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    device = next((v.device for v in vals if isinstance(v, torch.Tensor) and v.is_cuda), None)
    if device is not None:
        return torch.cuda.get_device_properties(device).L2_cache_size
    return H200_L2_BYTES


def is_wait(node: fx.Node, joins: bool = True) -> bool:
    if node.target is _JOIN:
        return joins
    return (node.target is torch.ops._c10d_functional.wait_tensor.default
            and is_collective(node.args[0]))


def is_fused_collective(node: fx.Node) -> bool:
    """A k3 op with a collective inside: its schema takes the process group's name."""
    schema = getattr(node.target, "_schema", None)
    return (node.op == "call_function" and schema is not None and schema.name.startswith("k3::")
            and any(a.name == "group_name" for a in schema.arguments))


def _ends_span(node: fx.Node) -> bool:
    return node.op == "output" or is_wait(node) or is_fused_collective(node)


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _is_gemm(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    name = _name(node)
    if str(node.target).startswith("k3."):
        return name not in _NOT_GEMMS
    return name in ("mm", "bmm", "addmm", "baddbmm")


def _weight(arg, written) -> fx.Node | None:
    """The contiguous node a weight operand reads (a graph input or its row slice), if any."""
    if not isinstance(arg, fx.Node):
        return None
    r = root(arg)
    if r.op != "placeholder" or r in written:
        return None
    val = r.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or not val.is_floating_point():
        return None
    while arg.op == "call_function" and _name(arg) in _TRANSPOSES | {"view", "_unsafe_view"}:
        arg = arg.args[0]
    return arg


def _weights_after(anchor: fx.Node, written, budget: int):
    """(weight nodes, their bytes, the GEMMs reading them) after `anchor`, up to the next one."""
    picked, sizes, gemms = [], [], []
    node = anchor.next
    while not _ends_span(node) and sum(sizes) < budget:
        if _is_gemm(node):
            for arg in node.all_input_nodes:
                w = _weight(arg, written)
                if w is not None and w not in picked:
                    val = w.meta["val"]
                    picked.append(w)
                    sizes.append(val.numel() * val.element_size())
                    gemms.append(node.name)
        node = node.next
    return picked, sizes, list(dict.fromkeys(gemms))


def _span_end(anchor: fx.Node) -> fx.Node:
    node = anchor.next
    while not _ends_span(node):
        node = node.next
    return node


def _before_wait(graph: fx.Graph, wait: fx.Node, weights: list, nbytes: int) -> fx.Node:
    with graph.inserting_before(wait):
        return call(graph, _PREFETCH, (weights, nbytes), like=wait)


def _beside_collective(graph: fx.Graph, op: fx.Node, weights: list, nbytes: int) -> fx.Node:
    """fork before `op` on its first input, the prefetch on SIDE after it (launched after the
    collective, run alongside it: it waits only for the fork), the join at the span's end."""
    end = _span_end(op)
    x = next(a for a in op.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))
    with graph.inserting_before(op):
        x_side = fork(graph, x, SIDE, op, [op])
    with graph.inserting_after(op):
        node = call(graph, _PREFETCH, (weights, nbytes), {"stream": SIDE, "after": [x_side]},
                    like=op)
    with graph.inserting_after(node):
        done = call(graph, operator.getitem, (node, 0), like=op)
    set_stream(node, SIDE)
    done.meta["k3_stream"] = SIDE
    join(graph, [done], SIDE, end, like=op)  # x's alias: x lives until the main stream waited
    return node


def insert_prefetches(graph: fx.Graph, l2: int, joins: bool = True,
                      beside: bool = True) -> list[Prefetch]:
    """Prefetch before every collective wait (and side-stream join when `joins`), and beside
    every fused collective on stream SIDE when `beside`."""
    budget = int(l2 * SHARE)
    written = written_inputs(graph)
    plans = []
    for anchor in [n for n in graph.nodes
                   if is_wait(n, joins) or (beside and is_fused_collective(n))]:
        weights, sizes, gemms = _weights_after(anchor, written, budget)
        if weights:
            plans.append((anchor, weights, min(sum(sizes), budget), gemms))
    out = []
    for anchor, weights, nbytes, gemms in plans:
        side = is_fused_collective(anchor)
        node = (_beside_collective if side else _before_wait)(graph, anchor, weights, nbytes)
        order = {n: i for i, n in enumerate(graph.nodes)}
        moved = set()  # `order` is the graph's before the moves: a view two chains share
        for w in weights:  # a rank's row slice (stage shard) may be cut after it: move it up
            for view in view_chain(w):  # (the pieces of one split) moves once
                if view not in moved and order[view] > order[node]:
                    node.prepend(view)
                    moved.add(view)
        stream = SIDE if side else 0
        node.meta["k3_stream"] = stream
        names = [root(w).name for w in weights]
        node.meta["k3_prefetch"] = {"before": anchor.name, "weights": names, "bytes": nbytes,
                                    "gemms": gemms, "stream": stream}
        out.append(Prefetch(node, anchor.name, names, nbytes, gemms, stream))
    return out


def prefetch(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage. Beside fused collectives on stream 2 where side streams are on: the prefetch's
    call names its stream, and fork/join order it by data dependence in whatever order Inductor
    launches."""
    ctx.notes["prefetch"] = insert_prefetches(gm.graph, l2_bytes(ctx.options.l2_bytes, gm.graph),
                                               joins=ctx.options.prefetch_on_join,
                                               beside=ctx.options.side_streams)
    gm.recompile()
    return gm
