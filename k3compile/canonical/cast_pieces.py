"""Rule `cast_pieces`: a split of an upcast seen through permutes and views -> the split of the
bf16 / fp16 value through them, then an upcast of each piece.

gpt-fast's spelling of KDA (tests/models/spell14_k3.py) runs its short conv and SiLU in bf16
and reads q|k|v off it as `qkv.transpose(1, 2).float().view(B, T, 3, H, K).unbind(2)`: one
upcast of the whole conv output, then the cut, which rule `unbind_split` writes as a split of the
last dim. The `kda_decode` patterns (`k3compile/math.py`'s order) transpose and split the bf16
value and upcast each piece (`cq.float()`); rule `cast_split` moves such a cast, but it runs
before the rules that write these splits (`unbind_split`, `qkv_split`, ...), as rule
`expert_split` needs it to:

    split(M(convert(x, fp32)))      (spell14: M none; its probe `cast`, cast first: M a permute)
    -> [convert(p, fp32) for p in split(M(x))]      (canonical)

M a chain of permutes / transposes / views, each read only by the next. Exact: a cast is
elementwise and these ops move values; the same values, dtypes and shapes.

Taken: a `split` / `split_with_sizes` read only by its pieces whose input is, through M, an fp32
upcast of a bf16 / fp16 value that nothing else reads. Left alone: an upcast also read whole (it
would be computed twice), a chain through a computing op or a node read elsewhere, a downcast
(the patterns round an fp32 conv before the cut: rule `cast_split` says why), an integer cast.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, cast_split, rewrite_sites
from k3compile.canonical.cast_view import swap
from k3compile.canonical.region import half_upcast
from k3compile.graph import RESHAPES

aten = torch.ops.aten
MOVES = {*RESHAPES, aten.permute.default, aten.transpose.int}


def _chain(split: fx.Node) -> list[fx.Node] | None:
    """[the upcast, M's nodes outermost last] under the split, or None."""
    chain, node = [], split.args[0]
    while isinstance(node, fx.Node) and node.target in MOVES and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    if not (half_upcast(node) and len(node.users) == 1):
        return None
    return [node, *reversed(chain)]


def _site(split: fx.Node) -> list[fx.Node] | None:
    if not (split.users and all(u.target is operator.getitem for u in split.users)):
        return None
    return _chain(split)


def _write(graph: fx.Graph, split: fx.Node, chain: list[fx.Node]) -> None:
    for move in chain[1:]:  # the cast after each op of M in turn (as rule cast_view swaps)
        swap(graph, move)
    cast_split._write(graph, split, None)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets=cast_split.SPLITS)


RULE = Rule("cast_pieces", apply, "split(M(x.float())), M permutes / views -> "
                                  "[p.float() for p in split(M(x))]")
