"""Rule `conv_merge`: KDA's short conv written per projection (one depthwise conv for each of q,
k and v, each over its own slice of one conv state) -> the one q|k|v conv of the canonical form
(`patterns/kda_decode.py`, `k3compile/math.py`).

fla's `ShortConvolution` is per projection, so Moonshot's `KimiDeltaAttention` (and any code
built on it) runs three convs, each with its own state. Where the states are slices of one
gathered buffer (k3compile.adapt keeps them as one [slots, 3W, taps - 1] buffer), the graph holds,
per projection i with channels [a_i, b_i) of the state:

    window_i = cat([split(state[slots], .., 1)[i], x_i.permute(0, 2, 1)], -1)   [B, C_i, taps-1+T]
    y_i      = post(convolution(window_i(.float()), w_i(.float()), groups=C_i))  e.g. silu, cast,
                                                                                  permute
    write    = index_put(state, [slots], cat([window_i[..., T:] ...], 1))

and the rule writes the canonical form:

    window = cat([state[slots], cat([x_i ...], -1).permute(0, 2, 1)], -1)        [B, ΣC, taps-1+T]
    y      = post(convolution(window(.float()), cat([w_i ...])(.float()), groups=ΣC))
    y_i    = split(y, C, d)[i]      (d: where post moved the channel dim)
    write  = index_put(state, [slots], window[..., T:])

Exact: a depthwise conv computes each channel alone, `post` is the same pointwise chain (and at
most one permute) in every branch, so applying it to the concatenation and splitting gives the
same values; the casts are exact upcasts, applied to the concatenation instead of the pieces.

Taken: >= 2 depthwise convs (stride 1, no padding or dilation, weights [C_i, 1, taps] of one
dtype, inputs of one dtype, no bias or every one a bias) whose state pieces are the consecutive
slices, together the whole, of one tensor along dim 1, with equal taps, batch and T, and
isomorphic `post` chains. Left alone: convs over separate state buffers (no single buffer to
write the merged window to), pieces of two tensors, overlapping or partial pieces, different
taps, a `post` that differs per branch or is read in its middle.
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.canonical.region import CAST
from k3compile.canonical.region import shape as _shape
from k3compile.canonical.region import val as _val
from k3compile.graph import call
from k3compile.rewrite import inductor

aten = torch.ops.aten
_END = 2**63 - 1
PERMUTES = {aten.permute.default}
MAX_POST = 32  # a conv's pointwise tail is a few ops (SiLU decomposed, a cast, a permute)


def upcast_of(node):
    """(source, cast node) if node is an fp32 cast of source, else (node, None)."""
    if isinstance(node, fx.Node) and node.target is CAST and node.args[1] == torch.float32:
        return node.args[0], node
    return node, None


# ---- one branch: window_i -> conv_i ------------------------------------------------------------


class Branch:
    """One per-projection conv and what feeds it."""

    def __init__(self, conv, window, window_cast, weight, weight_cast, past, source, start, x):
        self.conv, self.window, self.window_cast = conv, window, window_cast
        self.weight, self.weight_cast = weight, weight_cast
        self.past, self.source, self.start, self.x = past, source, start, x
        self.channels = _shape(weight)[0]
        self.post: list[fx.Node] = []


def is_depthwise(conv: fx.Node) -> bool:
    args = list(conv.args) + [None] * (9 - len(conv.args))
    x, w, _, stride, padding, dilation, transposed, out_pad, groups = args
    ws = _shape(upcast_of(w)[0])
    return (ws is not None and len(ws) == 3 and ws[1] == 1 and groups == ws[0]
            and list(stride) == [1] and list(padding) == [0] and list(dilation) == [1]
            and not transposed and list(out_pad) == [0] and len(_shape(x) or ()) == 3)


def _piece(node) -> tuple[fx.Node, int] | None:
    """(source, start) if node is channels [start, start + C) of source along dim 1."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is operator.getitem:
        split, i = node.args
        if split.target not in (aten.split.Tensor, aten.split_with_sizes.default):
            return None
        src, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if dim % 3 != 1 or len(_shape(src) or ()) != 3:
            return None
        if isinstance(sizes, int):
            return src, sizes * i
        return src, sum(sizes[:i])
    if node.target is aten.slice.Tensor:
        src, dim, start = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        if dim % 3 == 1 and step == 1 and len(_shape(src) or ()) == 3 and start >= 0:
            return src, start
    return None


