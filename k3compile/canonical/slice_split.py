"""Rule `slice_split`: slices that together tile one dim of a tensor -> one `split_with_sizes`.

Cutting a tensor in parts is written `x[..., :C], x[..., C:]`, `x.narrow(...)`, or
`x.split([C, R], -1)`; the first two trace to one `slice` per part, the last to one
`split_with_sizes` read by `getitem`s. The canonical form (`k3compile/math.py`, the patterns:
mla_lowrank_norm's c_kv | k_pe, mla_decode's cache parts, mla_q_absorb's q_nope | q_pe) is the
split. A part read twice (`cache[..., :C]` for the scores and again for p·c) is one `getitem`.

Taken: step-1 slices of one node along one dim whose distinct ranges are adjacent and cover the
dim from 0 to its end, two parts or more. Exact: the parts are the same views. Left as they are:
slices that leave part of the dim unread (`hist[..., T:]`), overlap, or step, and slices of a
weight (a graph input or a view of one: rule gate_up_split's row slices, W_UK | W_UV), which the
later stages read as views of the parameter (`weight_root`: stage pack, the side streams).
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.graph import call, weight_root

aten = torch.ops.aten


def _range(node: fx.Node, size: int) -> tuple[int, int] | None:
    """(start, end) of a step-1 slice, clamped and made non-negative as torch does."""
    args = list(node.args) + [None] * (5 - len(node.args))
    _, _, start, end, step = args
    start = 0 if start is None else start
    end = size if end is None else end
    if not all(isinstance(v, int) for v in (start, end)) or step not in (None, 1):
        return None
    start, end = (min(max(v + size if v < 0 else v, 0), size) for v in (start, end))
    return (start, end) if start < end else None


def _tiling(source: fx.Node) -> tuple[int, list[tuple[int, int]], dict] | None:
    """(dim, ordered ranges, slice -> range) when source's slices along one dim tile it."""
    val = source.meta.get("val")
    if not isinstance(val, torch.Tensor) or weight_root(source) is not None:
        return None
    by_dim: dict[int, dict[fx.Node, tuple[int, int]]] = {}
    for user in source.users:
        if user.target is not aten.slice.Tensor or user.args[0] is not source:
            continue
        dim = user.args[1] if len(user.args) > 1 else 0
        dim = dim + val.dim() if dim < 0 else dim
        size = val.shape[dim]
        cut = _range(user, size) if isinstance(size, int) else None
        if cut is not None:
            by_dim.setdefault(dim, {})[user] = cut
    for dim, cuts in by_dim.items():
        ranges = sorted(set(cuts.values()))
        if len(ranges) < 2 or ranges[0][0] != 0 or ranges[-1][1] != val.shape[dim]:
            continue
        if all(a[1] == b[0] for a, b in itertools.pairwise(ranges)):
            return dim, ranges, cuts
    return None


def _write(graph: fx.Graph, source: fx.Node, found) -> None:
    dim, ranges, cuts = found
    first = min(cuts, key=list(graph.nodes).index)
    with graph.inserting_before(first):
        split = call(graph, aten.split_with_sizes.default,
                     (source, [e - s for s, e in ranges], dim), like=first)
        parts = {r: call(graph, operator.getitem, (split, i), like=first)
                 for i, r in enumerate(ranges)}
    for node, cut in cuts.items():
        node.replace_all_uses_with(parts[cut])
        graph.erase_node(node)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _tiling, _write, tidy=False)


RULE = Rule("slice_split", apply, "slices that tile one dim of a tensor (x[..., :C], x[..., C:]) "
            "-> one split_with_sizes")
