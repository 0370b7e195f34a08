"""Rule `window_stack`: a short conv's windows stacked from shifted slices of the window tensor ->
`xs.unfold(-1, K, 1)`, the form rule `short_conv` reads as one depthwise convolution.

spell12 (`tests/models/spell12_k3.py`, `KDA.conv`) builds the windows of its T new columns as

    xs = cat([state, x.transpose(1, 2)], -1)                          [B, C, K-1+T]
    windows = stack([xs[..., j:j + T] for j in range(K)], -1)         [B, C, T, K]

then contracts them with the taps (`vecdot` or `(windows * taps).sum(-1)`). The stack traces to a
cat of K unsqueezed slices on a new last dim; the slice of the last T columns is traced as the
cat's input itself (the transposed x, a second permute of the same tensor). The rule writes

    windows = unfold(xs, -1, K, 1)        windows[b, c, t, j] = xs[b, c, t + j]

Exact: the same elements in the same places (unfold is a view of them). Any float dtype since
session 34: a bf16 window contracted in bf16 (each product rounded, then the sum) is then
`short_conv`'s canonical product sum, which `kda_decode`'s `conv_products_rounded` computes bit
for bit. (Until then fp32 only: rule `conv_einsum` took that sum to 2 ulps, and on spell12's
bf16 step that raised the compiled step's logits error against eager from 2.9e-2 to 5.1e-2 at
the first step, over TOL["diffsuite_bf16"], 5e-2; conv_einsum now leaves it.) Taken
only where there are K >= 2 pieces, piece j the columns [j, j + T) of one 3-D xs (a slice of
it, or, where xs is a cat on its last dim, the input that holds exactly those columns), all
unsqueezed at the last dim and concatenated there, xs's last dim K - 1 + T long. Left alone: pieces out of order, of
another width or step, of two tensors, or stacked on another dim.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape, val
from k3compile.graph import call

aten = torch.ops.aten
END = 2**63 - 1


def same(a, b) -> bool:
    """a and b compute the same value: one node, or the same call on the same arguments."""
    return a is b or (isinstance(a, fx.Node) and isinstance(b, fx.Node)
                      and a.op == b.op == "call_function" and a.target is b.target
                      and a.args == b.args and a.kwargs == b.kwargs)


def _slice_of(piece: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(xs, start, end) where piece = xs[..., start:end] (step 1) of a 3-D xs."""
    if piece.target is not aten.slice.Tensor:
        return None
    xs, dim, start, end, step = (*piece.args, *(0, None, None, 1)[len(piece.args) - 1:])
    size = shape(xs)
    if size is None or len(size) != 3 or dim % 3 != 2 or step != 1:
        return None
    length = size[2]
    start = 0 if start is None else start + length if start < 0 else start
    end = length if end is None or end >= length else end + length if end < 0 else end
    return xs, start, end


def _cat_input(piece: fx.Node, xs: fx.Node, T: int) -> bool:
    """piece is the input of the last-dim cat xs that holds its last T columns."""
    if xs.target is not aten.cat.default or len(xs.args) < 2 or xs.args[1] % 3 != 2:
        return False
    last = xs.args[0][-1]
    return shape(last) is not None and shape(last)[2] == T and same(piece, last)


def _site(cat: fx.Node):
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else 0
    out = shape(cat)
    if out is None or len(out) != 4 or dim % 4 != 3 or len(parts) < 2 or len(parts) != out[3]:
        return None
    pieces = []
    for p in parts:
        if not (isinstance(p, fx.Node) and p.target is aten.unsqueeze.default
                and p.args[1] % 4 == 3 and len(p.users) == 1):
            return None
        pieces.append(p.args[0])
    K, T = len(pieces), out[2]
    sliced = [_slice_of(p) for p in pieces]
    sources = {s[0] for s in sliced if s is not None}
    if len(sources) != 1:
        return None
    (xs,) = sources
    if shape(xs) != (out[0], out[1], K - 1 + T) or not val(xs).dtype.is_floating_point:
        return None
    for j, (p, s) in enumerate(zip(pieces, sliced)):
        if s is None and not (j == K - 1 and _cat_input(p, xs, T)):
            return None
        if s is not None and s[1:] != (j, j + T):
            return None
    return xs, K


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    xs, K = site
    with graph.inserting_before(node):
        new = call(graph, aten.unfold.default, (xs, 2, K, 1), like=node)
    node.replace_all_uses_with(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.cat.default})


RULE = Rule("window_stack", apply,
            "stack([xs[..., j:j + T] for j in range(K)], -1) -> xs.unfold(-1, K, 1)")

__all__ = ["RULE", "apply", "same"]
