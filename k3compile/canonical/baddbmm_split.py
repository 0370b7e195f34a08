"""Rule `baddbmm_split`: `baddbmm(S, a, c)` (β = α = 1) -> `S + bmm(a, c)`, the add and the
product the other rules and the patterns read apart.

The delta rule's rank-1 write `S + k ⊗ u` is spelled `torch.baddbmm(S, u[..., None], k[:, None])`
on batch-merged [B*H, ., .] states (spell6, spell7: vLLM-style code); the canonical form
(`k3compile.math.delta_rule_step`) adds an outer product to the state, and rule `delta_einsum`
takes a batch-merged outer product as `bmm` of a column and a row, not inside a `baddbmm`.

To rounding: a `baddbmm` may accumulate the product into S in one step where the add rounds the
product first (an ulp; none where the inner dim is 1, as in a rank-1 write, on CPU). Taken: a
`baddbmm` with the default β and α (1). Left alone: other β or α (a scaled state or product).
"""

from __future__ import annotations

import functools

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.graph import call

aten = torch.ops.aten


def _site(node: fx.Node) -> bool:
    beta = node.kwargs.get("beta", 1)
    alpha = node.kwargs.get("alpha", 1)
    return len(node.args) == 3 and beta == 1 and alpha == 1 and set(node.kwargs) <= {"beta", "alpha"}


def write_sum(product, graph: fx.Graph, node: fx.Node, _=None) -> None:
    """node(S, a, c) -> S + product(a, c) (also `addcmul_split`'s writer)."""
    S, a, c = node.args
    with graph.inserting_before(node):
        total = call(graph, aten.add.Tensor, (S, call(graph, product, (a, c), like=node)),
                     like=node)
    node.replace_all_uses_with(total)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, functools.partial(write_sum, aten.bmm.default),
                         targets={aten.baddbmm.default})


RULE = Rule("baddbmm_split", apply, "baddbmm(S, a, c) -> S + bmm(a, c)")

__all__ = ["RULE", "apply"]
