"""Rule `token_unsqueeze`: a token's row of a [B, T, H] tensor taken after a unit dim was
appended -> the row taken first, then unsqueezed: `x[..., None][:, t]` -> `x[:, t].unsqueeze(-1)`,
the order `k3compile.math.delta_rule_step` reads KDA's β in (`beta[:, t].unsqueeze(-1)`).

spell12 (`tests/models/spell12_k3.py`, `KDA.forward`) computes `beta = sigmoid(b.float())[...,
None]` once, [B, T, H, 1], and reads `beta[:, t]` per token:

    select(unsqueeze(x, 3), 1, t)  ->  unsqueeze(select(x, 1, t), -1)

Exact: the same elements (both are views of x). Taken only where x is 3-D, the unit dim is
appended at the end, and every reader of the unsqueezed tensor is such a select on dim 1 (each
is rewritten; the unsqueeze then dies). Left alone: an unsqueeze at another dim, one read whole
or by a select on another dim.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape
from k3compile.graph import call

aten = torch.ops.aten


def _site(unsq: fx.Node):
    src = shape(unsq.args[0])
    if src is None or len(src) != 3 or unsq.args[1] % 4 != 3 or not unsq.users:
        return None
    if not all(u.target is aten.select.int and u.args[0] is unsq and u.args[1] % 4 == 1
               for u in unsq.users):
        return None
    return list(unsq.users)


def _write(graph: fx.Graph, node: fx.Node, selects) -> int:
    for sel in selects:
        with graph.inserting_before(sel):
            row = call(graph, aten.select.int, (node.args[0], 1, sel.args[2]), like=sel)
            new = call(graph, aten.unsqueeze.default, (row, -1), like=sel)
        sel.replace_all_uses_with(new)
    return 1


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.unsqueeze.default})


RULE = Rule("token_unsqueeze", apply, "x[..., None][:, t] -> x[:, t].unsqueeze(-1)  (x [B, T, H])")

__all__ = ["RULE", "apply"]
