"""Rule `expert_split`: the routed experts' gate and up projections stored as one concatenated
w13 (vLLM's layout: `w13_packed` [E, 2I, L/2], `w13_scale` [E, 2I, L/32]), run as one FC1 and
the result split (`chunk(2, -1)`, `split`, `h[..., :I]` / `h[..., I:]`) -> one FC1 per piece
over the row slices of packed and scale, gathered by the routed ids, the form
`k3compile.math.mxfp4_experts` has with w1 = w13[:, :I], w3 = w13[:, I:]:

    einsum("nl,nkil->nki", z, mxfp4_dequant(w13_packed[:, a:b][ids], w13_scale[:, a:b][ids], lut))

which `patterns/moe_experts.py` matches (its w1 / w3 operands are then the slices).

Runs after `expert_gather` and `expert_gemm`, so FC1 is already the canonical einsum over the
canonical dequant of `packed[ids]` (ids [N, k]): taken where the ops between (z, W) and the
[N, k, 2I] product are exactly the canonical FC1's (op for op, operands and arguments), and
every use of the product is a piece of its last dim (a split, split_with_sizes or step-1
slice). Each output element is the same dot
product over the same row of W; CPU GEMM blocking of the smaller product may round the fp32 sum
differently (within 1e-6 relative), as `expert_gemm` notes. Left alone: a product also read
whole, a split of another dim, a product that is not FC1 over a gathered canonical dequant.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.expert_gather import is_canonical_dequant, same_graph, traced
from k3compile.canonical.region import splice_if_same
from k3compile.canonical.region import static_shape as _shape
from k3compile.math import mxfp4_dequant

aten = torch.ops.aten
_PIECES = {aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor}
_SAME = {aten.permute.default, aten.view.default, aten.clone.default, aten.alias.default}


def _pieces(h: fx.Node) -> list[tuple[fx.Node, int, int]] | None:
    """(node, start, end) for every use of h [N, k, O], each a range of its last dim."""
    width, out = _shape(h)[-1], []
    for u in h.users:
        if u.op != "call_function" or u.target not in _PIECES or u.args[0] is not h:
            return None
        at = 1 if u.target is aten.slice.Tensor else 2
        dim = u.args[at] if len(u.args) > at else u.kwargs.get("dim", 0)
        if dim not in (-1, 2):
            return None
        if u.target is aten.slice.Tensor:
            start, end, step = (list(u.args[2:]) + [None, None, 1][len(u.args) - 2:])[:3]
            start, end = max(start or 0, 0), min(width if end is None else end, width)
            if step != 1 or start >= end:
                return None
            out.append((u, start, end))
            continue
        sizes = u.args[1]
        if isinstance(sizes, int):
            sizes = [min(sizes, width - i) for i in range(0, width, sizes)]
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        for g in u.users:
            if g.target is not operator.getitem:
                return None
            out.append((g, bounds[g.args[1]], bounds[g.args[1] + 1]))
    return out or None


def _fc1(z, w):
    return torch.einsum("nl,nkil->nki", z, w)


def _operands(h: fx.Node, limit: int = 32) -> tuple[fx.Node, fx.Node, list[str]] | None:
    """(z [N, L], W [N, k, O, L], the ops between them and h) up h's cone."""
    n, k, o = _shape(h)
    seen, stack, ops, z, w = set(), [h], [], set(), set()
    while stack and len(ops) <= limit:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        shape = _shape(node)
        if (shape is not None and len(shape) == 4 and shape[:3] == (n, k, o) and shape[3] > 1
                and not (node.target in _SAME and _shape(node.args[0]) == shape)):
            w.add(node)
            continue
        if shape is not None and len(shape) == 2 and shape[0] == n and node is not h:
            z.add(node)
            continue
        if node.op != "call_function":
            return None
        ops.append(str(node.target))
        stack.extend(node.all_input_nodes)
    if stack or len(z) != 1 or len(w) != 1:
        return None
    return next(iter(z)), next(iter(w)), sorted(ops)


def _site(node: fx.Node, cache: dict):
    h = node.args[0]
    shape = _shape(h)
    if h in cache.setdefault("done", set()) or shape is None or len(shape) != 3:
        return None
    pieces = _pieces(h)
    found = _operands(h) if pieces else None
    if found is None:
        return None
    z, w, _ = found
    if _shape(z)[1] != _shape(w)[3] or not same_graph(h, traced(_fc1, [z, w], cache), [z, w]):
        return None
    dequant = is_canonical_dequant(w, cache)
    if dequant is None:
        return None
    packed, scale, table = dequant
    if not (packed.target is aten.index.Tensor and scale.target is aten.index.Tensor
            and len(packed.args[1]) == 1 and packed.args[1] == scale.args[1]
            and _shape(packed.args[1][0]) == shape[:2]):
        return None
    cache["done"].add(h)
    return pieces, (z, packed.args[0], scale.args[0], packed.args[1][0], table)


def _rows(start: int, end: int, cache: dict):
    """FC1 over rows start:end of the stacked experts (one function per range: one trace)."""
    key = ("rows", start, end)
    if key not in cache:
        def fc1_rows(z, packed, scale, ids, lut):
            w = mxfp4_dequant(packed[:, start:end][ids], scale[:, start:end][ids], lut)
            return _fc1(z, w)
        cache[key] = fc1_rows
    return cache[key]


def _write(graph: fx.Graph, node: fx.Node, site: tuple, cache: dict) -> int:
    pieces, inputs = site
    done = 0
    for piece, start, end in pieces:
        gm = traced(_rows(start, end, cache), list(inputs), cache)
        if splice_if_same(graph, gm, list(inputs), piece):
            done = 1
    return done


def apply(graph: fx.Graph) -> int:
    if graph.owning_module is None:
        return 0
    cache: dict = {}
    return rewrite_sites(graph, lambda n: _site(n, cache), lambda g, n, s: _write(g, n, s, cache),
                         targets=_PIECES, sort=True)


RULE = Rule("expert_split", apply,
            "one FC1 over concatenated w13 experts, split after the GEMM -> one FC1 per piece "
            "over row slices of packed / scale, gathered by the routed ids")

__all__ = ["RULE", "apply"]
