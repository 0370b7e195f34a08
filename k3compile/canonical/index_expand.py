"""Rule `index_expand`: an integer index of an advanced-indexing read or write expanded to the
shape all its indices broadcast to anyway -> the index itself:

    index_put(cache, [expand(s, [B, T]), p], rows)  ->  index_put(cache, [s, p], rows)
    index(x, [expand(s, [B, T]), p])                ->  index(x, [s, p])

spell11 (`tests/models/spell11_k3.py`) writes the MLA latent cache of T verify rows as
`cache.index_put_((slots[:, None].expand(B, T), pos), rows)`; our model's `cache[slots, pos] =
rows` (and the MLA patterns, through rule `token_dim`) leaves the [B, 1] -> [B, T] step to
indexing's broadcast. At T = 3 the expand hid the cache write from mla_decode (near miss
`expand int64[2, 3] where the pattern expects aten.view.default`).

Exact: `index` and `index_put` broadcast their index tensors together before they read or write
(an accumulating put included: the same index list, the same duplicates), so an index already
expanded to that common shape and the unexpanded one name the same elements in the same order.
Taken where every index given is an int64 or int32 tensor of static shape (a bool or uint8
index is a mask, which is not broadcast) and the indices without the expand still broadcast to
the same shape;
chains of expands are taken whole. A site where dropping the expand would change the broadcast
shape (the expand added a dim no other index has, or grew a dim no other index grows) stays.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import val as _val

aten = torch.ops.aten
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}  # indices: args[1]
_INTEGER = (torch.int64, torch.int32)


def _shape(node) -> tuple[int, ...] | None:
    """An integer index's static shape (None: not an integer tensor, or a symbolic size)."""
    v = _val(node) if isinstance(node, fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.dtype not in _INTEGER:
        return None
    return tuple(v.shape) if all(isinstance(n, int) for n in v.shape) else None


def _unexpanded(node: fx.Node) -> fx.Node:
    """The tensor a chain of expands starts from (node itself if it is no expand)."""
    while (node.op == "call_function" and node.target is aten.expand.default
           and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
    return node


def _common(shapes) -> tuple[int, ...] | None:
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None


def _site(node: fx.Node) -> list[fx.Node | None] | None:
    """The node's indices with each removable expand dropped, or None (no site)."""
    if node.op != "call_function" or node.target not in _INDEXING:
        return None
    indices = node.args[1]
    if not isinstance(indices, (list, tuple)) or not indices:
        return None
    given = [i for i in indices if i is not None]
    if any(not isinstance(i, fx.Node) or _shape(i) is None for i in given):
        return None  # a mask, or an index without a known shape
    want = _common([_shape(i) for i in given])
    new = list(indices)
    for k, index in enumerate(indices):
        if index is None or (source := _unexpanded(index)) is index or _shape(source) is None:
            continue
        trial = new[:k] + [source] + new[k + 1:]
        if _common([_shape(i) for i in trial if i is not None]) == want:
            new = trial
    return new if new != list(indices) else None


def _write(graph: fx.Graph, node: fx.Node, indices) -> None:
    node.args = (node.args[0], indices, *node.args[2:])


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets=_INDEXING)


RULE = Rule("index_expand", apply,
            "an index expanded to the indices' broadcast shape -> the index (indexing broadcasts)")
