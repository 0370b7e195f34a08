"""Rule `paged_write`: a cache-row write through a flat slot mapping (vLLM / SGLang's paged
`slot_mapping`: the cache viewed as [slots * L, R] rows, each new row at `slot * L + position`)
-> the (slot, position) write our model's `cache[slots, pos] = row` traces to, which the MLA
patterns (and rule `token_dim`) read:

    view(index_put(view(cache, [S*L, R]), [view(s*L + p, [-1])], rows), [S, L, R])
        -> index_put(cache, [s, p], view(rows, [B, T, R]))      s [B, 1] or [B], p [B, T] or [B]

(`cache.view(-1, R).index_copy_(0, flat, rows)` and `cache.view(-1, R)[flat] = rows` both trace
to the first line; AOT decomposes index_copy to index_put.) Taken where the write's result is
written back into the cache (a state write), `L` is the cache's second size, the index is
`s * L + p` (either operand order of the add and the mul) with s and p integer tensors that
broadcast to the [B, T] (or [B]) index, and `rows` has one row per index element.

The two writes put the same rows at the same places wherever 0 <= p < L. Positions outside that
range are not a cache row: the flat write would land in a neighbouring slot's rows (another
request's cache, silently, in eager). The compiled step never runs on them: its input check
(`k3compile/validate.py`) reads the mapping's two parts as a slot (dim 0 of the cache) and a
position (dim 1) and refuses such a call before any state is written, in either form.

Left alone: another multiplier than L (not a row of a slot), an accumulating index_put, a flat
index that is not `s * L + p`, rows whose count differs from the index's, and a flat write that
is not written back into a graph input.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.state_write import reaches_state
from k3compile.graph import call

aten = torch.ops.aten
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _static(*shapes) -> bool:
    return all(s is not None and all(isinstance(d, int) for d in s) for s in shapes)


def _integer(node) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and not val.dtype.is_floating_point


def _slot_times(node, rows: int):
    """s where node is s * rows (s an integer tensor), else None."""
    if not isinstance(node, fx.Node) or node.target is not aten.mul.Tensor:
        return None
    a, b = node.args[:2]
    for s, k in ((a, b), (b, a)):
        if k == rows and _integer(s):
            return s
    return None


def slot_and_position(index: fx.Node, rows: int):
    """(s, p, shape) where index is a flat view of s * rows + p of that shape ([B, T] or [B])."""
    comb = index
    while comb.target in VIEWS:
        comb = comb.args[0]
    shape = _shape(comb)
    if comb.target is not aten.add.Tensor or not _static(shape) or len(shape) not in (1, 2):
        return None
    a, b = comb.args[:2]
    for prod, p in ((a, b), (b, a)):
        s = _slot_times(prod, rows)
        if s is not None and _integer(p):
            ok = all(len(_shape(t) or ()) == len(shape) for t in (s, p))
            return (s, p, shape) if ok else None
    return None


def _site(put: fx.Node):
    base, indices, rows = put.args[:3]
    accumulate = put.args[3] if len(put.args) > 3 else put.kwargs.get("accumulate", False)
    if accumulate or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    if base.target not in VIEWS or base.args[0].op != "placeholder" or len(put.users) != 1:
        return None
    cache, (out,) = base.args[0], put.users
    shape = _shape(cache)
    if not _static(shape, _shape(base), _shape(rows)) or len(shape) < 3 or _shape(base) != (
            shape[0] * shape[1], *shape[2:]):
        return None
    if out.target not in VIEWS or _shape(out) != shape or not reaches_state(out):
        return None
    found = slot_and_position(indices[0], shape[1])
    if found is None:
        return None
    s, p, index_shape = found
    if _shape(rows) != (math.prod(index_shape), *shape[2:]):
        return None
    return cache, out, s, p, index_shape


def _write(graph: fx.Graph, put: fx.Node, site) -> None:
    cache, out, s, p, index_shape = site
    rows = put.args[2]
    want = (*index_shape, *_shape(cache)[2:])
    with graph.inserting_before(put):
        if rows.target in VIEWS and _shape(rows.args[0]) == want:
            rows = rows.args[0]
        elif _shape(rows) != want:
            rows = call(graph, aten.view.default, (rows, list(want)), like=put)
        new = call(graph, aten.index_put.default, (cache, [s, p], rows), like=put)
    out.replace_all_uses_with(new)
    graph.erase_node(out)
    graph.erase_node(put)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.index_put.default})


RULE = Rule("paged_write", apply, "cache.view(-1, R) written at slot * L + pos -> "
                                  "index_put(cache, [slot, pos], rows)")