def _branch(conv: fx.Node) -> Branch | None:
    if conv.target is not aten.convolution.default or not is_depthwise(conv):
        return None
    window, window_cast = upcast_of(conv.args[0])
    weight, weight_cast = upcast_of(conv.args[1])
    if not (isinstance(window, fx.Node) and window.target is aten.cat.default):
        return None
    parts, dim = window.args[0], window.args[1] if len(window.args) > 1 else 0
    if len(parts) != 2 or dim % 3 != 2:
        return None
    past, new = parts
    found = _piece(past)
    if found is None or not (isinstance(new, fx.Node) and new.target in PERMUTES
                             and list(new.args[1]) == [0, 2, 1] and len(new.users) == 1):
        return None
    source, start = found
    taps, C = _shape(weight)[2], _shape(weight)[0]
    if _shape(past)[1:] != (C, taps - 1) or _shape(new)[1] != C:
        return None
    if window_cast is not None and len(window_cast.users) != 1:
        return None
    return Branch(conv, window, window_cast, weight, weight_cast, past, source, start,
                  new.args[0])


# ---- the pointwise tail after each conv --------------------------------------------------------


def _pointwise(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and (
        t is CAST or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags))


def _post(conv: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The conv's tail in graph order: pointwise ops on the conv and each other, ending in at most
    one permute; read outside only at its last node (None if it is read in the middle)."""
    chain, members = [], {conv}
    frontier = list(conv.users)
    while frontier and len(chain) < MAX_POST:
        node = min(frontier, key=lambda n: order.get(n, len(order)))
        frontier.remove(node)
        if node in members:
            continue
        inputs = [a for a in node.all_input_nodes]
        if not all(a in members for a in inputs):
            continue  # joins something outside: not part of the tail
        if _pointwise(node) or (node.target in PERMUTES and not _has_permute(chain)):
            chain.append(node)
            members.add(node)
            frontier += list(node.users)
    # an upcast after the permute (bf16: each piece's `.float()`) and what follows it stay on
    # the pieces, after the split, where the canonical form casts q, k and v
    cut = next((i for i, n in enumerate(chain) if upcast_of(n)[1] is not None
                and _has_permute(chain[:i])), len(chain))
    chain, members = chain[:cut], {conv, *chain[:cut]}
    inner = [conv, *chain[:-1]] if chain else []
    exits = [n for n in [conv, *chain] if any(u not in members for u in n.users)
             or not n.users]
    if exits != [chain[-1] if chain else conv] or any(
            u not in members for n in inner for u in n.users):
        return None
    return chain


def _has_permute(chain: list[fx.Node]) -> bool:
    return any(n.target in PERMUTES for n in chain)


def _isomorphic(chains: list[list[fx.Node]], convs: list[fx.Node]) -> bool:
    first, head = chains[0], convs[0]
    for chain, conv in zip(chains[1:], convs[1:]):
        if len(chain) != len(first):
            return False
        index = {conv: -1, **{n: i for i, n in enumerate(chain)}}
        index0 = {head: -1, **{n: i for i, n in enumerate(first)}}
        for a, b in zip(first, chain):
            if a.target is not b.target or a.kwargs != b.kwargs or len(a.args) != len(b.args):
                return False
            for x, y in zip(a.args, b.args):
                if isinstance(x, fx.Node) or isinstance(y, fx.Node):
                    if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)
                            and index0.get(x) == index.get(y) is not None):
                        return False
                elif x != y:
                    return False
    return True


# ---- groups and the rewrite --------------------------------------------------------------------


def _groups(graph: fx.Graph) -> list[list[Branch]]:
    by_source: dict[tuple, list[Branch]] = {}
    for node in graph.nodes:
        b = _branch(node)
        if b is not None:
            batch, _, rows = _shape(b.conv)
            key = (b.source, _shape(b.weight)[2], batch, rows, b.window_cast is None,
                   b.weight_cast is None, _val(b.x).dtype, _val(b.weight).dtype)  # cat: one dtype
            by_source.setdefault(key, []).append(b)
    groups = []
    for (source, *_), branches in by_source.items():
        branches.sort(key=lambda b: b.start)
        ends = [b.start + b.channels for b in branches]
        if (len(branches) < 2 or branches[0].start != 0 or ends[-1] != _shape(source)[1]
                or any(b.start != e for b, e in zip(branches[1:], ends))):
            continue
        if len({b.conv.args[2] is None for b in branches}) == 1:  # no bias or a bias each
            groups.append(branches)
    return groups


def _merge(graph: fx.Graph, group: list[Branch], order: dict[fx.Node, int]) -> bool:
    for b in group:
        b.post = _post(b.conv, order)
        if b.post is None:
            return False
    if not _isomorphic([b.post for b in group], [b.conv for b in group]):
        return False
    source, first = group[0].source, group[0]
    T = _shape(first.conv)[-1]
    channels = sum(b.channels for b in group)
    inputs = [source, *(b.x for b in group), *(b.weight for b in group)]
    inputs += [b.conv.args[2] for b in group if b.conv.args[2] is not None]
    last_input = max(inputs, key=lambda n: order.get(n, len(order)))
    with graph.inserting_after(last_input):
        at = first.conv
        x = call(graph, aten.cat.default, ([b.x for b in group], -1), like=at)
        new = call(graph, aten.permute.default, (x, [0, 2, 1]), like=at)
        window = call(graph, aten.cat.default, ([source, new], -1), like=at)
        taps = call(graph, aten.cat.default, ([b.weight for b in group],), like=at)
        conv_in = window
        if first.window_cast is not None:
            conv_in = call(graph, CAST, (window, torch.float32), like=at)
        if first.weight_cast is not None:
            taps = call(graph, CAST, (taps, torch.float32), like=at)
        bias = first.conv.args[2]
        if bias is not None:
            bias = call(graph, aten.cat.default, ([b.conv.args[2] for b in group],), like=at)
        args = (conv_in, taps, bias, *first.conv.args[3:8], channels)
        out = call(graph, aten.convolution.default, args, like=at)
        made = {first.conv: out}
        for node in first.post:
            args = fx.map_arg(node.args, lambda n: made.get(n, n))
            made[node] = call(graph, node.target, args, node.kwargs, like=node)
        merged = made[first.post[-1]] if first.post else out
        pieces = _split(graph, merged, [b.channels for b in group], _channel_dim(first.post), at)
        outs = [call(graph, operator.getitem, (pieces, i), like=at) for i in range(len(group))]
        tail = call(graph, aten.slice.Tensor, (window, 2, T, _END), like=at)
    for b, piece in zip(group, outs):
        (b.post[-1] if b.post else b.conv).replace_all_uses_with(piece)
        _reroute_tail(graph, b, tail)
    _fold_tail_cats(graph, tail)
    return True


def _split(graph: fx.Graph, node: fx.Node, sizes: list[int], dim: int, like: fx.Node) -> fx.Node:
    """node split along dim as code writes it (`x.split(C, dim=-1)` for equal pieces)."""
    if dim == len(_shape(node)) - 1:
        dim = -1
    if len(set(sizes)) == 1:
        return call(graph, aten.split.Tensor, (node, sizes[0], dim), like=like)
    return call(graph, aten.split_with_sizes.default, (node, sizes, dim), like=like)


def _channel_dim(post: list[fx.Node]) -> int:
    permutes = [n for n in post if n.target in PERMUTES]
    return list(permutes[0].args[1]).index(1) if permutes else 1


def _reroute_tail(graph: fx.Graph, b: Branch, tail: fx.Node) -> None:
    """Reads of window_i[..., T:] (the new state) become the merged tail's channels of b."""
    for user in list(b.window.users):
        if user.target is aten.slice.Tensor and user.args[1] % 3 == 2 and user.args[2:] == (
                _shape(b.conv)[-1], _END):
            with graph.inserting_before(user):
                piece = call(graph, aten.slice.Tensor,
                             (tail, 1, b.start, b.start + b.channels), like=user)
            user.replace_all_uses_with(piece)


def _fold_tail_cats(graph: fx.Graph, tail: fx.Node) -> None:
    """cat([tail[:, a_0:a_1], tail[:, a_1:a_2], ...], 1) covering all of tail -> tail."""
    for piece in list(tail.users):
        for cat in list(piece.users):
            dim = cat.args[1] if len(cat.args) > 1 else 0
            if cat.target is not aten.cat.default or dim % 3 != 1:
                continue
            spans = [(p.args[2], p.args[3]) if p.target is aten.slice.Tensor and p.args[0] is tail
                     and p.args[1] == 1 else None for p in cat.args[0]]
            if None in spans or spans[0][0] != 0 or spans[-1][1] != _shape(tail)[1] or any(
                    a[1] != b[0] for a, b in itertools.pairwise(spans)):
                continue
            cat.replace_all_uses_with(tail)


def apply(graph: fx.Graph) -> int:
    order = {n: i for i, n in enumerate(graph.nodes)}
    count = sum(_merge(graph, group, order) for group in _groups(graph))
    if count:
        inductor.stable_topological_sort(graph)  # the pieces are read before the last x_i
        graph.eliminate_dead_code()
    return count


RULE = Rule("conv_merge", apply, "per-projection depthwise short convs over slices of one conv "
            "state -> one q|k|v convolution, its tail split after, one state write")

__all__ = ["RULE", "apply"]
