"""Rule `pair_restore`: rows computed in a sort's order and put back in their own order by the
inverse permutation (grouped experts, tests/models/spell11_k3.py: the (token, slot) pairs sorted
by expert, the experts run on the sorted pairs, the outputs gathered back through
`argsort(order)`) -> the rows computed in their own order, the form rule `expert_rows` takes:

    experts, order = sort(flat_ids); y = f(z[order // k], experts)     # row p: F(order[p])
    y[argsort(order)]  /  gather(y, 0, argsort(order)[:, None].expand_as(y))
    out.index_put_((order,), y)  /  out.scatter_(0, order[:, None].expand_as(y), y)
    ->  y = f(z[arange(P) // k], flat_ids)   (the restore is y itself)

Proof, exact: r = `sort(x).indices` of a [P] tensor is a permutation of range(P) (whatever the
sort's stability or direction: every row is restored, so the order of ties does not matter), and
its values are x[r]. Every node computed from r or the values is row-wise on dim 0
(`expert_rows.rows_from`'s test), so row p of each is F(r[p]) for one function F; nothing else
reads them but restores: a gather of rows by inv = `sort(r).indices` (ascending: r's inverse),
out[q] = F(r[inv[q]]) = F(q), or a write of the rows at r over a base of their shape,
out[r[p]] = F(r[p]), i.e. out[q] = F(q). With r the identity (and the values x itself) each
row is computed from the same operands and each restore is its rows: the same values, bit for
bit (each row's math is the same op on the same operands; only its batch position moves).

Left alone: a restore by another permutation (the inverse of another sort of the same keys, an
unstable sort's inverse where ties matter, a descending sort of r), an index that is not r or its
inverse broadcast along the row, rows read un-restored (the sorted order kept: a cumulative sum,
an output), a node mixing rows, a write that does not cover a base of the rows' shape, and the
argsort dispatch summed back by `index_add_` (rule `pair_order`'s).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.expert_rows import real_value, rowwise
from k3compile.canonical.pair_order import SORTS, arange_like
from k3compile.canonical.region import static_shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.rewrite import inductor

aten = torch.ops.aten
_MOVES = {aten.unsqueeze.default, aten.expand.default, aten.view.default, aten.reshape.default,
          aten.clone.default, aten.alias.default}
_GATHERS = {aten.gather.default, aten.index.Tensor, aten.index_select.default}


def _items(sort: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(values, indices): the getitems of a sort, or None where anything else reads it."""
    items = ([], [])
    for u in sort.users:
        if u.target is not operator.getitem or u.args[1] not in (0, 1):
            return None
        items[u.args[1]].append(u)
    return items


def _descending(sort: fx.Node) -> bool:
    if "descending" in sort.kwargs:
        return bool(sort.kwargs["descending"])
    positional = sort.args[2:3] if sort.target is aten.sort.default else ()
    return bool(positional[0]) if positional else False


def _broadcast(index: fx.Node, of: fx.Node, rows: fx.Node, flat: bool) -> bool:
    """Whether index, computed from `of` [P] alone, is `of` itself (`flat`) or `of` broadcast
    along every dim past the first to rows' shape, checked on position codes."""
    p, shape = _shape(of)[0], _shape(rows)
    code = torch.arange(p)
    got = real_value(index, {of: code})
    want = code if flat else code.view(p, *[1] * (len(shape) - 1)).expand(shape)
    return got is not None and got.shape == want.shape and torch.equal(got, want)


def _gather_restore(node: fx.Node, rows: set, inverse: set) -> fx.Node | None:
    """y where node reads rows y back through the inverse: y[inv], index_select(y, 0, inv),
    gather(y, 0, inv broadcast); None otherwise."""
    if node.target not in _GATHERS or node.args[0] not in rows:
        return None
    y = node.args[0]
    if node.target is aten.index.Tensor:
        if len(node.args[1]) != 1:
            return None
        index, flat = node.args[1][0], True
    elif node.args[1] != 0:
        return None
    else:
        index, flat = node.args[2], node.target is aten.index_select.default
    inv = [i for i in inverse if i.target is operator.getitem]
    return y if (index in inverse and any(_broadcast(index, i, y, flat) for i in inv)
                 and _shape(node) == _shape(y)) else None


def _write_restore(node: fx.Node, rows: set, order: list[fx.Node]) -> fx.Node | None:
    """y where node writes rows y at the order over a base of y's shape: index_put(base, [r], y)
    or scatter(base, 0, r broadcast, y); None otherwise."""
    if node.target is aten.index_put.default:
        base, index, y = node.args[:3]
        if (len(node.args) > 3 and node.args[3]) or len(index) != 1:
            return None
        index, flat = index[0], True
    elif node.target is aten.scatter.src and node.args[1] == 0:
        base, _, index, y = node.args[:4]
        flat = False
    else:
        return None
    if base in rows or y not in rows or index not in rows or _shape(base) != _shape(y):
        return None
    return y if any(_broadcast(index, r, y, flat) for r in order) else None


def _site(sort: fx.Node):
    with inductor.unset_fake_temporarily():  # position codes are real values
        return _real_site(sort)


def _real_site(sort: fx.Node):
    x, items = sort.args[0], _items(sort)
    shape = _shape(x)
    if items is None or not items[1] or shape is None or len(shape) != 1:
        return None
    values, order = items
    p, rows, inverse, restores = shape[0], {*values, *order}, set(), {}
    nodes = list(sort.graph.nodes)
    for node in nodes[nodes.index(sort) + 1:]:
        if not any(a in rows or a in inverse for a in node.all_input_nodes) or node in rows:
            continue
        if node.op != "call_function":
            return None
        if node.target in SORTS and node.args[0] in order and not _descending(node):
            inverse.add(node)  # argsort(r): r's inverse
        elif node.target is operator.getitem and node.args[0] in inverse:
            if node.args[1] != 1:
                return None
            inverse.add(node)
        elif all(a in inverse or a not in rows for a in node.all_input_nodes) and (
                node.target in _MOVES):
            inverse.add(node)  # the inverse broadcast for a gather
        elif (y := _gather_restore(node, rows, inverse)) is not None:
            restores[node] = y
        elif any(a in inverse for a in node.all_input_nodes):
            return None
        elif rowwise(node, rows, p):
            rows.add(node)
        elif (y := _write_restore(node, rows, order)) is not None:
            restores[node] = y
        else:
            return None
    if not restores or any(_val(n).dtype != _val(y).dtype for n, y in restores.items()):
        return None
    return x, values, order, restores


def _write(graph: fx.Graph, sort: fx.Node, site) -> None:
    x, values, order, restores = site
    for node, y in restores.items():
        node.replace_all_uses_with(y)
    for v in values:
        v.replace_all_uses_with(x)
    iota = arange_like(graph, order[0])
    for node in order:
        node.replace_all_uses_with(iota)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets=SORTS)


RULE = Rule("pair_restore", apply,
            "rows computed in a sort's order and put back by its inverse (gather by argsort, "
            "index_put / scatter at the order) -> the rows in their own order")

__all__ = ["RULE", "apply"]
