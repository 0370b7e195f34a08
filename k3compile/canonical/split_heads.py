"""Rule `split_heads`: a tensor's last dim viewed as heads [n·H, K] and the heads cut by a
`split` -> the `split` of the last dim, each piece then viewed into heads: the form
`patterns/kda_decode.py` cuts the short conv's q|k|v output in (`conv.split(W, -1)`, then
`.view(.., H, K)` per piece).

    getitem(split(view(x, [*lead, n*H, K]), H, -2), i)     (spell13: `conv.unflatten(-1,
                                                             (3 * H, K)).split(H, -2)`)
    ->  view(getitem(split(x, H*K, -1), i), [*lead, H, K])

Exact: the same elements, views only. Taken: a `split` (equal or listed sizes) of the
second-to-last dim of a view that only splits x's last dim into [heads, K] (leading dims
unchanged), every piece read by `getitem`. Left alone: splits of other dims, views that also
reshape the leading dims, a split of the head dim K (rule `unbind_split` takes the
`unbind` form of the same cut).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten


def _site(split: fx.Node):
    view, sizes = split.args[0], split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if not (isinstance(view, fx.Node) and view.target in RESHAPES):
        return None
    out, src = static_shape(view), static_shape(view.args[0])
    if out is None or src is None or len(out) != len(src) + 1 or out[:-2] != src[:-1]:
        return None
    if dim not in (len(out) - 2, -2) or out[-2] * out[-1] != src[-1]:
        return None
    if isinstance(sizes, int):
        sizes = [sizes] * (out[-2] // sizes) + ([out[-2] % sizes] if out[-2] % sizes else [])
    if not all(isinstance(s, int) for s in sizes) or sum(sizes) != out[-2]:
        return None
    if not all(u.target is operator.getitem for u in split.users):
        return None
    return view.args[0], list(out), list(sizes)


def _write(graph: fx.Graph, split: fx.Node, site) -> None:
    x, out, sizes = site
    k = out[-1]
    with graph.inserting_before(split):
        cut = call(graph, aten.split_with_sizes.default, (x, [s * k for s in sizes], -1),
                   like=split)
        for get in list(split.users):
            i = get.args[1]
            piece = call(graph, operator.getitem, (cut, i), like=get)
            new = call(graph, aten.view.default, (piece, [*out[:-2], sizes[i], k]), like=get)
            get.replace_all_uses_with(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write,
                         targets={aten.split.Tensor, aten.split_with_sizes.default})


RULE = Rule("split_heads", apply,
            "split(view(x, [.., n*H, K]), H, -2)[i] -> split(x, H*K, -1)[i].view(.., H, K)")

__all__ = ["RULE", "apply"]
