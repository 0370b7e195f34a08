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

Also: the pointwise ops on a short conv's output go before its permute. A depthwise conv's
output [B, C, T] is permuted to [B, T, C] and activated; where the SiLU (and casts, any of
`gate_up_split`'s pointwise ops on it alone) is written after the permute
(`F.silu(conv(...).transpose(1, 2))`), the rule writes it on the conv output and permutes the
result, the canonical form (`patterns/kda_decode.py`: silu, cast, then transpose). Exact: a
pointwise op computes each element alone. Taken where a permute of a convolution's output (or of
a cast of it) is read only by a pointwise region that reads nothing else (scalars aside) and is
read from outside at one node. Left alone: a permute also read elsewhere, a region that reads
another tensor (a product with a gate), permutes of anything but a conv output.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.noop_view import bypass
from k3compile.canonical.region import CAST, POINTWISE, pointwise_tail, root
from k3compile.graph import call

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


def _conv_tail(node: fx.Node):
    """(region, end) of the pointwise ops after a permute of a conv output, or None."""
    if not _is_permute(node) or not isinstance(node.args[0], fx.Node):
        return None
    if root(node.args[0], {CAST}).target is not aten.convolution.default:
        return None
    tail = pointwise_tail(node, POINTWISE)
    return tail if tail is not None and tail[0] else None


def _pointwise_first(graph: fx.Graph, permute: fx.Node, tail) -> None:
    region, end = tail
    env = {permute: permute.args[0]}
    with graph.inserting_before(region[0]):
        for n in region:
            args, kwargs = fx.map_arg((n.args, n.kwargs), lambda a: env.get(a, a))
            env[n] = call(graph, n.target, args, kwargs, like=n)
        out = call(graph, aten.permute.default, (env[end], permute.args[1]), like=permute)
    end.replace_all_uses_with(out)


def apply(graph: fx.Graph) -> int:
    moved = rewrite_sites(graph, _conv_tail, _pointwise_first, targets={aten.permute.default})
    return moved + rewrite_sites(graph, _source, bypass, tidy=False)


RULE = Rule("permute_fold", apply, "a state read / written through a permute and its inverse "
                                   "-> no permute; pointwise ops after a conv output's permute "
                                   "-> before it")
