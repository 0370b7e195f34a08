"""Rule `cast_select`: per-token upcasts of a value's token selects -> the upcast of the value,
then the selects.

Code that runs a recurrence token by token often casts each token's row as it reads it
(tests/models/spell6_k3.py: `v[:, i].flatten(0, 1).float()` in its delta rule, one cast per
token after rule `head_rows` unflattens the rows), where `k3compile/math.py` and the
`kda_decode` pattern cast the whole [B, T, H, D] value once and select its tokens after
(`v.float().view(B, T, H, D)`, then `v[:, t]` in `delta_rule_step`):
    select(x, d, i) -> convert_element_type(fp32)            (spell6, one per token i)
    convert_element_type(x, fp32) -> select(d, i)            (canonical, one cast)
Exact: a cast is elementwise, a select moves no value; the same values, dtype and shape.

Taken: a bf16 / fp16 value x every reader of which is a `select` on one dim, the selects
covering every index of that dim, each select read only by casts to one wider float dtype (so
casting x whole casts what the selects cast, no more). Left alone: a select also read in x's
dtype, selects that leave an index unread, selects on different dims, casts to different dtypes,
a downcast, and x read other than by its selects.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CAST, LOW, val
from k3compile.graph import call

aten = torch.ops.aten


def _site(x: fx.Node) -> torch.dtype | None:
    """The wider dtype every select of x is cast to, where x is a site."""
    v = val(x)
    if v is None or v.dtype not in LOW or not x.users or not all(
            isinstance(d, int) for d in v.shape):
        return None  # a symbolic size: which indices the selects cover is not known
    dims, seen, wide = set(), set(), set()
    for sel in x.users:
        if sel.target is not aten.select.int or sel.args[0] is not x or not sel.users:
            return None
        dim, index = sel.args[1] % v.dim(), sel.args[2] % v.shape[sel.args[1]]
        dims.add(dim)
        seen.add(index)
        for cast in sel.users:
            if cast.target is not CAST or not isinstance(cast.args[1], torch.dtype):
                return None
            wide.add(cast.args[1])
    if len(dims) != 1 or len(wide) != 1:
        return None
    (dim,), (dtype,) = dims, wide
    if seen != set(range(v.shape[dim])) or not (
            dtype.is_floating_point and dtype.itemsize > v.dtype.itemsize):
        return None
    return dtype


def _write(graph: fx.Graph, x: fx.Node, dtype: torch.dtype) -> None:
    selects = list(x.users)
    with graph.inserting_after(x):
        whole = call(graph, CAST, (x, dtype), like=selects[0])
    for sel in selects:
        with graph.inserting_after(sel):
            wide = call(graph, aten.select.int, (whole, *sel.args[1:]), like=sel)
        for cast in list(sel.users):
            cast.replace_all_uses_with(wide)
            graph.erase_node(cast)
        graph.erase_node(sel)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, tidy=False)


RULE = Rule("cast_select", apply, "per-token upcasts of a low-precision value's selects covering "
                                  "its dim -> the upcast of the value, then the selects")
