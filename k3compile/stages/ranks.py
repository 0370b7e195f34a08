"""Stage `ranks`: under tensor parallelism every rank must have compiled the same graph, or their
collectives pair up wrongly and hang or mix up data. Each rank fingerprints its final graph
(ops, their argument structure, shapes and dtypes, the bucket, the backend options and the
process's kernel settings: registered kernels, PDL and gemv switches, DSL version, tuning
table; every CuTe kernel's config is a pure function of these and its op's shapes, so equal
summaries mean equal kernel configs) and the fingerprints are all-gathered over the graph's TP group; a mismatch fails
the compile on every rank at once, with a diff of the first differing rank against rank 0.

    rank 0: 3f2a...   rank 1: 3f2a...   -> same graph, compile goes on
    rank 1 differs -> RanksDiffer: "--- rank 0 / +++ rank 1" lines of the two summaries

Row slices the `shard` stage cuts for this rank (`meta["k3_rank_rows"]`) are summarised without
their bounds, devices without their index (found on the H200 x2: every factory op's device
differed by rank). The summary names nodes by position, not by name, so two ranks that traced the same program
agree even where FX's generated names would not. A graph without collectives (world size 1) is
not checked. Every rank compiles each bucket at its first run of that bucket, which the ranks
reach together (they decode the same batch), so the all-gather cannot wait on a rank that does
not compile.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib

import torch
from torch import fx

from k3compile import kernels
from k3compile.stages.shard import tp_group


class RanksDiffer(RuntimeError):
    pass


def _describe(value, index: dict[fx.Node, int]) -> str:
    if isinstance(value, fx.Node):
        return f"%{index[value]}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v, index) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, torch.device):  # each rank runs on its own GPU: cuda:0, cuda:1, ...
        return f"device({value.type})"
    return repr(value)


def _masked(node: fx.Node) -> tuple[list, dict]:
    """node's arguments with what differs by rank by design masked: process-group names (the
    gather itself runs over the group; found by the op's schema), this rank's row slice of a
    sharded weight (stage shard, `meta["k3_rank_rows"]`) and (in `_describe`) the device index
    of factory ops (`iota`, `full`: cuda:0 on rank 0, cuda:1 on rank 1)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if "group" in arg.name:
            if i < len(args):
                args[i] = "<group>"
            elif arg.name in kwargs:
                kwargs[arg.name] = "<group>"
    if "k3_rank_rows" in node.meta:
        args[2:] = ["<this rank's rows>"]
    return args, kwargs


def _meta(node: fx.Node) -> str:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return " ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                    for v in vals if isinstance(v, torch.Tensor))


def _options_text(options) -> str:
    """The options with sets sorted (a frozenset's repr order varies between processes)."""
    if options is None or not dataclasses.is_dataclass(options):
        return repr(options)
    parts = []
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        parts.append(f"{field.name}={sorted(value) if isinstance(value, frozenset) else value!r}")
    return ", ".join(parts)


def summary(graph: fx.Graph, batch: int | None = None, options=None) -> list[str]:
    """The bucket, options and kernel settings, then one line per node: position, op, target, arguments by
    position, output dtypes and shapes."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    lines = [f"bucket {batch}", f"options {_options_text(options)}", *kernels.fingerprint()]
    for node in graph.nodes:
        target = "" if node.op == "placeholder" else getattr(node.target, "__name__",
                                                               str(node.target))
        args, kwargs = _masked(node)
        args = _describe(tuple(args), index)
        kwargs = _describe(tuple(sorted(kwargs.items())), index) if kwargs else ""
        lines.append(f"%{index[node]} {node.op} {target}{args}{kwargs} -> {_meta(node)}")
    return lines


def fingerprint(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def check_ranks(graph: fx.Graph, batch: int | None = None, options=None) -> str | None:
    """All-gather this rank's fingerprint over the graph's TP group; raise `RanksDiffer` on every
    rank if any rank differs. Returns the common fingerprint, or None where nothing is checked."""
    import torch.distributed as dist

    name = tp_group(graph)
    if name is None or not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    group = distributed_c10d._resolve_process_group(name)
    lines = summary(graph, batch, options)
    mine = (fingerprint(lines), lines)
    gathered: list = [None] * group.size()
    from k3compile.rewrite.inductor import unset_fake_temporarily

    with unset_fake_temporarily():  # the compile runs under fake mode; the gather moves real bytes
        dist.all_gather_object(gathered, mine, group=group)
    first = gathered[0]
    for rank, other in enumerate(gathered):
        if other[0] != first[0]:
            diff = difflib.unified_diff(first[1], other[1], "rank 0", f"rank {rank}", lineterm="",
                                        n=1)
            text = "\n".join(list(diff)[:40])
            raise RanksDiffer(f"k3: tensor-parallel ranks compiled different graphs (bucket "
                              f"{batch}); rank 0 {first[0]} vs rank {rank} {other[0]}:\n{text}")
    return first[0]


def ranks(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """The stage (on with `Options.check_ranks`): every TP rank compiled the same graph."""
    ctx.notes["ranks"] = check_ranks(gm.graph, ctx.batch, ctx.options)
    return gm
