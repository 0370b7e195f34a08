"""Stage `fuse`: every enabled pattern, in priority order (`k3compile.patterns.all_patterns`),
applied by the rewrite engine; each rewrite is recorded in the context's report for stage
`verify`. The layers are read off the graph first (`k3compile.layers`, in the notes as "layers":
the fusion contract's plan), and a big fusion a layer's structure calls for that did not happen
gets a near miss even where the engine recorded none. Stage `writeback` (after `verify`, which
may splice unfused code back) drops the functional write-backs that the fused state-updating
ops took over, and the upcasts of parameters that a fused op upcasts itself."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from k3compile import layers
from k3compile.canonical.region import half_upcast
from k3compile.rewrite import apply_patterns
from k3compile.rewrite.near_miss import NearMiss, cone_ops


def fuse(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    from k3compile.patterns import all_patterns  # patterns trace on first use, not at import

    gm.meta.setdefault("real_inputs", ctx.inputs)  # checks read constant tables (moe_experts)
    # the layers as the model computes them, before any fusion (the contract's plan), and why
    # each big fusion their structure calls for would not happen
    ctx.notes["layers"] = layers.find_layers(gm.graph)
    patterns, unfit = fitting(gm.graph, all_patterns())
    probes = layers.probe_fusions(gm.graph, ctx.notes["layers"], patterns,
                                  ctx.options.pattern_enabled, ctx.batch)
    deferred = deferral(gm.graph, ctx.options)
    report = apply_patterns(gm.graph, patterns, ctx.batch, ctx.options.pattern_enabled,
                            deferred=deferred, kernels_only=deferred is not None)
    report.near_misses += unfit + layers.unexplained(probes, gm.graph, report.near_misses,
                                                     report.deferred)
    ctx.report.merge(report)
    gm.recompile()
    return gm


def fitting(graph: fx.Graph, patterns) -> tuple[list, list[NearMiss]]:
    """The patterns that may match in `graph` (`Pattern.fits`; the others are never traced),
    and a near miss for each op none of whose variants fits, with the first variant's reason."""
    fit, unfit, absent = [], {}, set()
    # a variant whose distinctive graph ops (not the k3 ops that earlier fusions make) the graph
    # lacks has no site: it is not traced, but one variant of each op is kept for its near miss
    # (spell10 bf16: no short conv recognised, `fits` passed all 1024 kda_decode variants, and
    # tracing them took 130-270 s of one compile)
    have, made = cone_ops(graph.nodes), {p.op.split(".")[-1] for p in patterns}
    for p in patterns:
        reason = p.fits(graph) if p.fits is not None else None
        missing = [d for d in p.distinctive if d not in made and not have[d]]
        if reason is None and missing:
            reason = f"the graph has no {'/'.join(missing)} node" if p.op in absent else None
            absent.add(p.op)
        (unfit.setdefault(p.op, reason) if reason else fit.append(p))
    ops = {p.op for p in fit}
    return fit, [NearMiss(f"{op.split('.')[-1]} (every variant)", "", f"no variant fits: {reason}")
                 for op, reason in unfit.items() if op not in ops]


def deferral(graph: fx.Graph, options) -> Callable | None:
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


def writeback(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    drop_self_copies(gm.graph)
    drop_self_upcasts(gm.graph)
    gm.recompile()
    return gm


def drop_self_upcasts(graph: fx.Graph) -> int:
    """A fused KDA op's A_log / dt_bias that the graph upcasts first (a bf16 model's parameters,
    cast to fp32 every step: a launch each) is handed over as it is: the op upcasts it itself
    (`ops.kda_decode.SELF_UPCAST`), so the value is the same, exactly. How many were dropped."""
    from k3compile.ops.kda_decode import SELF_UPCAST

    ops = {torch.ops.k3.kda_decode.default, torch.ops.k3.fb_kda_decode.default}
    dropped = 0
    for node in list(graph.nodes):
        if node.target not in ops:
            continue
        names = [a.name for a in node.target._schema.arguments]
        for name in SELF_UPCAST:
            i = names.index(name)
            cast = node.args[i] if i < len(node.args) else node.kwargs.get(name)
            if half_upcast(cast):
                node.replace_input_with(cast, cast.args[0])
                dropped += 1
                if not cast.users:
                    graph.erase_node(cast)
    return dropped


def drop_self_copies(graph: fx.Graph) -> None:
    """A k3 op that updates a state buffer in place (KDA state, MLA cache) takes over the graph's
    functional write-back: `copy_(buf, index_put(buf, ...))` became `copy_(buf, buf)`: gone."""
    for node in list(graph.nodes):
        if (node.target is torch.ops.aten.copy_.default and node.args[0] is node.args[1]
                and not node.users):
            graph.erase_node(node)
