"""Rule `lowrank_view`: a low-rank pair of projections whose inner GEMM feeds the outer one its
rows directly -> the pair as two `F.linear`s trace, through the inner output's [*lead, N] view.

KDA's decay is a low-rank pair, `graw = f_b(f_a(x))` (spec §3.1; our model, Moonshot's). On
x [*lead, D], `F.linear` views x to rows, multiplies, and views the result back to [*lead, N];
the outer linear views that to rows again, so the canonical form (`patterns/linear_concat.py`'s
`linear_concat[kda]`, whose f_b stays a GEMM on f_a's slice) holds the round trip:

    a = view(mm(view(x, [R, D]), permute(W_fa)), [*lead, R_a]);  mm(view(a, [R, R_a]), permute(W_fb))

Spelled `einsum("...d,od->...o", einsum("...d,od->...o", x, W_fa), W_fb)` (spell8), rule `gemm`
writes each einsum as an mm on rows and the inner mm's rows feed the outer one with no view
between them, which `linear_concat[kda]` does not read. This rule puts the two views back:

    mm(mm(x2d, permute(W_a)), permute(W_b)) -> view(.., [*lead, N])
    ->  mm(view(view(mm(x2d, permute(W_a)), [*lead, N_a]), [R, N_a]), permute(W_b)) -> view(..)

Exact: views only. Taken: an `mm` in the F.linear form (its second operand `permute(W, [1, 0])`
of a graph input W) whose first operand is another such `mm`, and whose one reader is a view to
[*lead, N] with at least two leading dims of R rows in all (the outer linear's own output
shape names the lead). Left alone: an inner product that is not a linear (a state, an
activation), an outer GEMM read as rows (no [*lead, N] view: there is no lead to restore).
"""

from __future__ import annotations

import math

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten


def _linear_mm(node) -> bool:
    """node is mm(x2d, permute(W, [1, 0])) of a graph input W, as F.linear traces."""
    if not (isinstance(node, fx.Node) and node.target is aten.mm.default):
        return False
    w = node.args[1]
    return (isinstance(w, fx.Node) and w.target is aten.permute.default
            and list(w.args[1]) == [1, 0] and isinstance(w.args[0], fx.Node)
            and w.args[0].op == "placeholder")


def _site(node: fx.Node) -> list[int] | None:
    """The lead dims to restore between node's inner GEMM and node, if node is such a pair."""
    if not _linear_mm(node) or not _linear_mm(node.args[0]) or len(node.users) != 1:
        return None
    (view,) = node.users
    out, rows = _shape(view), _shape(node)
    if view.target not in RESHAPES or out is None or rows is None or len(out) < 3:
        return None
    lead = list(out[:-1])
    return lead if out[-1] == rows[-1] and math.prod(lead) == rows[0] else None


def _write(graph: fx.Graph, node: fx.Node, lead: list[int]) -> None:
    inner = node.args[0]
    n = _shape(inner)[-1]
    with graph.inserting_before(node):
        viewed = call(graph, aten.view.default, (inner, [*lead, n]), like=inner)
        rows = call(graph, aten.view.default, (viewed, [math.prod(lead), n]), like=node)
    node.replace_input_with(inner, rows)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.mm.default}, tidy=False)


RULE = Rule("lowrank_view", apply,
            "mm(mm(x, Wa^T), Wb^T) viewed to [*lead, N] -> through the inner [*lead, Na] view "
            "(F.linear(F.linear(x, Wa), Wb))")
