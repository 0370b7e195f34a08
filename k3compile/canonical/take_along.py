"""Rule `take_along`: `torch.take_along_dim(x, ids, dim)` of top-k ids -> `torch.gather(x, dim,
ids)`, the form `math.route_top_k` traces to.

A JAX port reads the unbiased routing scores at the top-k ids with `take_along_dim` (numpy's
`take_along_axis`, spell9). Its decomposition broadcasts both operands to each other's shape
and wraps the ids into range,

    gather(expand(x, x.shape), dim, remainder(expand(ids, ids.shape), x.shape[dim]))

where the moe_route pattern (and `torch.gather`) reads `gather(x, dim, ids)`. Taken only where
both expands give their input's own shape back (no broadcast) and the ids are the indices of a
`topk` over `dim` of a tensor of x's size there: ids in [0, size), on which the remainder is the
identity. Exact: the same elements gathered. Ids from elsewhere (possibly negative: the
remainder wraps them) and broadcasting reads stay as they are.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape as _shape

aten = torch.ops.aten


def _own_expand(node) -> fx.Node | None:
    """The input of an `expand` to its input's own shape, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is aten.expand.default and isinstance(node.args[0], fx.Node)):
        return None
    shape = _shape(node)
    return node.args[0] if shape is not None and _shape(node.args[0]) == shape else None


def _topk_indices(node, dim: int, size: int) -> bool:
    """node = topk(t, k, dim)[1] with t.shape[dim] == size."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is operator.getitem and node.args[1] == 1):
        return False
    topk = node.args[0]
    if not (isinstance(topk, fx.Node) and topk.target is aten.topk.default):
        return False
    shape = _shape(topk.args[0])
    if shape is None:
        return False
    tdim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
    return tdim % len(shape) == dim % len(shape) and shape[dim] == size


def _site(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(x, ids) of node = gather(expand(x), dim, remainder(expand(ids), size))."""
    if len(node.args) != 3 or node.kwargs:
        return None
    src, dim, index = node.args
    x = _own_expand(src)
    shape = _shape(x) if x is not None else None
    if shape is None or not isinstance(dim, int):
        return None
    size = shape[dim]
    if not (isinstance(index, fx.Node) and index.target is aten.remainder.Scalar
            and index.args[1] == size and len(index.users) == 1):
        return None
    ids = _own_expand(index.args[0])
    if ids is None or not _topk_indices(ids, dim, size):
        return None
    return x, ids


def _write(graph: fx.Graph, node: fx.Node, site: tuple[fx.Node, fx.Node]) -> None:
    x, ids = site
    node.args = (x, node.args[1], ids)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.gather.default})


RULE = Rule("take_along", apply, "take_along_dim(x, topk ids, dim) -> gather(x, dim, ids)")
