"""Stage `shard`: at world size W > 1, the MoE's replicated projections run row-sharded.

vLLM keeps the router [E, D], the latent down [L, D] and the latent up [D, L] replicated on every
rank (ReplicatedLinear, spec §4.2): at TP16 they are 116 MB of the 155 MB a rank reads per MoE
layer at batch 1 (§6), all of it read 16 times over. Here each rank computes 1/W of their output
rows and the ranks exchange only the small results:

    logits_r, z_r = k3.moe_front(x, W_router[r], W_down[r])     W[r]: rows r·n/W .. (r+1)·n/W
    logits, z     = all_gather(pack(logits_r, z_r))             one collective, [N, E/W + L/W]
    y_r = k3.norm_linear(u, w_norm, W_up[r], eps);  y = all_gather(y_r)  (+ its residual, after)

A row block of a row-major [out, in] weight is contiguous, so W[r] is a view: the rank's slice is
cut once (in the graph, not per step: a view costs no kernel) and its GEMM reads only those bytes.
Each rank's dot products are the same as in the replicated GEMM, so results are unchanged.

Rank and world size come from the tensor-parallel group of the graph's all-reduces (their group
name, resolved through c10d). A graph without collectives (W = 1) is left alone.

Whether it pays is a cost question (option `shard_moe`, default "auto"): a rank saves reading
(W-1)/W of the weights but waits on one all-gather (plus its pack / unpack kernels) per sharded
op. On two H200s (2026-11-29, BENCHMARKS.md) sharding both ops saved 57.8 MB per rank per layer
(~14 µs at the copy bandwidth) and cost +37 µs at B1, +50 µs at B8: ~18 µs per sharded op
(session 5, with every decode kernel in: +30 µs at B1, +14 µs at B8, so 7-15 µs an op). "auto"
shards an op only where its saved read time exceeds that measured cost (`GATHER_US`), so on the
H200 with NCCL all-gathers it keeps the projections replicated at every TP size and says why in
the report; "on" shards every one it can (the rewrite above), "off" none.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch import fx

import k3compile.ops  # noqa: F401  (the k3 ops named below)
from k3compile.graph import call

log = logging.getLogger("k3compile")

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
_FRONT, _UP = torch.ops.k3.moe_front.default, torch.ops.k3.norm_linear.default
# Cost of one sharded op's all-gather with its pack / unpack kernels, and the rate at which the
# saved weight bytes would have been read: H200, TP 2, NCCL (BENCHMARKS.md, 2026-11-29)
GATHER_US = 18.0
READ_BYTES_PER_US = 4.2e6


@dataclasses.dataclass
class ShardReport:
    world: int = 1
    rank: int = 0
    sharded: list[str] = dataclasses.field(default_factory=list)  # nodes rewritten
    skipped: list[str] = dataclasses.field(default_factory=list)  # "node: why"


def tp_group(graph: fx.Graph) -> str | None:
    """The group name of the graph's all-reduces (the tensor-parallel group), or None."""
    names = {n.args[2] for n in graph.nodes if n.target is c10d.all_reduce.default}
    if len(names) > 1:
        raise ValueError(f"k3 shard: all-reduces over several groups {sorted(names)}")
    return next(iter(names), None)


def rank_and_world(group_name: str) -> tuple[int, int]:
    from torch.distributed import distributed_c10d

    group = distributed_c10d._resolve_process_group(group_name)
    return group.rank(), group.size()


def worth_sharding(node: fx.Node, world: int, policy: str) -> str | None:
    """None where `policy` shards this op, else why it stays replicated."""
    if policy == "on":
        return None
    if policy == "off":
        return "kept replicated (shard_moe='off')"
    weights = node.args[1:3] if node.target is _FRONT else node.args[2:3]
    saved = sum(w.meta["val"].nbytes for w in weights) * (world - 1) / world
    saved_us = saved / READ_BYTES_PER_US
    if saved_us > GATHER_US:
        return None
    return (f"kept replicated: sharding saves {saved / 1e6:.1f} MB of reads (~{saved_us:.1f} µs), "
            f"less than the ~{GATHER_US:.0f} µs its all-gather costs (shard_moe='on' forces it)")


def shard_replicated(graph: fx.Graph, group: str | None = None, rank: int | None = None,
                     world: int | None = None, policy: str = "on") -> ShardReport:
    """Rewrite every MoE front and every latent up-projection fed by an all-reduce to compute this
    rank's rows, where `policy` ("on", "auto", "off": `worth_sharding`) says it pays.
    `group/rank/world` default to the graph's TP group."""
    group = group or tp_group(graph)
    if group is None:
        return ShardReport()
    if rank is None or world is None:
        rank, world = rank_and_world(group)
    report = ShardReport(world, rank)
    if world == 1:
        return report
    for node in list(graph.nodes):
        if node.target is not _FRONT and not (node.target is _UP and _reduced(node.args[0])):
            continue
        why = worth_sharding(node, world, policy)
        if why is None:
            shard_op = _shard_front if node.target is _FRONT else _shard_up
            why = shard_op(graph, node, group, rank, world)
        (report.skipped.append(f"{node.name}: {why}") if why else report.sharded.append(node.name))
    graph.eliminate_dead_code()
    return report


