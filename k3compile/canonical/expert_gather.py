"""Rule `expert_gather`: routed MXFP4 experts gathered by the flattened top-k ids (vLLM style,
`packed.index_select(0, ids.flatten())`, dequantised as [N*k, O, I], then `view(N, k, O, I)`)
-> gathered by the [N, k] ids themselves, `mxfp4_dequant(packed[ids], scale[ids], lut)`, the
form `k3compile.math.mxfp4_experts` (and so `patterns/moe_experts.py`) has.

Runs after `mxfp4_dequant`, so the dequant between the gathers and the view is already the
canonical one (`math.mxfp4_dequant`), whatever it was spelled as. Taken: a view [N, k, O, I] of
that dequant over `index(packed, [f])` and `index(scale, [f])` (or `index_select(., 0, f)`) with
f [N*k] a reshape of one integer [N, k] tensor (the same for both), the dequant used only by
the view. The same elements in the same order: equal bit for bit. Left alone: gathers by
different index tensors, an index that is not a reshape of an [N, k] tensor, a view that does
not split N*k into (N, k), a dequant that is not the canonical one (compared op for op, operands
and arguments, with the canonical trace), or one also read flat.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import splice_if_same
from k3compile.canonical.region import static_shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.graph import RESHAPES
from k3compile.math import mxfp4_dequant
from k3compile.rewrite import inductor

aten = torch.ops.aten
_GATHERS = {aten.index.Tensor, aten.index_select.default}


def _is_table_gather(node: fx.Node) -> bool:
    """An E2M1 lookup `lut[codes]`: an index of a float [16] table."""
    table = node.args[0] if node.target is aten.index.Tensor else None
    v = _val(table)
    return v is not None and tuple(v.shape) == (16,) and v.dtype.is_floating_point


def dequant_roots(out: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(packed, scale, table) of a dequant ending at out: the two uint8 tensors up from out (the
    first uint8 node that is not a nibble op on each path) and the one [16] table it reads."""
    seen, stack, ops, roots, tables = set(), [out], [], [], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        v = _val(n)
        if n is not out and v is not None and v.dtype == torch.uint8 and n.target not in (
                aten.bitwise_and.Scalar, aten.__rshift__.Scalar):
            roots.append(n)
            continue
        if n.op != "call_function" or v is None or len(ops) > 64:
            return None
        ops.append(str(n.target))
        if _is_table_gather(n):
            tables.add(n.args[0])
            stack.extend(i for i in n.args[1] if isinstance(i, fx.Node))
        else:
            stack.extend(n.all_input_nodes)
    if len(roots) != 2 or len(tables) != 1:
        return None
    packed, scale = sorted(roots, key=lambda r: -_shape(r)[-1])  # packed [.., W], scale [.., W/16]
    return packed, scale, next(iter(tables))


def traced(fn, inputs: list[fx.Node], cache: dict) -> fx.GraphModule:
    """fn traced as the model's graph is (Inductor's joint passes), on the inputs' fake values;
    one trace per function, shapes and dtypes."""
    vals = [n.meta["val"] for n in inputs]
    key = (fn, tuple((tuple(v.shape), v.dtype) for v in vals))
    if key not in cache:
        with torch._guards.detect_fake_mode(vals):
            cache[key] = inductor.fwd_only_joint(fn, vals)
    return cache[key]


def same_graph(out: fx.Node, gm: fx.GraphModule, inputs: list[fx.Node]) -> bool:
    """Whether out computes gm's output from inputs (gm's placeholders, in order) op for op: the
    same targets, the same non-node arguments, the same operands in the same positions."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (want,) = torch.utils._pytree.tree_leaves(next(n for n in gm.graph.nodes
                                                   if n.op == "output").args)
    bound, memo = dict(zip(placeholders, inputs)), {}

    def equal(g, t) -> bool:
        if isinstance(t, fx.Node) != isinstance(g, fx.Node):
            return False
        if not isinstance(t, fx.Node):
            return type(g) is type(t) and g == t
        if t in bound:
            return bound[t] is g
        if (g, t) not in memo:
            memo[g, t] = False  # no cycles in a DAG; guards a revisit
            gl = torch.utils._pytree.tree_leaves((g.args, g.kwargs))
            tl = torch.utils._pytree.tree_leaves((t.args, t.kwargs))
            memo[g, t] = (g.op == t.op == "call_function" and g.target == t.target
                          and len(gl) == len(tl) and all(map(equal, gl, tl)))
        return memo[g, t]

    return equal(out, want)


def is_canonical_dequant(out: fx.Node, cache: dict) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(packed, scale, table) if out is `math.mxfp4_dequant(packed, scale, table)` as traced."""
    found = dequant_roots(out)
    if found is None:
        return None
    packed, scale, table = found
    if not same_graph(out, traced(mxfp4_dequant, [packed, scale, table], cache),
                      [packed, scale, table]):
        return None
    return packed, scale, table


def _flat_gather(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(source, flat index) of `index(src, [f])` / `index_select(src, 0, f)`, f 1-D."""
    if node.target is aten.index.Tensor and len(node.args[1]) == 1:
        src, f = node.args[0], node.args[1][0]
    elif node.target is aten.index_select.default and node.args[1] == 0:
        src, f = node.args[0], node.args[2]
    else:
        return None
    return (src, f) if _shape(f) is not None and len(_shape(f)) == 1 else None


def _unflattened(f: fx.Node, n: int, k: int) -> fx.Node | None:
    """The integer [N, k] tensor f [N*k] is a reshape of."""
    while isinstance(f, fx.Node) and f.op == "call_function" and f.target in RESHAPES:
        f = f.args[0]
        v = _val(f)
        if v is not None and tuple(v.shape) == (n, k) and v.dtype in (torch.int64, torch.int32):
            return f
    return None


def _gathered(p, s, ids, lut):
    return mxfp4_dequant(p[ids], s[ids], lut)


def _site(view: fx.Node, cache: dict):
    src, out = view.args[0], _shape(view)
    flat = _shape(src)
    if (out is None or flat is None or len(out) != len(flat) + 1 or out[2:] != flat[1:]
            or out[0] * out[1] != flat[0] or len(src.users) != 1):
        return None
    found = is_canonical_dequant(src, cache)
    if found is None:
        return None
    packed, scale, table = found
    gathers = [_flat_gather(packed), _flat_gather(scale)]
    if None in gathers:
        return None
    ids = {_unflattened(f, out[0], out[1]) for _, f in gathers}
    if len(ids) != 1 or None in ids:
        return None
    return gathers[0][0], gathers[1][0], ids.pop(), table


def _write(graph: fx.Graph, view: fx.Node, site: tuple, cache: dict) -> bool:
    inputs = list(site)
    return splice_if_same(graph, traced(_gathered, inputs, cache), inputs, view)


def apply(graph: fx.Graph) -> int:
    if graph.owning_module is None:
        return 0
    cache: dict = {}
    return rewrite_sites(graph, lambda n: _site(n, cache), lambda g, n, s: _write(g, n, s, cache),
                         targets=RESHAPES, sort=True)


RULE = Rule("expert_gather", apply,
            "MXFP4 experts gathered by flattened top-k ids + view(N, k, ...) -> "
            "mxfp4_dequant(packed[ids], scale[ids], lut) with ids [N, k]")

__all__ = ["RULE", "apply", "dequant_roots", "is_canonical_dequant", "same_graph", "traced"]
