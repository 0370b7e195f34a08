"""Rule `unbind_split`: a tensor's last dim cut into n equal pieces of heads by a view and an
`unbind` -> the `split` of the last dim, each piece then viewed into heads: the form
`patterns/kda_decode.py` cuts the short conv's q|k|v output in (`conv.split(W, -1)`, then
`.view(B, T, H, K)` per piece).

    getitem(unbind(view(x, [*lead, n, H, K]), -3), i)     (spell6: `unflatten(-1, (3, H, K))
                                                           .unbind(2)`)
    ->  view(getitem(split(x, H*K, -1), i), [*lead, H, K])

Exact: the same elements, views only. Taken: an `unbind` of the third-from-last dim of a view
that only splits x's last dim into [n, H, K] (leading dims unchanged), every piece read by
`getitem`. Left alone: unbinds of other dims (the heads, the tokens), views that also reshape
the leading dims (spell7's flat tokens), a view of more or fewer than three trailing dims.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten


def _site(unbind: fx.Node):
    view = unbind.args[0]
    dim = unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)
    if not (isinstance(view, fx.Node) and view.target in RESHAPES):
        return None
    out, src = _shape(view), _shape(view.args[0])
    if out is None or src is None or len(out) != len(src) + 2 or out[:-3] != src[:-1]:
        return None
    if dim not in (len(out) - 3, -3) or out[-3] * out[-2] * out[-1] != src[-1]:
        return None
    if not all(u.target is operator.getitem for u in unbind.users):
        return None
    return view.args[0], list(out)


def _write(graph: fx.Graph, unbind: fx.Node, site) -> None:
    x, out = site
    width = out[-2] * out[-1]
    with graph.inserting_before(unbind):
        split = call(graph, aten.split.Tensor, (x, width, -1), like=unbind)
        for get in list(unbind.users):
            piece = call(graph, operator.getitem, (split, get.args[1]), like=get)
            new = call(graph, aten.view.default, (piece, [*out[:-3], *out[-2:]]), like=get)
            get.replace_all_uses_with(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.unbind.int})


RULE = Rule("unbind_split", apply,
            "unbind(view(x, [.., n, H, K]), -3)[i] -> split(x, H*K, -1)[i].view(.., H, K)")

__all__ = ["RULE", "apply"]
