"""Rule `expert_pick`: each token's k experts picked from the whole dequantised stack -> picked
as packed bytes and scales, then dequantised: `mxfp4_dequant(packed[ids], scale[ids], lut)`, the
form `k3compile.math.mxfp4_experts` (and so `patterns/moe_experts.py`) has.

Two picks are taken, D = `math.mxfp4_dequant(packed, scale, lut)` [E, O, I] (rule
`mxfp4_dequant` has made any dequant spelling that form) and ids an integer [N, k]:

    D[ids]                                        (index)
    einsum("nke,eio->nkio", one_hot(ids, E), D)   (spell12: a dense one-hot contraction, also
    matmul(one_hot(ids, E), D.flatten(1)).unflatten(-1, (O, I)))

    ->  mxfp4_dequant(packed[ids], scale[ids], lut)                                [N, k, O, I]

The one-hot is read from the graph: `eq(ids[..., None], arange(E))` cast to a float (F.one_hot,
then `.to(dtype)`); the contraction is the site's subgraph from the one-hot and D compared op for
op with the einsum / matmul traced at its shapes (`expert_gather.same_graph`), so another
contraction (over k, a transposed D, a one-hot of other ids or another class count) is no site.

Why it is faithful:
* The gather: the dequant is elementwise per (expert, row, column): each output reads the byte
  and the scale at its own position and the table. Gathering experts before or after it picks the
  same bytes and computes the same values: equal bit for bit.
* The one-hot contraction: sum_e onehot[n, k, e] D[e, o, i] has one term 1 * D[ids[n, k], o, i]
  (exact) and E - 1 terms 0 * D[e, o, i], each a zero when D[e, o, i] is finite; a sum of one
  value and zeros is that value in any order and any accumulate dtype (bf16 GEMMs accumulate in
  fp32 and round once, the value is a bf16 already; TF32 keeps it too: E2M1 x 2^k has two
  mantissa bits), up to the sign of a zero (-0.0 + 0.0 = +0.0: a picked -0.0 may read as +0.0;
  equal as numbers, and the expert GEMMs that read it sum it with other products).
  **Assumed, not proven**: every expert's dequantised weights are finite. A non-finite
  unpicked value (0 * inf = NaN) makes eager's pick NaN where the rewrite returns the picked
  expert's value. MXFP4's values are finite for every scale byte up to 252 (6 * 2^125; bytes
  253-254 overflow fp32 / bf16 with the largest nibbles, 255 is E8M0's NaN); a quantiser
  sets a block's scale from its largest magnitude, so 253 would mean weights near 2^126. The
  rule does not read the scales (they are weights: they may change after the compile); like
  `expert_dense`, it takes the routing's meaning, an unpicked expert does not contribute
  (tests/canonical/test_expert_pick.py shows the difference on an inf).
Left alone: a soft mix (weights that are not a one-hot), a one-hot of a class count other than
D's expert count, a contraction over another dim, a gather of D by several indices or on
another dim, a D that is not the canonical dequant.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, expert_gather, rewrite_sites
from k3compile.canonical.region import CASTS, VIEWS, arange_length, below, splice_if_same
from k3compile.canonical.region import static_shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.math import mxfp4_dequant

aten = torch.ops.aten
_INTS = (torch.int64, torch.int32)


def _einsum(one_hot, d):
    return torch.einsum("nke,eio->nkio", one_hot, d)


def _matmul(one_hot, d):
    return torch.matmul(one_hot, d.flatten(1)).unflatten(-1, d.shape[1:])


CONTRACTIONS = (_einsum, _matmul)


def _picked(packed, scale, ids, lut):
    return mxfp4_dequant(packed[ids], scale[ids], lut)


def _ids(node) -> fx.Node | None:
    """The integer [N, k] tensor `node` is `unsqueeze(ids, -1)` of."""
    if not isinstance(node, fx.Node) or node.target is not aten.unsqueeze.default:
        return None
    ids, dim = node.args
    v = _val(ids)
    return ids if (v is not None and v.dtype in _INTS and _shape(ids) is not None
                   and len(_shape(ids)) == 2 and dim in (-1, 2)) else None


def one_hot(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(ids [N, k], E) where node is `one_hot(ids, E)` cast to a float dtype: values 0 and 1."""
    v = _val(node)
    if v is None or not v.dtype.is_floating_point:
        return None
    while node.op == "call_function" and node.target in CASTS:
        node = node.args[0]
    if node.target is not aten.eq.Tensor:
        return None
    for a, b in (node.args, node.args[::-1]):
        ids, classes = _ids(a), arange_length(b)
        if ids is not None and isinstance(classes, int) and _shape(node) == (
                *_shape(ids), classes):
            return ids, classes
    return None


