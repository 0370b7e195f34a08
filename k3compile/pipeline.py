"""The compile pipeline: one ordered list of named stages over the functional ATen graph.

Inductor's own machinery lowers the Dynamo graph (functionalisation, decompositions, inference
only); `Pipeline.inner_compile` then receives the ATen graph, runs the stages, and hands what the
patterns left to Inductor (`compile` stage). Which rewrites are on is decided once, here, as data.

    normalize -> fuse -> shard -> streams -> prefetch -> verify -> check -> ranks -> pack
    -> compile

An `Observer` wraps every stage: wall time, op histogram before/after, a printed copy of the graph,
and the rewrite report. The graph-diff tool and the fusion contract read what it records.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from k3compile.rewrite import inductor
from k3compile.settings import Options
from k3compile.observe import Observer
from k3compile.rewrite import RewriteReport, apply_patterns

log = logging.getLogger("k3compile")


@dataclasses.dataclass
class Context:
    options: Options
    batch: int | None  # the bucket this graph is specialised to (None: not bucketed)
    report: RewriteReport = dataclasses.field(default_factory=RewriteReport)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)
    inputs: list = dataclasses.field(default_factory=list)  # Dynamo's real example inputs


# ---- stages -------------------------------------------------------------------------------------

def normalize(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    _scalar_adds_as_tensor_adds(gm.graph)
    gm.recompile()
    return gm


def _deferral(graph: fx.Graph, options) -> Callable | None:
    """On a CUDA graph, skip the patterns whose op has no GPU kernel yet (unless
    `fuse_without_kernels`): its reference would run op by op, slower than Inductor's code for
    the unfused subgraph; likewise a site its kernel refuses (`kernels_only`). CPU graphs fuse
    everything (the references are the CPU kernels)."""
    on_cuda = any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.is_cuda
                  for n in graph.nodes if n.op == "placeholder")
    if not on_cuda or options.fuse_without_kernels:
        return None
    from k3compile.kernels import cuda_ops

    ready = cuda_ops()
    return lambda p: (None if p.op.split(".")[-1] in ready
                      else "no CUDA kernel yet (its torch reference would run op by op)")


def _scalar_adds_as_tensor_adds(graph: fx.Graph) -> None:
    """`add.Scalar(x, c)` (F.rms_norm's decomposition adds its eps so) as `add.Tensor(x, c)`, the
    form `h + eps` traces to and the patterns search for; the same op for a float constant."""
    for node in graph.nodes:
        if (node.target is torch.ops.aten.add.Scalar and len(node.args) == 2 and not node.kwargs
                and isinstance(node.args[1], float)):
            node.target = torch.ops.aten.add.Tensor


def fuse(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    from k3compile.patterns import all_patterns

    deferred = _deferral(gm.graph, ctx.options)
    report = apply_patterns(gm.graph, all_patterns(), ctx.batch, ctx.options.pattern_enabled,
                            verify=ctx.options.verify, deferred=deferred,
                            kernels_only=deferred is not None)
    ctx.report.merge(report)
    _drop_self_copies(gm.graph)
    gm.recompile()
    return gm


def _drop_self_copies(graph: fx.Graph) -> None:
    """A k3 op that updates a state buffer in place (KDA state, MLA cache) takes over the graph's
    functional write-back: `copy_(buf, index_put(buf, ...))` becomes `copy_(buf, buf)`."""
    for node in list(graph.nodes):
        if (node.target is torch.ops.aten.copy_.default and node.args[0] is node.args[1]
                and not node.users):
            graph.erase_node(node)


def shard(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    from k3compile.stages.shard import shard_replicated

    ctx.notes["shard"] = shard_replicated(gm.graph, policy=ctx.options.shard_moe)
    gm.recompile()
    return gm


def streams(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    from k3compile.stages.streams import schedule_shared_experts

    if not ctx.options.side_streams:  # see Options.side_streams
        ctx.notes["streams"] = []
        return gm
    ctx.notes["streams"] = schedule_shared_experts(gm.graph)
    gm.recompile()
    return gm


def prefetch(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    from k3compile.stages.prefetch import insert_prefetches, l2_bytes

    # beside fused collectives on stream 2 (where side streams are on): the prefetch's call
    # names its stream, and fork/join order it by data dependence in whatever order Inductor
    # launches
    ctx.notes["prefetch"] = insert_prefetches(gm.graph, l2_bytes(ctx.options.l2_bytes, gm.graph),
                                               joins=ctx.options.prefetch_on_join,
                                               beside=ctx.options.side_streams)
    gm.recompile()
    return gm


def verify(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Verify mode checks each rewrite where it is made (`apply_patterns(verify=True)`: matched
    subgraph vs replacement on fresh random inputs, a failure reverted); this stage reports it."""
    if ctx.options.verify:
        log.info("k3 verify (batch %s): %d rewrites verified, %d reverted", ctx.batch,
                 ctx.report.verified, len(ctx.report.reverted))
    return gm


def check(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """The engine's invariants: every node has meta['val']; only declared state is mutated."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta:
            raise AssertionError(f"k3compile invariant: node {node.name} has no meta['val']")
        if node.op == "call_function" and getattr(node.target, "_schema", None) is not None:
            for target in _written_args(node):
                if isinstance(target, fx.Node) and target.op != "placeholder":
                    raise AssertionError(f"k3compile invariant: {node.name} mutates a non-input")
    return gm


def _written_args(node: fx.Node) -> list:
    """The arguments a call writes to, by its schema (`Tensor(a!)`)."""
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return out


def ranks(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Under tensor parallelism, every rank compiled the same graph (k3compile.stages.ranks)."""
    if ctx.options.check_ranks:
        from k3compile.stages.ranks import check_ranks

        ctx.notes["ranks"] = check_ranks(gm.graph, ctx.batch, ctx.options)
    return gm


def pack(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Last, after every check: it moves real weights (k3compile.stages.pack)."""
    from k3compile.stages.pack import pack_concatenated

    if ctx.options.pack_weights:
        ctx.notes["pack"] = pack_concatenated(gm.graph, ctx.inputs)
    return gm


STAGES: list[tuple[str, Callable[[fx.GraphModule, Context], fx.GraphModule]]] = [
    ("normalize", normalize),
    ("fuse", fuse),
    ("shard", shard),
    ("streams", streams),
    ("prefetch", prefetch),
    ("verify", verify),
    ("check", check),
    ("ranks", ranks),
    ("pack", pack),
]


class Pipeline:
    """Runs the stages inside Inductor's compile (as its `inner_compile`) for one bucket."""

    def __init__(self, options: Options, observer: Observer):
        self.options = options
        self.observer = observer

    def compile(self, gm: fx.GraphModule, example_inputs: list, batch: int | None) -> Callable:
        ctx = Context(self.options, batch, inputs=list(example_inputs))
        if any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
            from k3compile.kernels import register_all

            register_all()  # CuTe DSL kernels replace the references on CUDA where the DSL is

        def inner_compile(aten_gm: fx.GraphModule, aten_inputs, **kwargs):
            import k3compile.ops  # noqa: F401  (the k3 ops must exist before patterns trace)

            for name, stage in STAGES:
                if name in self.options.disabled_stages:
                    continue
                aten_gm = self.observer.run(name, stage, aten_gm, ctx)
            from k3compile.stages.pack import remember

            remember(ctx.inputs)  # later compiles never move what this one was handed
            self.observer.reports[batch] = ctx.report
            self.observer.notes[batch] = ctx.notes
            self.observer.graphs[batch] = aten_gm.graph
            if self.options.executor == "inductor":
                return inductor.compile_fx_inner(aten_gm, aten_inputs, **kwargs)
            # the graph as it is: side-stream ops name their stream in their calls
            return inductor.make_boxed_func(aten_gm.forward)

        patches = {"fx_graph_cache": False, "emulate_precision_casts": True,
                   **inductor.GRAPH_PASSES_OFF}  # see there: Inductor's pattern passes off
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return inductor.compile_fx(gm, example_inputs, inner_compile=inner_compile,
                                       config_patches=patches)

