"""Rule `token_windows`: a depthwise conv state rolled token by token over T > 1 verify rows,
one conv per token -> one window of all T tokens, one conv over it, the form the `kda_decode`
pattern builds (`cat([conv_state[slots], x.transpose(1, 2)], -1)`, convolved once, its last
taps-1 columns written back).

spell10 (`tests/models/spell10_k3.py`) runs vLLM's `causal_conv1d_update` reference token by
token: `window = cat([state, x[:, t, :, None]], -1)`, `outs.append(silu(conv(window)))`, `state
= window[:, :, 1:]`, then `torch.stack(outs, 1)` and the last state written back. Rule
`token_column` takes T = 1 (one window); at T > 1, after rule `short_conv` made each window
sum a convolution, the graph holds T windows chained through their `[..., 1:]` slices:

    w_0 = cat([s, unsqueeze(select(x, 1, 0), -1)], -1);  w_t = cat([w_{t-1}[..., 1:], x_t], -1)
    y_t = f(view(convolution(w_t, taps), [B, C]));  out = view(cat([y_0 .. y_T-1], 1), [B, T, C])
    state = w_T-1[..., 1:]
->  w = cat([s, permute(x, [0, 2, 1])], -1);  out = permute(f(convolution(w, taps)), [0, 2, 1])
    state = w[..., T:]

where f is the same chain of elementwise ops for every token (the SiLU, `x / (1 + exp(-x))`),
computed once on the [B, C, T] conv. The same values: w_t is w[..., t:t + taps] and column t of
the one conv is the same dot product over it (a conv may order its taps' sum otherwise: not seen
on CPU, within the fp32 rounding of `short_conv`'s own rewrite); the elementwise ops are the
same per element. Taken only where every window is read by its conv and by its slice alone,
the T convs share their taps and arguments, each conv's output is squeezed once into an
elementwise chain of the same ops (scalars the same) whose one result is the stacked piece t, in
token order. The convs may be `short_conv`'s product sums (a window sum multiplied in bf16:
spell10's bf16 loop), each token's row of products then a row of the one sum's, bit for bit;
or read their window through a widening cast, its only reader (spell11's bf16 state convolved
in fp32 with fp32 master taps, `conv_roll`'s windows; session 37): the one window is upcast
once, the same elements.
Left alone: T = 1 (`token_column`), a window read by anything else (its state
kept per token), convs with other taps, chains that differ per token or read another tensor,
pieces stacked out of order.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, reshape_fold, rewrite_sites
from k3compile.canonical.region import CAST, refresh, shape, widens
from k3compile.canonical.short_conv import convolve_like, products_conv, window_conv
from k3compile.canonical.token_column import conv_window
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten
CONV = aten.convolution.default
END = 2**63 - 1  # `[..., 1:]`'s end as traced


def _column(node, t: int) -> fx.Node | None:
    """x [B, T, C] where node = unsqueeze(select(x, 1, t), -1), read only here."""
    if not (isinstance(node, fx.Node) and node.target is aten.unsqueeze.default
            and node.args[1] in (-1, 2) and len(node.users) == 1):
        return None
    sel = node.args[0]
    if not (isinstance(sel, fx.Node) and sel.target is aten.select.int and len(sel.users) == 1
            and sel.args[1] in (1, -2) and sel.args[2] == t):
        return None
    sx = shape(sel.args[0])
    return sel.args[0] if sx is not None and len(sx) == 3 and sx[1] > 1 else None


def _bounds(node: fx.Node) -> tuple | None:
    """A slice's (dim, start, end, step), its defaults filled in."""
    given = tuple(node.args[1:])
    return None if node.kwargs else given + (0, 0, None, 1)[len(given):]