def _reduced(node) -> bool:
    """node is the result of an all-reduce (identical on every rank)."""
    return (isinstance(node, fx.Node) and node.target is c10d.wait_tensor.default
            and node.args[0].target is c10d.all_reduce.default)


def _rows(graph, weight: fx.Node, rank: int, world: int, like: fx.Node) -> fx.Node:
    n = weight.meta["val"].shape[0] // world
    rows = call(graph, aten.slice.Tensor, (weight, 0, rank * n, (rank + 1) * n), like=like)
    rows.meta["k3_rank_rows"] = (rank, world)  # differs by rank by design (stage `ranks`)
    return rows


def _shard_front(graph, node, group, rank, world) -> str | None:
    x, router_w, down_w = node.args
    n_exp, latent = router_w.meta["val"].shape[0], down_w.meta["val"].shape[0]
    if n_exp % world or latent % (2 * world):
        return f"{n_exp} experts / latent {latent} do not split over {world} ranks"
    outs = _getitems(node)
    with graph.inserting_before(node):
        part = call(graph, _FRONT, (x, _rows(graph, router_w, rank, world, node),
                                    _rows(graph, down_w, rank, world, node)), like=node)
        part.meta["k3_shard"] = f"rows {rank}/{world}"
        logits_r = call(graph, operator.getitem, (part, 0), like=node)
        z_r = call(graph, operator.getitem, (part, 1), like=node)
        logits, z = _gather_columns(graph, [logits_r, z_r], group, world, node)
    for i, new in ((0, logits), (1, z)):
        if i in outs:
            outs[i].replace_all_uses_with(new)
    return None


def _shard_up(graph, node, group, rank, world) -> str | None:
    u, norm_w, w, eps, *residual = node.args
    flags = residual[1:]  # weight_fp32 (the norm's rounding) stays on every rank's part
    out = w.meta["val"].shape[0]
    if out % world:
        return f"output width {out} does not split over {world} ranks"
    with graph.inserting_before(node):
        rows = _rows(graph, w, rank, world, node)
        args = (u, norm_w, rows, eps, None, *flags) if flags else (u, norm_w, rows, eps)
        y_r = call(graph, _UP, args, {k: v for k, v in node.kwargs.items() if k != "residual"},
                   like=node)
        y_r.meta["k3_shard"] = f"rows {rank}/{world}"
        (y,) = _gather_columns(graph, [y_r], group, world, node)
        residual = residual[:1] or [node.kwargs.get("residual")]
        if residual[0] is not None:  # the epilogue's add needs the gathered rows
            y = call(graph, aten.add.Tensor, (y, residual[0]), like=node)
    node.replace_all_uses_with(y)
    return None


def _gather_columns(graph, parts: list[fx.Node], group, world, like) -> list[fx.Node]:
    """All-gather the column blocks [N, c_i] of every rank in one collective: each part is packed
    as 32-bit words (16-bit dtypes pairwise), gathered to [W·N, Σ words], and unpacked to the
    full [N, W·c_i] in rank order."""
    vals = [p.meta["val"] for p in parts]
    rows = vals[0].shape[0]
    words = [_as_words(graph, p, like) for p in parts]
    widths = [w.meta["val"].shape[1] for w in words]
    packed = words[0] if len(words) == 1 else call(graph, aten.cat.default, (words, 1), like=like)
    gathered = call(graph, c10d.all_gather_into_tensor.default, (packed, world, group), like=like)
    gathered.meta["k3_shard"] = "gather"
    gathered = call(graph, c10d.wait_tensor.default, (gathered,), like=like)
    by_rank = call(graph, aten.view.default, (gathered, [world, rows, sum(widths)]), like=like)
    out, start = [], 0
    for val, width in zip(vals, widths):
        block = call(graph, aten.slice.Tensor, (by_rank, 2, start, start + width), like=like)
        block = call(graph, aten.permute.default, (block, [1, 0, 2]), like=like)
        block = call(graph, aten.clone.default, (block,),
                     {"memory_format": torch.contiguous_format}, like=like)
        if val.dtype != torch.float32:
            block = call(graph, aten.view.dtype, (block, val.dtype), like=like)
        out.append(call(graph, aten.view.default, (block, [rows, world * val.shape[1]]),
                        like=like))
        start += width
    return out


def _as_words(graph, part: fx.Node, like) -> fx.Node:
    val = part.meta["val"]
    if val.dtype == torch.float32:
        return part
    if val.element_size() != 2:
        raise ValueError(f"k3 shard: cannot pack {val.dtype} into 32-bit words")
    return call(graph, aten.view.dtype, (part, torch.float32), like=like)


def _getitems(node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


def shard(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage: shard what pays under the graph's TP group (policy `Options.shard_moe`)."""
    ctx.notes["shard"] = shard_replicated(gm.graph, policy=ctx.options.shard_moe)
    gm.recompile()
    return gm
