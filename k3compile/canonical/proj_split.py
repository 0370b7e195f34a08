"""Rule `proj_split`: one in-projection GEMM whose output is cut into pieces that tile its
columns, one piece feeding a depthwise short conv -> one GEMM per piece on the weight's row
slices, the form separate linears trace to (`patterns/linear_concat.py`'s KDA q|k|v|g|f_a|b,
which fuses them into one GEMM again; rule `qkv_split` then cuts the conv's piece per q, k, v).

vLLM's KDA (tests/models/spell7_k3.py) keeps q|k|v|g|f_a|b as one weight and cuts the GEMM's
output by `narrow` (an ATen `slice`; also `split` / `split_with_sizes`): [q|k|v] into the conv
window, g into the output gate, f_a into f_b's GEMM, b into β.

    y = mm(x, permute(W));  y[:, a_i:b_i] ...   ->   mm(x, permute(W[a_i:b_i])) ...

Exact up to the GEMM's blocking: a column of a GEMM's output depends only on its weight row (the
argument `gate_up_split` makes for a gate|up GEMM). Taken only where the pieces tile the columns
(no gap, no overlap, nothing else reads the GEMM) and one of them reaches a depthwise
convolution's window through views, permutes and the window's `cat`: a GEMM cut for other uses
keeps its one GEMM here (MLA's kv_a [latent | rope] is one GEMM in the canonical form); rule
`proj_groups`, once the norms are canonical, cuts the other stacked projections. Left alone: a
cut that does not tile the output, a GEMM read whole besides its pieces, no conv.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.gate_up_split import gemm_of_rows, last_dim_pieces
from k3compile.canonical.region import gemm_of, refresh, shape
from k3compile.canonical.short_conv import window_conv

aten = torch.ops.aten
_TO_WINDOW = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
              aten.permute.default, aten.transpose.int, aten.cat.default,
              torch.ops.prims.convert_element_type.default}


def _feeds_conv(node: fx.Node, depth: int = 6) -> bool:
    """node reaches a depthwise convolution's input through `_TO_WINDOW` ops."""
    for user in node.users:
        if user.target is aten.convolution.default and user.args[0] is node:
            w = shape(user.args[1])
            if w is not None and user.args[8] == w[0] and w[1] == 1:
                return True
        elif user.target is aten.unfold.default and window_conv(user, node) is not None:
            return True  # a window sum multiplied in bf16 (short_conv's product sum)
        elif depth and user.target in _TO_WINDOW and _feeds_conv(user, depth - 1):
            return True
    return False


def tiling(node: fx.Node) -> list[tuple[fx.Node, int, int]] | None:
    """node's pieces [(piece, start, end)] in column order, where every user of node cuts it along
    the last dim and the cuts tile its columns (no gap, no overlap) in two pieces or more."""
    pieces = last_dim_pieces(node)
    if not pieces or len(pieces) < 2:
        return None
    pieces = sorted(pieces, key=lambda p: p[1])
    if ([p[1] for p in pieces] != [0, *(p[2] for p in pieces[:-1])]
            or pieces[-1][2] != shape(node)[-1]):
        return None
    return pieces


def _site(node: fx.Node):
    out = shape(node)
    found = gemm_of(node)
    if not found or out is None or len(out) < 2:
        return None
    gemm = found[0]
    w = gemm.args[2] if gemm.target is aten.addmm.default else gemm.args[1]
    if w.target is not aten.permute.default or list(w.args[1]) != [1, 0]:
        return None
    pieces = tiling(node)
    if not pieces or not any(_feeds_conv(p) for p, _, _ in pieces):
        return None
    return found, pieces


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    (gemm, view), pieces = site
    new = []
    for piece, start, end in pieces:
        with graph.inserting_before(piece):
            y = gemm_of_rows(graph, gemm, view, start, end, piece)
        piece.replace_all_uses_with(y)
        new.append(y)
    refresh(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write,
                         targets={aten.mm.default, aten.addmm.default, aten.view.default})


RULE = Rule("proj_split", apply,
            "one in-proj GEMM cut by slices / split into pieces tiling it, one into a short conv "
            "-> one GEMM per piece on the weight's row slices")

__all__ = ["RULE", "apply", "tiling"]
