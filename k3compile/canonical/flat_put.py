"""Rule `flat_put`: whole state rows written at flat element indices by `Tensor.put` -> the row
write `index_put(buf, [slots], rows)` that `buf[slots] = rows` traces to (rule `state_write`'s
canonical form).

spell12 (`tests/models/spell12_k3.py`, `put_rows`) builds each new state out of place as

    per = buf[0].numel();  flat = slots[:, None] * per + arange(per)
    new = buf.put(flat, rows.reshape(len(slots), per))

which AOT decomposes to an index_put into the flattened buffer, viewed back:

    view(index_put(view(buf, [N]), [add(mul(unsqueeze(slots, 1), per), iota(per))],
                   view(rows, [B, per])), buf.shape)
->  index_put(buf, [slots], rows)

Exact: flat index slot·per + i is element i of row `slot` in row-major order, and `rows` viewed
[B, per] lists row b's elements in that order, so both write row slots[b] with rows[b] (two
equal slots: either write wins in both, as index_put leaves it unspecified). Taken only where
per is the buffer's row size, the index's arange runs 0..per-1 step 1, slots is a 1-D integer
tensor, the values reach the view through reshapes and contiguous clones from a tensor shaped
[B, *buf.shape[1:]] (else that view is written), no accumulate, and the flat result is read only
by its view back to buf's shape. Left alone: partial rows (MLA's cache `(slot·L + pos)·(C + R) +
arange`), other strides, accumulating puts.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape, val
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten


def _iota(node, per: int) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.target is torch.ops.prims.iota.default:
        start, step = node.kwargs.get("start", 0), node.kwargs.get("step", 1)
        return node.args[0] == per and start == 0 and step == 1
    if node.target in (aten.arange.default, aten.arange.start):
        args = node.args
        return tuple(args) in ((per,), (0, per))
    return False


def _slots(index, per: int) -> fx.Node | None:
    """slots where index = slots[:, None] * per + arange(per)."""
    if not (isinstance(index, fx.Node) and index.target is aten.add.Tensor
            and len(index.args) == 2):
        return None
    for mul, ar in (index.args, index.args[::-1]):
        if not (_iota(ar, per) and isinstance(mul, fx.Node) and mul.target is aten.mul.Tensor):
            continue
        for col, c in (mul.args, mul.args[::-1]):
            if (c == per and isinstance(col, fx.Node) and col.target is aten.unsqueeze.default
                    and col.args[1] in (1, -1)):
                slots = col.args[0]
                v = val(slots)
                if v is not None and v.dim() == 1 and not v.is_floating_point():
                    return slots
    return None


def _copy(node) -> bool:
    return (isinstance(node, fx.Node) and node.target is aten.clone.default
            and node.kwargs.get("memory_format") in (None, torch.contiguous_format))


def _rows(values: fx.Node, want: tuple[int, ...]) -> fx.Node | None:
    """The tensor of shape `want` the values are a reshape or contiguous copy of (the copies
    skipped: they move no value), or None."""
    node, found = values, None
    while isinstance(node, fx.Node) and (node.target in RESHAPES or _copy(node)):
        node = node.args[0]
        if shape(node) == want:
            found = node
    return found


def _site(back: fx.Node):
    put = back.args[0]
    if not (isinstance(put, fx.Node) and put.target is aten.index_put.default
            and len(put.users) == 1 and not (len(put.args) > 3 and put.args[3])
            and not put.kwargs.get("accumulate", False)):
        return None
    flat, (index, *more), values = put.args[:3]
    if more or not (isinstance(flat, fx.Node) and flat.target in RESHAPES):
        return None
    buf = flat.args[0]
    size = shape(buf)
    if size is None or len(size) < 2 or shape(back) != size or shape(flat) != (val(buf).numel(),):
        return None
    per = val(buf).numel() // size[0]
    slots = _slots(index, per)
    vshape = shape(values)
    if slots is None or vshape is None or vshape != (shape(slots)[0], per):
        return None
    if val(values).dtype != val(buf).dtype:
        return None
    want = (vshape[0], *size[1:])
    rows = _rows(values, want)
    return buf, slots, rows if rows is not None else values, want


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    buf, slots, rows, want = site
    with graph.inserting_before(node):
        if shape(rows) != want:
            rows = call(graph, aten.view.default, (rows, list(want)), like=node)
        new = call(graph, aten.index_put.default, (buf, [slots], rows), like=node)
    node.replace_all_uses_with(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets=RESHAPES)


RULE = Rule("flat_put", apply,
            "buf.put(slots[:, None] * per + arange(per), rows) -> index_put(buf, [slots], rows)")

__all__ = ["RULE", "apply"]
