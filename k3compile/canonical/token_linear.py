"""Rule `token_linear`: the projections of one [B, K] token row, each GEMM's output viewed
[B, 1, N] -> the linears of the row viewed [B, 1, K], the form `F.linear` traces to at T = 1:
`view(x3, [B, K])`, `mm`, `view(., [B, 1, N])` with one [B, 1, K] input x3 that every projection
reads (the form `linear_concat[kda]` is traced on, our model's `KDA.forward`).

A spelling that decodes on [B, D] rows (tests/models/redteam_k3.py, vLLM's flattened tokens) runs
its KDA in-projection on the rows; rule `token_dim` lifts the recurrence it feeds to [B, 1, ...]
and so views each GEMM's output [B, 1, N] (`proj_split` / `proj_groups` having cut the one
in-projection into six): a view after the GEMM where the T form has one before it. A linear of a
row and the same linear of the row with a unit dim inserted are one computation; this rule moves
the unit dim before the GEMMs:

Before: mm(x, permute(W_i)) -> view(., [B, 1, N_i])                     x [B, K], i = 1..n
After:  x3 = view(x, [B, 1, K]);  mm(view(x3, [B, K]), permute(W_i)) -> view(., [B, 1, N_i])

A projection's output may feed one more projection instead of (or besides) its views, itself
viewed [B, 1, M] (KDA's f_a -> f_b, as rule `gemm` leaves `F.linear(x.unsqueeze(1), w)`): that
GEMM reads its input the T form's way too, `view(view(y, [B, 1, N]), [B, N])`.

Exact: every view only inserts or removes a size-1 dim, so each GEMM reads the same tensor (same
elements, strides and dtype) and returns the same values; shapes and dtypes of every value read
outside are unchanged. Taken only where x is a static [B, K] value that is no reshape of a
[B, 1, K] one (that is the T form already), read by at least two GEMMs (a group
`linear_concat` may fuse: a lone linear is matched in either form, and an FFN's last GEMM is
rows on purpose, rule `token_rows`), every one of them F.linear's (x times `permute(W, [1, 0])`,
`mm` or `addmm`, W a parameter or rows of one, as `proj_groups` has it) and read only as above.
Left alone: an x that one of its GEMMs reads otherwise (a GEMM read whole as well, a cast or a
slice before the view, a view that is no unit dim at 1, a GEMM of a computed matrix): the rows
form is then the one its patterns meet (`linear_concat[...,rows]`, `norm_linear`, ...).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape, weight_rows
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten

_GEMMS = (aten.mm.default, aten.addmm.default)
_RESHAPES = RESHAPES | {aten.unsqueeze.default}


def _linear_of(node: fx.Node, x: fx.Node) -> bool:
    """node is F.linear's GEMM of the rows x by a weight."""
    if node.op != "call_function" or node.target not in _GEMMS:
        return False
    operands = node.args[1:3] if node.target is aten.addmm.default else node.args[:2]
    return len(operands) == 2 and operands[0] is x and weight_rows(node)


def _token_views(gemm: fx.Node, rows: int) -> list[fx.Node] | None:
    """gemm's readers, where every one is a reshape of it to [rows, 1, N]; else None."""
    out = static_shape(gemm)
    views = list(gemm.users)
    if out is None or not views or not all(
            v.target in _RESHAPES and v.args[0] is gemm and static_shape(v) == (rows, 1, out[-1])
            for v in views):
        return None
    return views


def _readers(gemm: fx.Node, rows: int):
    """(gemm's [rows, 1, N] views, [(a projection of gemm's output, its views)]), where those are
    all its readers; else None."""
    out = static_shape(gemm)
    if out is None:
        return None
    views, inner = [], []
    for user in gemm.users:
        if _linear_of(user, gemm) and (chained := _token_views(user, rows)) is not None:
            inner.append((user, chained))
        elif user.target in _RESHAPES and user.args[0] is gemm \
                and static_shape(user) == (rows, 1, out[-1]):
            views.append(user)
        else:
            return None
    return (views, inner) if views or inner else None


def _site(x: fx.Node):
    """[(GEMM, its readers)] of every GEMM reading x, where all are such and two at least."""
    shape = static_shape(x)
    if shape is None or len(shape) != 2:
        return None
    rows, k = shape
    if x.op == "call_function" and x.target in _RESHAPES | {aten.squeeze.dim, aten.squeeze.default} \
            and static_shape(x.args[0]) == (rows, 1, k):
        return None  # already F.linear's view of a [B, 1, K] value
    gemms = [u for u in x.users if u.op == "call_function" and u.target in _GEMMS]
    if len(gemms) < 2 or not all(_linear_of(g, x) for g in gemms):
        return None
    found = [(g, _readers(g, rows)) for g in gemms]
    return None if any(r is None for _, r in found) else found


def _as_token(graph: fx.Graph, y: fx.Node, gemm: fx.Node) -> None:
    """gemm reads the rows y as F.linear reads a [B, 1, K] value: `view(view(y, [B, 1, K]),
    [B, K])`."""
    rows, k = static_shape(y)
    before = set()
    for node in graph.nodes:  # (y's views defined before gemm, so that gemm may read them)
        if node is gemm:
            break
        before.add(node)
    y3 = next((u for u in y.users if u in before and u.target is aten.view.default
               and static_shape(u) == (rows, 1, k)), None)
    with graph.inserting_before(gemm):
        if y3 is None:
            y3 = call(graph, aten.view.default, (y, [rows, 1, k]), like=gemm)
        gemm.replace_input_with(y, call(graph, aten.view.default, (y3, [rows, k]), like=gemm))


def _plain_views(graph: fx.Graph, views: list[fx.Node]) -> None:
    """Each reshape to [B, 1, N] as `view`, the op F.linear's trace (and so the patterns) has."""
    for view in views:
        if view.target is not aten.view.default:
            with graph.inserting_after(view):
                new = call(graph, aten.view.default, (view.args[0], list(static_shape(view))),
                           like=view)
            view.replace_all_uses_with(new)
            graph.erase_node(view)


def _write(graph: fx.Graph, x: fx.Node, found) -> None:
    rows, k = static_shape(x)
    gemms = {gemm for gemm, _ in found}
    first = next(n for n in graph.nodes if n in gemms)
    with graph.inserting_before(first):
        x3 = call(graph, aten.view.default, (x, [rows, 1, k]), like=first)
    for gemm, (views, inner) in found:
        with graph.inserting_before(gemm):
            gemm.replace_input_with(x, call(graph, aten.view.default, (x3, [rows, k]), like=gemm))
        _plain_views(graph, views)
        for chained, chained_views in inner:
            _plain_views(graph, chained_views)
            _as_token(graph, gemm, chained)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, tidy=False)


RULE = Rule("token_linear", apply,
            "GEMMs of a [B, K] row each viewed [B, 1, N] -> F.linear of the row viewed [B, 1, K]")

__all__ = ["RULE", "apply"]
