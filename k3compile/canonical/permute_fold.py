"""Rule `permute_fold`: a state read or written through a permute and its inverse -> no permute.

A layout handed back and forth between two pieces of code transposes twice: Moonshot's KDA layer
asks fla for the recurrent state in V-first layout (`transpose_state_layout=True`), so a cache
that keeps the state [S, H, K, V] (the layout `k3compile/math.py`'s delta rule and the
`kda_decode` pattern read) hands the gathered rows out transposed and fla's entry point transposes
them back; the new state makes the same round trip on its way into the buffer. Our model reads and
writes the state as it is. Exact: permutes compute nothing.

Taken: `permute(permute(x, p), q)` composing to the identity where x is a state read (`index`, a
gather by slots) or where the pair only feeds a state write (`index_put`'s value), directly or
through views (at batch 1 `buf[slots] = value` views the value without its leading size-1 dim
first). Left alone:
other permute pairs, which einsum's lowering writes inside the patterns' own forms (MLA), a pair
that does not cancel, and a read by the graph's output (it would alias its input).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.noop_view import bypass

aten = torch.ops.aten
_WRITES = {aten.index_put.default, aten.index_put_.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.squeeze.default}


def _is_permute(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is aten.permute.default)


def _dims(node: fx.Node) -> list[int]:
    rank = node.meta["val"].dim()
    return [d % rank for d in node.args[1]]


def _cancels(outer: fx.Node) -> bool:
    inner = outer.args[0]
    if not (_is_permute(inner) and "val" in outer.meta and "val" in inner.meta):
        return False
    p, q = _dims(inner), _dims(outer)
    return [p[i] for i in q] == list(range(len(q)))


def _at_state(outer: fx.Node) -> bool:
    source = outer.args[0].args[0]
    read = isinstance(source, fx.Node) and source.target is aten.index.Tensor
    return read or _only_written(outer)


def _only_written(node: fx.Node) -> bool:
    """Every use of node is a state write's value, directly or through views of it."""
    return bool(node.users) and all(
        (u.target in _WRITES and len(u.args) > 2 and u.args[2] is node)
        or (u.target in _VIEWS and u.args[0] is node and _only_written(u)) for u in node.users)


def _source(outer: fx.Node) -> fx.Node | None:
    """What the two permutes read, where outer undoes inner at a state read or write."""
    if not (_is_permute(outer) and _cancels(outer) and _at_state(outer)):
        return None
    return outer.args[0].args[0]


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _source, bypass, tidy=False)


RULE = Rule("permute_fold", apply, "a state read / written through a permute and its inverse "
                                   "-> no permute")
