"""Rule `pair_order`: routed experts dispatched over their (token, slot) pairs in a permuted
order (vLLM / SGLang style: `order = argsort(ids.flatten())`, the pairs grouped by expert, token
`order // k`, the rows summed back by `index_add_`) -> the pairs in token order, the form rule
`expert_rows` takes:

    order = argsort(flat_ids); rows = f(z[order // k], flat_ids[order], w.flatten()[order])
    acc.index_add_(0, order // k, rows)
    ->  order = arange(P) (the same graph otherwise)

Proof, exact up to the order of the sum: r = `sort(x).indices` of a [P] tensor is a permutation
of range(P). Every node computed from r is row-wise on dim 0 (`expert_rows.rows_from`), so row p
of each is F(r[p]) for one function F (r's value, and outside tensors looked up at it); nothing
else reads them; the index is `r // k` (floor). So out[n] = sum over {p : r[p] // k == n} of
F(r[p]) = sum over {q : q // k == n} of F(q), r being a bijection: the same sum with r the
identity, each token's k rows added in slot order instead of expert order (fp32 rounding only;
on CUDA `index_add_`'s order is not fixed anyway).

Left alone: an index that is not `r // k` with r a sort's indices (a constant non-permutation,
a gather of r, a mask), a sort whose sorted values are read too (they hold the order that r is,
and stay), a node computed from r that mixes rows or is read outside the dispatch (the expert
order kept for something else), an accumulator computed from r.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.expert_rows import index_put_finalize, rows_from
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import call

aten, prims = torch.ops.aten, torch.ops.prims
SORTS = {aten.sort.default, aten.sort.stable}


def _permutation(node) -> bool:
    """The indices of a sort of a 1-D tensor (a permutation of range(P)), the sort's only output
    read: its sorted values carry the same order, which replacing the indices would not change."""
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] == 1):
        return False
    sort = node.args[0]
    return (sort.target in SORTS and isinstance(sort.args[0], fx.Node) and len(sort.users) == 1
            and _shape(sort.args[0]) is not None and len(_shape(sort.args[0])) == 1)


def _floor_div(t, k: int) -> fx.Node | None:
    """r where t is `r // k` (`div(r, k, rounding_mode='floor')` or `floor_divide`)."""
    if not isinstance(t, fx.Node) or len(t.args) != 2 or t.args[1] != k:
        return None
    if t.target is aten.div.Tensor_mode and t.kwargs.get("rounding_mode") == "floor":
        return t.args[0]
    if t.target in (aten.floor_divide.default, aten.floor_divide.Scalar):
        return t.args[0]
    return None


def _site(out: fx.Node):
    found = index_put_finalize(out)
    if found is None:
        return None
    _, t, src = found
    n, p = _shape(out)[0], _shape(src)[0]
    r = _floor_div(t, p // n)
    if not _permutation(r) or _shape(r) != (p,):
        return None
    rows = [rows_from({r}, x, p) for x in (t, src)]
    if None in rows:
        return None
    rows = {r, *rows[0], *rows[1]}
    # r reaches out only through the row region, and nothing else reads the region
    if any(u not in rows and u is not out for node in rows for u in node.users):
        return None
    return r


def arange_like(graph: fx.Graph, r: fx.Node) -> fx.Node:
    """arange(P) in r's dtype and device ([P] r), inserted before r (the identity permutation
    in place of a sort's indices)."""
    v = r.meta["val"]
    with graph.inserting_before(r):
        return call(graph, prims.iota.default, (v.shape[0],),
                    {"start": 0, "step": 1, "dtype": v.dtype, "device": v.device,
                     "requires_grad": False}, like=r)


def _write(graph: fx.Graph, out: fx.Node, r: fx.Node) -> None:
    r.replace_all_uses_with(arange_like(graph, r))


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.index_put.default})


RULE = Rule("pair_order", apply,
            "routed experts over (token, slot) pairs in a sort's order (argsort dispatch, "
            "index_add_ by order // k) -> the pairs in token order")

__all__ = ["RULE", "SORTS", "apply", "arange_like"]
