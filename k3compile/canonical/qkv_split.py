"""Rule `qkv_split`: q|k|v as ONE projection whose short-conv output (not the GEMM output) is cut
into q, k and v -> one GEMM per piece on the weight's row slices, concatenated before the conv,
and the conv's taps as the concatenation of the pieces' row slices: the canonical form
(`patterns/kda_decode.py`: `cat([q, k, v], -1)` of three linears, `cat([wq, wk, wv])` taps), which
`linear_concat` then fuses with the layer's other in-projections.

    y = view(mm(x, permute(W)))  [B, T, C];  window = cat([state[slots], permute(y)], -1)
    c = convolution(window(.float()), w(.float()), groups=C);  ... split(c', C_i, -1)
    ->  y = cat([view(mm(x, permute(W[a_i:b_i]))) ...], -1);  w = cat([w[a_i:b_i] ...])

Exact up to the GEMM's blocking: a column of a GEMM's output depends only on its weight row, the
conv is depthwise (each channel alone), and a cat of consecutive row slices is the tensor itself.
Taken where the conv's output reaches a split of its channels through pointwise ops, casts and
one permute only (`gate_up_split` names the pointwise ops), each piece wider than one channel; the
split as `split` / `split_with_sizes`, or as a view of the channel dim into (n, ...) unbound on n
(`unflatten(-1, (3, H, D)).unbind(2)`, spell6: n equal pieces).
Left alone: a conv that is not depthwise, pieces of a conv output read whole elsewhere, a GEMM
output read by anything but the window. The conv is a `convolution` or the canonical window sum
multiplied in bf16 (`short_conv.depthwise`; spell10's and spell12's bf16 conv), whose taps are
cut alike.

Also, whatever the GEMMs: the taps of a depthwise conv whose window's new columns are
`cat([q, k, v, ...], -1).permute(0, 2, 1)` held as ONE [C, 1, taps] tensor (vLLM's conv1d weight
of the fused q|k|v, the red-team spelling's `conv_taps`) -> `cat([w[a_i:b_i] ...])`, the row
slices of the cat's pieces, as the canonical form has them (three weights concatenated). Exact
(a cat of consecutive row slices is the tensor). Left alone: taps that already are a cat, pieces
that do not tile the C channels.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.gate_up_split import split_cuts
from k3compile.canonical.region import (
    CAST,
    POINTWISE,
    gemm_of,
    pointwise_tail,
    refresh,
    root,
    shape,
)
from k3compile.canonical.short_conv import depthwise
from k3compile.graph import call

aten = torch.ops.aten


def _past_pointwise(node: fx.Node) -> fx.Node | None:
    """The one node a pointwise region fed by node alone ends at (node where none follows)."""
    tail = pointwise_tail(node, POINTWISE)
    return None if tail is None else tail[1]


def _cuts(conv: fx.Node) -> list[tuple[int, int]] | None:
    """The channel ranges the conv output is split into (through pointwise ops, casts and
    permutes), in order."""
    node, channel = conv, 1
    while (node := _past_pointwise(node)) is not None and len(node.users) == 1:
        (node,) = node.users
        if node.target is aten.permute.default:
            channel = list(node.args[1]).index(channel)
        elif node.target in (aten.split.Tensor, aten.split_with_sizes.default):
            rank = len(shape(node.args[0]))
            dim = node.args[2] if len(node.args) > 2 else 0
            if dim % rank != channel or channel != rank - 1:
                return None
            pieces = split_cuts(node, rank, shape(node.args[0])[channel])
            return None if not pieces else sorted((a, b) for _, a, b in pieces)
        elif node.target in (aten.view.default, aten.reshape.default):
            return _unbound(node, channel)
        else:
            return None
    return None


def _unbound(view: fx.Node, channel: int) -> list[tuple[int, int]] | None:
    """The channel ranges of `view(..., C) -> (..., n, ...)` unbound on its n dim (the channels
    split into n equal pieces, `unflatten(-1, (n, ...)).unbind`), else None."""
    src, dst = shape(view.args[0]), shape(view)
    rank = len(src or ())
    if (src is None or dst is None or channel != rank - 1 or len(dst) <= rank
            or tuple(dst[:channel]) != tuple(src[:channel]) or len(view.users) != 1):
        return None
    (unbind,) = view.users
    n, width = dst[channel], src[channel] // max(dst[channel], 1)
    if (unbind.target is not aten.unbind.int or (unbind.args[1] if len(unbind.args) > 1 else 0)
            % len(dst) != channel or n < 2 or width < 2):
        return None
    return [(i * width, (i + 1) * width) for i in range(n)]


def _operands(conv: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """(window, taps [C, 1, taps], C) of a depthwise conv (either form), under their upcasts."""
    found = depthwise(conv)
    if found is None:
        return None
    x, w = root(found[0], {CAST}), root(found[1], {CAST})
    C = (shape(w) or (0,))[0]
    return (x, w, C) if shape(w) == (C, 1, shape(w)[2]) else None


def _site(conv: fx.Node):
    found = _operands(conv)
    if found is None:
        return None
    x, w, C = found
    if x.target is not aten.cat.default or len(x.args[0]) != 2:
        return None
    new = x.args[0][1]
    if new.target is not aten.permute.default or list(new.args[1]) != [0, 2, 1]:
        return None
    y = new.args[0]
    found = gemm_of(y) if len(y.users) == 1 and len(shape(y)) == 3 else None
    if found and (found[0].target is not aten.mm.default or found[1] is None
                  or found[0].args[1].target is not aten.permute.default):
        found = None
    cuts = _cuts(conv) if found else None
    if not cuts or len(cuts) < 2 or cuts[0][0] != 0 or cuts[-1][1] != C:
        return None
    return y, found, w, cuts


def _taps_site(conv: fx.Node):
    """(taps, piece ranges) of a conv over cat([state, cat(pieces, -1).permute(0, 2, 1)], -1)
    (or a time-major window's transpose, cat([state, cat(pieces, -1)], 1).permute(0, 2, 1))
    whose taps are one tensor (not a cat)."""
    found = _operands(conv)
    if found is None:
        return None
    x, w, C = found
    if w.target is aten.cat.default:
        return None
    if (x.target is aten.permute.default and list(x.args[1]) == [0, 2, 1]
            and x.args[0].target is aten.cat.default and len(x.args[0].args[0]) == 2
            and x.args[0].args[1] == 1):
        pieces = x.args[0].args[0][1]  # a time-major window cat([state, pieces], 1), transposed
    else:
        if x.target is not aten.cat.default or len(x.args[0]) != 2:
            return None
        new = x.args[0][1]
        if new.target is not aten.permute.default or list(new.args[1]) != [0, 2, 1]:
            return None
        pieces = new.args[0]
    if (pieces.target is not aten.cat.default or len(pieces.args[0]) < 2
            or (pieces.args[1] if len(pieces.args) > 1 else 0) % len(shape(pieces)) != 2):
        return None
    cuts, a = [], 0
    for piece in pieces.args[0]:
        b = a + shape(piece)[-1]
        cuts.append((a, b))
        a = b
    return (w, cuts) if a == C and all(b - a > 1 for a, b in cuts) else None


def _cut_taps(graph: fx.Graph, conv: fx.Node, w: fx.Node, cuts) -> None:
    """conv's taps w as the cat of its row slices `cuts`."""
    _, weight, reader = depthwise(conv)
    reader = reader if weight is w else weight  # the conv (its mul), or the taps' upcast
    with graph.inserting_before(reader):
        taps = [call(graph, aten.slice.Tensor, (w, 0, a, b), like=conv) for a, b in cuts]
        w_new = call(graph, aten.cat.default, (taps,), like=conv)
    reader.replace_input_with(w, w_new)


def _rows(graph: fx.Graph, gemm: fx.Node, y: fx.Node, a: int, b: int) -> fx.Node:
    """y's columns [a, b) as the GEMM of the weight's rows [a, b), the way F.linear traces."""
    x, wt = gemm.args[:2]
    if x.target is aten.view.default:  # F.linear flattens x per GEMM
        x = call(graph, aten.view.default, tuple(x.args), like=y)
    rows = call(graph, aten.slice.Tensor, (wt.args[0], 0, a, b), like=y)
    wt = call(graph, aten.permute.default, (rows, [1, 0]), like=y)
    out = call(graph, aten.mm.default, (x, wt), like=y)
    return call(graph, aten.view.default, (out, [*shape(y)[:-1], b - a]), like=y)


def _rewrite(graph: fx.Graph, conv: fx.Node, site) -> None:
    y, (gemm, _), w, cuts = site
    with graph.inserting_before(y):
        parts = [_rows(graph, gemm, y, a, b) for a, b in cuts]
        y_new = call(graph, aten.cat.default, (parts, -1), like=y)
    y.replace_all_uses_with(y_new)
    refresh([y_new])
    _cut_taps(graph, conv, w, cuts)


def _any_site(conv: fx.Node):
    site = _site(conv)
    if site is not None:
        return "gemm", site
    site = _taps_site(conv)
    return None if site is None else ("taps", site)


def _rewrite_any(graph: fx.Graph, conv: fx.Node, site) -> None:
    kind, site = site
    if kind == "gemm":
        _rewrite(graph, conv, site)
    else:
        _cut_taps(graph, conv, *site)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _any_site, _rewrite_any,
                         targets={aten.convolution.default, aten.sum.dim_IntList})


RULE = Rule("qkv_split", apply,
            "one q|k|v GEMM whose depthwise-conv output is split -> one GEMM per piece on weight "
            "row slices, cat before the conv; taps as a cat of row slices (also of any conv over "
            "a cat of pieces)")

__all__ = ["RULE", "apply"]
