"""Rule `conv_states`: per-projection short convs over separate conv state buffers (one per q / k /
v) -> the same convs over slices of one concatenation of the gathered rows, which rule
`conv_merge` (next) merges into the canonical q|k|v conv.

fla's `ShortConvolution` keeps one cache per projection, and code built on it (vLLM's
`conv_state` per layer and projection, tests/models/spell8_k3.py) gathers three buffers:

    window_i = cat([buf_i[slots], x_i.permute(0, 2, 1)], -1);  y_i = conv(window_i, w_i)
    buf_i    = index_put(buf_i, [slots], window_i[..., T:])

The rule writes `past = cat([buf_1[slots], buf_2[slots], ...], 1)` and reads each window's rows
as `split(past, C, 1)[i]`; the writes stay one per buffer, and conv_merge, which now sees slices
of one tensor, writes the merged window's tail back by channel slices: the form of
`patterns/kda_decode.py` with three conv states (the op's `k_conv_state` and `v_conv_state`).
Exact: a cat and its split move no value.

Taken: >= 2 depthwise convs (as conv_merge takes them) whose windows' past rows are gathers
`index(buf_i, [slots])` of distinct buffers by one `slots`, whose inputs x_i are projections of
one activation tensor (one layer's q, k, v: up through views, slices and the GEMM's activation
operand), with equal taps, batch, T and dtype, each gather read only by its window. Left alone: a group with a gather read elsewhere too (the
whole group), gathers by
different index tensors, a single conv (nothing to merge), windows whose past rows are anything
else (slices of one buffer: conv_merge's own case).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.canonical import Rule
from k3compile.canonical.conv_merge import PERMUTES, is_depthwise, upcast_of
from k3compile.canonical.region import VIEWS, shape, val
from k3compile.graph import call
from k3compile.rewrite import inductor

aten = torch.ops.aten


_UP = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1, aten.slice.Tensor: 0,
       aten.split.Tensor: 0, aten.split_with_sizes.default: 0, operator.getitem: 0,
       torch.ops.prims.convert_element_type.default: 0, **dict.fromkeys(VIEWS, 0)}


def _source(x: fx.Node) -> fx.Node:
    """The activations a projection output x was computed from (up through views, slices and
    the GEMM's activation operand): one KDA layer's q, k and v share it."""
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _UP:
        x = x.args[_UP[x.target]]
    return x


def _gathered_past(conv: fx.Node) -> tuple[fx.Node, tuple, bool] | None:
    """(the gather, its group key, whether the window alone reads it) where conv's window is
    cat([buf[slots], permute(x)], -1)."""
    if conv.target is not aten.convolution.default or not is_depthwise(conv):
        return None
    window = upcast_of(conv.args[0])[0]
    if not (isinstance(window, fx.Node) and window.target is aten.cat.default
            and len(window.args[0]) == 2 and (window.args[1] if len(window.args) > 1 else 0)
            % 3 == 2):
        return None
    past, new = window.args[0]
    if not (isinstance(past, fx.Node) and past.target is aten.index.Tensor
            and isinstance(new, fx.Node) and new.target in PERMUTES
            and list(new.args[1]) == [0, 2, 1]):
        return None
    _, index = past.args
    if len(index) != 1 or not isinstance(index[0], fx.Node) or len(shape(past) or ()) != 3:
        return None
    taps = shape(upcast_of(conv.args[1])[0])[2]
    if shape(past)[2] != taps - 1:
        return None
    key = (index[0], _source(new.args[0]), taps, shape(conv)[0], shape(conv)[2],
           val(past).dtype)
    return past, key, list(past.users) == [window]


def apply(graph: fx.Graph) -> int:
    groups: dict[tuple, list[fx.Node]] = {}
    spoilt = set()  # a gather also read elsewhere: its group stays as it is
    for node in graph.nodes:
        if found := _gathered_past(node):
            groups.setdefault(found[1], []).append(found[0])
            if not found[2]:
                spoilt.add(found[1])
    done = 0
    for key, gathers in groups.items():
        if len(gathers) < 2 or key in spoilt or len({g.args[0] for g in gathers}) != len(gathers):
            continue
        last = max(gathers, key=lambda g: list(graph.nodes).index(g))
        sizes = [shape(g)[1] for g in gathers]
        with graph.inserting_after(last):
            past = call(graph, aten.cat.default, (list(gathers), 1), like=last)
            split = call(graph, aten.split.Tensor, (past, sizes[0], 1), like=last) \
                if len(set(sizes)) == 1 else \
                call(graph, aten.split_with_sizes.default, (past, sizes, 1), like=last)
            pieces = [call(graph, operator.getitem, (split, i), like=g)
                      for i, g in enumerate(gathers)]
        for g, piece in zip(gathers, pieces):
            window = next(iter(g.users))
            window.replace_input_with(g, piece)
        done += 1
    if done:
        inductor.stable_topological_sort(graph)  # a window may precede a later buffer's gather
    return done


RULE = Rule("conv_states", apply, "short convs over one conv state buffer each -> slices of "
            "their gathered rows' concatenation (conv_merge merges them)")

__all__ = ["RULE", "apply"]