def _up(node: fx.Node) -> list[fx.Node]:
    """node and the nodes up its chain of view ops."""
    chain = [node]
    while node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
        chain.append(node)
    return chain


def _dequant(node: fx.Node, experts: int, cache: dict):
    """(D, (packed, scale, table)) for the canonical dequant [E, O, I] up node's view chain."""
    for d in _up(node):
        shape = _shape(d)
        if shape is not None and len(shape) == 3 and shape[0] == experts:
            found = expert_gather.is_canonical_dequant(d, cache)
            if found is not None:
                return d, found
    return None


def _gather_site(node: fx.Node, cache: dict):
    """D[ids]: an index of the canonical dequant [E, O, I] along experts by ids [N, k]."""
    d, index = node.args
    ids = index[0] if len(index) == 1 else None
    v, shape = _val(ids), _shape(ids)
    if v is None or v.dtype not in _INTS or shape is None or len(shape) != 2 \
            or len(_shape(d) or ()) != 3:
        return None
    found = expert_gather.is_canonical_dequant(d, cache)
    if found is None:
        return None
    packed, scale, table = found
    return node, [packed, scale, ids, table]


def _contraction_site(gemm: fx.Node, cache: dict):
    """The contraction of one_hot(ids, E) with D over E, from its bmm / mm."""
    for h_side, d_side in (gemm.args[:2], gemm.args[1::-1]):
        h = _up(h_side)[-1]
        picked = one_hot(h)
        if picked is None:
            continue
        ids, experts = picked
        found = _dequant(d_side, experts, cache)
        if found is None:
            continue
        d, (packed, scale, table) = found
        out = below(gemm, (*_shape(ids), *_shape(d)[1:]))
        if out is not None and any(_computes(out, fn, [h, d], cache) for fn in CONTRACTIONS):
            return out, [packed, scale, ids, table]
    return None


def _computes(out: fx.Node, fn, inputs: list[fx.Node], cache: dict) -> bool:
    return expert_gather.same_graph(out, expert_gather.traced(fn, inputs, cache), inputs)


def _site(node: fx.Node, cache: dict):
    if node.target is aten.index.Tensor:
        return _gather_site(node, cache)
    return _contraction_site(node, cache)


def _write(graph: fx.Graph, node: fx.Node, site: tuple, cache: dict) -> bool:
    out, inputs = site
    return splice_if_same(graph, expert_gather.traced(_picked, inputs, cache),
                                        inputs, out)


def apply(graph: fx.Graph) -> int:
    if graph.owning_module is None:
        return 0
    cache: dict = {}
    return rewrite_sites(graph, lambda n: _site(n, cache),
                         lambda g, n, s: _write(g, n, s, cache),
                         targets={aten.index.Tensor, aten.bmm.default, aten.mm.default},
                         sort=True)


RULE = Rule("expert_pick", apply,
            "dequantised experts picked by D[ids] or a one-hot einsum -> "
            "mxfp4_dequant(packed[ids], scale[ids], lut)")

__all__ = ["RULE", "apply", "one_hot"]
