"""Rule `split_rows`: a split of the channels of token rows flattened from [B, T, C], each piece
viewed back to [B, T, ...], -> the split of the [B, T, C] value itself, the form the
`kda_decode` pattern cuts its conv output in (`conv.transpose(1, 2).split(W, -1)`, each piece
viewed [B, T, H, D]).

spell10 (`tests/models/spell10_k3.py`, a serving engine's KDA) flattens the conv output to
[N, 3W] rows before its q | k | v split, `qkv.view(b * t, 3 * w).split(w, -1)`, and views each
piece `[B, T, H, D]` after it (its probe `kda_split_rows` splits the [B, T, 3W] value):

    split(view(y [B, T, C], [B*T, C]), w, -1)[i] -> view(., [B, T, *s])
    ->  view(split(y, w, -1)[i], [B, T, *s])          (the view dropped where s = [w])

Bit for bit: the same elements (row n of the flat value is (n // T, n % T) of y; a split of the
last dim keeps the rows). The flattening may be a reshape's copy (`clone` of a transposed conv
output at T > 1); the pieces are then views of the transposed value, as the canonical form's.
A piece may be cast first (spell10 in bf16: `qkv.view(b * t, 3 * w).float().split(..)`, the
cast moved after the split by rule `cast_split`), each cast then read only by such views: the
cast moves to the [B, T, w] piece (elementwise, the same values). A `split_with_sizes` (`split([w, w, w], -1)`, spell10's other idiom there) stays one, with its
sizes (rule `equal_split`, later, makes it a `split`). Taken on the last dim only, where every piece is read only by views whose two leading dims are
(B, T). Left alone: a piece read flat (as [N, w] rows) by anything else, a split of another dim,
a flattening that mixes tokens with channels ([B, T, C] -> [B, T*C]).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CAST, shape
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten


def _unflattened(flat: fx.Node) -> fx.Node | None:
    """y [B, T, C] where flat = view(y, [B*T, C]) (or view(clone(y)), a reshape's copy)."""
    if not (isinstance(flat, fx.Node) and flat.target in RESHAPES and len(flat.users) == 1):
        return None
    y = flat.args[0]
    if (isinstance(y, fx.Node) and y.target is aten.clone.default and len(y.users) == 1
            and set(y.kwargs) <= {"memory_format"}):
        y = y.args[0]
    sy, sf = shape(y), shape(flat)
    if sy is None or sf is None or len(sy) != 3 or len(sf) != 2:
        return None
    return y if [sy[0] * sy[1], sy[2]] == list(sf) else None


def _site(split: fx.Node):
    """(y, width or sizes) where split cuts the last dim of [B*T, C] rows flattened from y,
    every piece read by views to [B, T, ...] only."""
    flat, width = split.args[0], split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if split.kwargs.keys() - {"dim"} or dim not in (-1, 1):
        return None
    y = _unflattened(flat)
    if y is None:
        return None
    bt = list(shape(y)[:2])
    for get in split.users:
        if get.target is not operator.getitem or not get.users:
            return None
        for reader in get.users:
            views = reader.users if reader.target is CAST else (reader,)
            if not views or any(v.target not in RESHAPES or list(shape(v)[:2]) != bt
                                for v in views):
                return None
    return y, width


def _view_back(graph: fx.Graph, piece: fx.Node, view: fx.Node) -> None:
    if list(shape(view)) == list(shape(piece)):
        view.replace_all_uses_with(piece)
        return
    with graph.inserting_before(view):
        new = call(graph, aten.view.default, (piece, list(shape(view))), like=view)
    view.replace_all_uses_with(new)


def _write(graph: fx.Graph, split: fx.Node, site) -> None:
    y, width = site
    with graph.inserting_before(split):
        cut = call(graph, split.target, (y, width, -1), like=split)
    for get in list(split.users):
        with graph.inserting_before(get):
            piece = call(graph, operator.getitem, (cut, get.args[1]), like=get)
        for reader in list(get.users):
            if reader.target is not CAST:
                _view_back(graph, piece, reader)
                continue
            with graph.inserting_before(reader):
                cast = call(graph, CAST, (piece, *reader.args[1:]), reader.kwargs, like=reader)
            for view in list(reader.users):
                _view_back(graph, cast, view)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write,
                         targets={aten.split.Tensor, aten.split_with_sizes.default})


RULE = Rule("split_rows", apply,
            "split(view(y [B, T, C], [B*T, C]), w, -1) pieces viewed [B, T, ...] -> "
            "split(y, w, -1) pieces (split_with_sizes too)")

__all__ = ["RULE", "apply"]