def _roll(window: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(conv, window[..., 1:], the upcast the conv reads or None): the window's only two readers
    (the conv a convolution or a product sum, whose unfold reads the window, or the conv's one
    widening cast of the window: spell11's bf16 state convolved in fp32)."""
    rolls = [u for u in window.users if u.target is aten.slice.Tensor and u.args[0] is window
             and _bounds(u) in ((dim, 1, end, 1) for dim in (-1, 2) for end in (None, END))]
    casts = [u for u in window.users if widens(u, window) and len(u.users) == 1]
    read = casts[0] if casts else window
    convs = [c for u in read.users if (c := window_conv(u, read)) is not None]
    if len(window.users) != 2 or len(convs) != 1 or len(rolls) != 1:
        return None
    return convs[0], rolls[0], casts[0] if casts else None


def _taps(conv: fx.Node):
    """The conv's taps as a key: the node, or (source, shape) for a reshape of one (one reshape
    of the parameter per token)."""
    w = conv.args[1] if conv.target is CONV else products_conv(conv)[1]
    if w.target in RESHAPES:
        return w.args[0], tuple(shape(w))
    return w


def _chain(conv: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """(the elementwise ops on the conv's [B, C] squeeze, in graph order; its one result)."""
    squeezes = [u for u in conv.users if reshape_fold.is_reshape(u)]
    if len(squeezes) != 1 or len(conv.users) != 1 or len(shape(squeezes[0]) or ()) != 2:
        return None
    region = reshape_fold.region(squeezes[0])
    inside = {squeezes[0], *region}
    ends = [n for n in region if any(u not in inside for u in n.users)]
    if not region or any(reshape_fold.is_reshape(n) for n in region) or len(ends) != 1:
        return None
    if any(u in inside for u in ends[0].users):
        return None
    return region, ends[0]


def _signature(region: list[fx.Node], squeeze: fx.Node) -> list:
    index = {n: i for i, n in enumerate(region)}
    index[squeeze] = -1

    def arg(a):
        return ("node", index[a]) if isinstance(a, fx.Node) else ("value", a)

    return [(n.target, tuple(arg(a) for a in n.args), tuple(sorted(n.kwargs.items())))
            for n in region]


def _stacked(ends: list[fx.Node], sx) -> fx.Node | None:
    """The [B, T, C] value the pieces are stacked into on dim 1, in token order (`stack`, or
    the `cat` on dim 1 of [B, C] pieces viewed [B, T, C])."""
    if any(len(e.users) != 1 for e in ends):
        return None
    (joint,) = ends[0].users
    if joint.target not in (aten.stack.default, aten.cat.default):
        return None
    pieces = joint.args[0]
    dim = joint.args[1] if len(joint.args) > 1 else joint.kwargs.get("dim", 0)
    if len(pieces) != len(ends) or any(p is not e for p, e in zip(pieces, ends)):
        return None
    if joint.target is aten.stack.default:
        return joint if dim in (1, -2) else None
    if dim not in (1, -1) or len(joint.users) != 1:
        return None
    (view,) = joint.users
    return view if view.target in RESHAPES and list(shape(view)) == list(sx) else None


def _site(first: fx.Node):
    """(x, s, windows, convs, chains, the stacked output, the last roll) of a per-token conv
    loop whose first window is `first`."""
    if first.target is not aten.cat.default or len(first.args[0]) != 2 or not conv_window(first):
        return None
    s, col = first.args[0]
    x = _column(col, 0)
    if x is None:
        return None
    T, windows, convs, casts, chains, window = shape(x)[1], [], [], [], [], first
    for t in range(T):
        rolled = _roll(window)
        if rolled is None:
            return None
        conv, roll, cast = rolled
        windows.append(window)
        convs.append(conv)
        casts.append(cast)
        if t == T - 1:
            break
        if len(roll.users) != 1:
            return None
        (window,) = roll.users
        if not (window.target is aten.cat.default and list(window.args[0][:1]) == [roll]
                and len(window.args[0]) == 2 and _column(window.args[0][1], t + 1) is x
                and window.args[1:] == first.args[1:]):
            return None
    if any(c.target is not convs[0].target or _taps(c) != _taps(convs[0])
           or c.args[2:] != convs[0].args[2:] for c in convs):
        return None
    for conv in convs:
        chain = _chain(conv)
        if chain is None:
            return None
        chains.append(chain)
    sigs = [_signature(region, next(iter(c.users))) for (region, _), c in zip(chains, convs)]
    if any(sig != sigs[0] for sig in sigs):
        return None
    out = _stacked([end for _, end in chains], shape(x))
    # the windows share a dtype and the convs their taps, so each reads its window alike: as it
    # is, or through the one upcast to the taps' dtype
    return None if out is None else (x, s, convs, casts[0], chains[0], out, roll)


def _write(graph: fx.Graph, first: fx.Node, site) -> None:
    x, s, convs, cast, (region, end), out, roll = site
    T = shape(x)[1]
    with graph.inserting_before(first):
        col = call(graph, aten.permute.default, (x, [0, 2, 1]), like=first)
        window = call(graph, aten.cat.default, ([s, col], *first.args[1:]), like=first)
        state = call(graph, aten.slice.Tensor, (window, 2, T, END), like=roll)
    roll.replace_all_uses_with(state)
    conv0 = convs[0]
    squeeze = next(iter(conv0.users))
    with graph.inserting_before(conv0):
        read = window if cast is None else call(graph, CAST, (window, *cast.args[1:]),
                                                dict(cast.kwargs), like=cast)
        conv = convolve_like(graph, conv0, read)
        clones = {squeeze: conv}
        for node in region:
            clones[node] = call(graph, node.target, fx.map_arg(node.args, lambda a: clones[a]),
                                dict(node.kwargs), like=node)
        new = call(graph, aten.permute.default, (clones[end], [0, 2, 1]), like=out)
    out.replace_all_uses_with(new)
    # the readers' strides follow the one conv's [B, C, T] layout now (rule delta_einsum lowers
    # a token's row by its strides, as the pattern traced on that layout does)
    refresh([new, state])


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.cat.default})


RULE = Rule("token_windows", apply,
            "T per-token conv windows cat([state, x[:, t, :, None]], -1), rolled by [..., 1:] "
            "-> one window cat([state, x.transpose(1, 2)], -1), one conv")

__all__ = ["RULE", "apply"]
