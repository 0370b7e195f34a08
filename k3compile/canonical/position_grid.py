"""Rule `position_grid`: a request's token positions built token-major and transposed,
`(positions[None, :] + arange(T)[:, None]).t()`, -> the [B, T] grid built request-major,
`positions.view(B, 1) + arange(T)`, the form `GatedMLA.forward` and mla_decode's search (its
cache write's row index and causal mask) build it in.

spell13 (`tests/models/spell13_k3.py`, `forward`) keeps sequence-first [T, B] positions and
transposes them where a [B, T] grid is wanted (the latent cache write, the mask):

    permute(add(unsqueeze(positions, 0), unsqueeze(iota(T), 1)), [1, 0])
    ->  add(view(positions, [B, 1]), iota(T))

Exact: the same integer sums (positions[b] + t at [b, t]). Each reader of a transposed grid
gets a grid of its own (its arange too), built just before it, as the canonical form builds one in each
attention: a grid the layers share would escape every layer's mla_decode match (its search
builds the grid inside; rule mla_absorbed rebuilds the mask from the write's grid).
Taken: an integer add (no alpha) of a [1, B] view of a 1-D tensor and a [T, 1] view of
arange(T) (0..T-1 by 1), read through `permute([1, 0])`. Left alone: another offset vector (an
arange from 1, a scaled arange), a grid of two position vectors, float grids, other permutes.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import arange_length, static_shape, val
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten
_UNIT_VIEWS = RESHAPES | {aten.unsqueeze.default}


def _vector(node, shape: tuple[int, int]) -> fx.Node | None:
    """The 1-D tensor node is a view of, shaped `shape` ([1, n] or [n, 1]), else None."""
    if not isinstance(node, fx.Node) or static_shape(node) != shape:
        return None
    while val(node).dim() > 1:
        if node.op != "call_function" or node.target not in _UNIT_VIEWS:
            return None
        node = node.args[0]
        if val(node) is None or val(node).numel() != max(shape):
            return None
    return node if val(node).dim() == 1 else None


def _site(add: fx.Node):
    out = static_shape(add)
    if out is None or len(out) != 2 or add.kwargs or val(add).dtype != torch.int64:
        return None
    T, B = out
    for col, row in (add.args, reversed(add.args)):
        steps, positions = _vector(col, (T, 1)), _vector(row, (1, B))
        if steps is None or positions is None or arange_length(steps) != T:
            continue
        if val(steps).dtype != torch.int64 or val(positions).dtype != torch.int64:
            continue
        grids = [u for u in add.users
                 if u.target is aten.permute.default and list(u.args[1]) in ([1, 0], [-1, -2])]
        return (positions, steps, grids) if grids else None
    return None


def _write(graph: fx.Graph, add: fx.Node, site) -> None:
    positions, steps, grids = site
    for old in grids:
        for reader in list(old.users):
            with graph.inserting_before(reader):
                column = call(graph, aten.view.default,
                              (positions, [val(positions).shape[0], 1]), like=reader)
                arange = graph.call_function(steps.target, steps.args, steps.kwargs)
                arange.meta["val"] = steps.meta["val"]  # a factory: no input's fake mode
                if "nn_module_stack" in reader.meta:
                    arange.meta["nn_module_stack"] = reader.meta["nn_module_stack"]
                grid = call(graph, aten.add.Tensor, (column, arange), like=reader)
            reader.replace_input_with(old, grid)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.add.Tensor})


RULE = Rule("position_grid", apply,
            "(positions[None, :] + arange(T)[:, None]).t() -> positions.view(B, 1) + arange(T)")

__all__ = ["RULE", "apply"]
