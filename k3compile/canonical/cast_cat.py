"""Rule `cast_cat`: a concatenation of pieces cut from fp32 upcasts -> the pieces cut from the
bf16 / fp16 values, concatenated, then one upcast.

A cast is elementwise and cutting (slices, splits, views) and concatenating move values, so the
two orders give the same tensor. spell11 with its checkpoint's bf16 weights (probe
`checkpoint_weights`) upcasts its short conv's [3W, K] taps first (`self.taps.float()`), and rule
`qkv_split` then cuts q's, k's and v's filters off the upcast and concatenates them again;
`patterns/kda_decode.py` (`k3compile/math.py`'s order) concatenates the three bf16 filters and
upcasts the result for the fp32 conv:

    cat([V_1(convert(x_1, fp32)), ..., V_n(convert(x_n, fp32))])     (spell11, after qkv_split)
    convert(cat([V_1(x_1), ..., V_n(x_n)]), fp32)                      (canonical)

V_i a chain of value-moving ops (views, slices, selects, split pieces, permutes). Exact: the
same values, dtype and shape.

Taken: a cat with fp32 output whose every piece is such a chain of an upcast of a bf16 / fp16
value, all of one dtype, where nothing outside the cat reads an upcast or a node of the chains
(so nothing is computed twice). Left alone: a cat with any piece that is no upcast (an fp32
master beside upcast halves: the cat is fp32 by its own values), upcasts from two dtypes, a
downcast (the kda_decode patterns round an fp32 conv output before it is cut: rule `cast_split`
says why a downcast moved broke spell5), a chain through a computing op, an upcast also read
elsewhere.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CAST, half_upcast, val
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}
MOVES = {*RESHAPES, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
         aten.squeeze.dims, aten.permute.default, aten.transpose.int, *SPLITS}


def _chain(piece) -> list[fx.Node] | None:
    """[upcast, ..., piece]: the value-moving ops from an upcast down to piece, or None."""
    chain = []
    node = piece
    while isinstance(node, fx.Node) and not half_upcast(node):
        chain.append(node)
        if node.target is operator.getitem:  # a split's piece
            node = node.args[0]
            if not (isinstance(node, fx.Node) and node.target in SPLITS):
                return None
            chain.append(node)
        elif node.target not in MOVES:
            return None
        node = node.args[0]
    return [node, *reversed(chain)] if isinstance(node, fx.Node) else None


def _site(cat: fx.Node) -> list[list[fx.Node]] | None:
    """Each piece's chain, where the cat is of pieces cut from upcasts of one low dtype read by
    nothing else."""
    if val(cat) is None or val(cat).dtype != torch.float32 or not cat.args[0]:
        return None
    chains = [_chain(p) for p in cat.args[0]]
    if any(c is None for c in chains) or len({val(c[0].args[0]).dtype for c in chains}) != 1:
        return None
    inside = {n for c in chains for n in c} | {cat}
    if any(u not in inside for n in inside - {cat} for u in n.users):
        return None
    return chains


def _write(graph: fx.Graph, cat: fx.Node, chains) -> None:
    moved: dict[fx.Node, fx.Node] = {}  # a node of the chains -> the same op on the low values
    with graph.inserting_before(cat):
        for chain in chains:
            moved.setdefault(chain[0], chain[0].args[0])
            for node in chain[1:]:
                if node not in moved:
                    moved[node] = call(graph, node.target, (moved[node.args[0]], *node.args[1:]),
                                       node.kwargs, like=cat)
        low = call(graph, aten.cat.default, ([moved[c[-1]] for c in chains], *cat.args[1:]),
                   cat.kwargs, like=cat)
        up = call(graph, CAST, (low, torch.float32), like=cat)
    cat.replace_all_uses_with(up)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.cat.default})


RULE = Rule("cast_cat", apply, "cat of pieces cut from fp32 upcasts of bf16 / fp16 values -> "
                               "the pieces cut from those values, cat, one upcast")

__all__ = ["RULE", "apply"]
