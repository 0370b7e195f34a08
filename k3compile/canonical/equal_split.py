"""Rule `equal_split`: a split of the last dim into equal pieces written with a list of sizes,
`x.split([W, W, W], -1)` (ATen `split_with_sizes`), -> `x.split(W, -1)` (ATen `split`), the
form the `kda_decode` pattern cuts its conv output into q | k | v with (`conv.split(nh * hd, -1)`).

spell10 (`tests/models/spell10_k3.py`, a serving engine's KDA) writes `qkv.split([w, w, w], -1)`;
its probe `kda_split_int` is the `split(w, -1)` form.

    split_with_sizes(x, [W, W, W], -1)  ->  split(x, W, -1)

Exact: both are views of the same slices (the same getitems read them). Taken only on the last
dim, with at least two pieces, all of one size wider than one element and tiling the dim.
Left alone: unequal sizes (MLA's `[C, R]`, linear_concat's q|k|v|g|f_a|b), a split on another
dim (the three conv states' `split([W] * 3, dim=1)` and MLA's `w_kvb.split([N, V], dim=1)`,
which their patterns write with sizes), pieces of width one (`expert_dense`'s `[1] * E`).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape
from k3compile.graph import call

aten = torch.ops.aten


def _site(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(x, width, dim) where node = split_with_sizes(x, [width] * n, last dim), n >= 2."""
    x, sizes = node.args[0], list(node.args[1])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dims = shape(x)
    if dims is None or not dims or dim % len(dims) != len(dims) - 1:
        return None
    if len(sizes) < 2 or len(set(sizes)) != 1 or sizes[0] <= 1 or sum(sizes) != dims[-1]:
        return None
    return x, sizes[0], dim


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    x, width, dim = site
    with graph.inserting_before(node):
        split = call(graph, aten.split.Tensor, (x, width, dim), like=node)
    node.replace_all_uses_with(split)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.split_with_sizes.default})


RULE = Rule("equal_split", apply,
            "split_with_sizes(x, [W] * n, -1) -> split(x, W, -1) (equal pieces of the last dim)")

__all__ = ["RULE", "apply"]
