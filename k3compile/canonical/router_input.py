"""Rule `router_input`: the router GEMM and the GEMM beside it each flattening x -> one [N, D] x.

Moonshot's MoE block flattens its input twice: inside the gate (`hidden_states.view(-1, h)`, then
the fp32 router GEMM) and again for the latent down-projection (`hidden_states.view(-1,
hidden_states.shape[-1])`). Our model reshapes once and hands both GEMMs the same [N, D] value, and
pattern `moe_front` (router and down-projection on one x) binds x to one node. Exact: a view
computes nothing.

Taken: views with the same target, input and arguments, each read only by a GEMM (through a cast
for the fp32 router), where one GEMM is a router's (its output reaches a top-k or sort within a
few ops) and exactly one other reads an equal view. Left alone: equal views of GEMMs with no
router among them: `F.linear` on a [B, T, D] input traces to a view per GEMM, which is the
canonical form of every other projection (q|k|v, gate|up) and what their patterns match.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CASTS
from k3compile.canonical.view_chains import is_view
from k3compile.graph import feeds_top_k

aten = torch.ops.aten
_GEMMS = {aten.mm.default, aten.addmm.default}
_DEPTH = 4  # sigmoid/softmax, the bias add, a view or cast, then the top-k


def _gemm_of(view: fx.Node) -> fx.Node | None:
    """The one GEMM that reads view (directly or through one cast), else None."""
    users = list(view.users)
    if len(users) != 1:
        return None
    user = users[0]
    if user.target in CASTS and len(user.users) == 1:
        user = next(iter(user.users))
    return user if user.target in _GEMMS else None


def _routes(gemm: fx.Node) -> bool:
    return feeds_top_k(gemm, _DEPTH)


def _key(node: fx.Node):
    return (node.target, repr(node.args), repr(sorted(node.kwargs.items())))


def _pairs(source: fx.Node) -> list[tuple[fx.Node, fx.Node]] | None:
    """(the sibling's view, the router's) for each two equal views of source that two GEMMs
    read, one of them the router."""
    groups: dict = {}
    for view in source.users:
        if is_view(view) and _gemm_of(view) is not None:
            groups.setdefault(_key(view), []).append(view)
    pairs = []
    for views in groups.values():
        routers = [v for v in views if _routes(_gemm_of(v))]
        if len(views) == 2 and len(routers) == 1:
            pairs.append((next(v for v in views if v is not routers[0]), routers[0]))
    return pairs or None


def _write(graph: fx.Graph, source: fx.Node, pairs: list) -> int:
    for other, router in pairs:
        other.replace_all_uses_with(router)
    return len(pairs)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _pairs, _write, tidy=False)


RULE = Rule("router_input", apply,
            "router GEMM and its sibling GEMM on two equal views of x -> one view")
