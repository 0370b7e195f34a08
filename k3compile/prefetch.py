"""Stage `prefetch`: where the main stream only waits, read ahead the weights of the GEMMs that
come next, so that they come from L2 instead of HBM when those GEMMs run.

The main stream waits on a collective (`wait_tensor` of an all-reduce or all-gather, which runs
on the communication stream) and on the side stream (`k3.stream_join`). A `k3.prefetch_l2` goes
just before each such wait, so its read overlaps what is being waited for:

    r = all_reduce(partial) ; k3.prefetch_l2([W_up[r], W_q|k|v, ...], nbytes) ; wait_tensor(r)

It names, in graph order, the weights (graph inputs nothing writes, ≥ 2-D, floating point) of
the GEMMs and fused ops after the wait, up to the next wait, within a byte budget: a share of
the L2 (`Options.l2_bytes`; the rest keeps the activations and what the GEMMs stream through).
Routed experts are not named: which of them run is decided by the routing at run time. What each
prefetch covers is recorded in `meta["k3_prefetch"]`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

import k3compile.ops  # noqa: F401  (the k3 ops named below)
from k3compile.graph_edit import call
from k3compile.streams import is_collective, root, view_chain, written_inputs

H200_L2_BYTES = 60 * 2**20
SHARE = 0.5  # of the L2 one prefetch may fill
_PREFETCH, _JOIN = torch.ops.k3.prefetch_l2.default, torch.ops.k3.stream_join.default
_NOT_GEMMS = {"moe_route", "moe_experts", "stream_fork", "stream_join", "prefetch_l2"}
_TRANSPOSES = {"permute", "t", "transpose"}


@dataclasses.dataclass
class Prefetch:
    node: fx.Node
    before: str  # the wait it overlaps
    weights: list[str]  # graph inputs read ahead
    nbytes: int
    gemms: list[str]  # the nodes that will read them


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


def _weights_after(wait: fx.Node, written, budget: int):
    """(weight nodes, their bytes, the GEMMs reading them) after `wait`, up to the next wait."""
    picked, sizes, gemms = [], [], []
    node = wait.next
    while node.op != "output" and not is_wait(node) and sum(sizes) < budget:
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


def insert_prefetches(graph: fx.Graph, l2: int, joins: bool = True) -> list[Prefetch]:
    """Prefetch before every collective wait, and before side-stream joins when `joins`."""
    budget = int(l2 * SHARE)
    written = written_inputs(graph)
    out = []
    for wait in [n for n in graph.nodes if is_wait(n, joins)]:
        weights, sizes, gemms = _weights_after(wait, written, budget)
        if not weights:
            continue
        nbytes = min(sum(sizes), budget)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for w in weights:  # a rank's row slice (stage shard) may be cut after the wait: move it up
            for view in view_chain(w):
                if order[view] > order[wait]:
                    wait.prepend(view)
        with graph.inserting_before(wait):
            node = call(graph, _PREFETCH, (weights, nbytes), like=wait)
        node.meta["k3_stream"] = 0
        names = [root(w).name for w in weights]
        node.meta["k3_prefetch"] = {"before": wait.name, "weights": names, "bytes": nbytes,
                                    "gemms": gemms}
        out.append(Prefetch(node, wait.name, names, nbytes, gemms))
    return out
