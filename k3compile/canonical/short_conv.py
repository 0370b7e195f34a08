"""Rule `short_conv`: KDA's depthwise short convolution written as a window sum -> the
`convolution` that `F.conv1d(window, taps, groups=C)` traces to (`patterns/kda_decode.py`).

A decode step convolves the window [B, C, L] (the conv state's last taps-1 inputs and the new
ones) with one filter per channel [C, 1, taps]. Code written elsewhere (fla's
`ShortConvolution.step`, hand-written decoders) spells it as
    (window * w).sum(-1)                        w [C, taps], [C, 1, taps] squeezed, either order
    (window.unfold(-1, taps, 1) * w).sum(-1)    L = T + taps - 1, w [C, 1, taps]: [B, C, T]
    sum(window[..., j] * w[:, j] for j in range(taps))
which this rule rewrites to `convolution(window, w[C, 1, taps], None, [1], [0], [1], False, [0],
C)`, followed by a view where the sum had dropped the output's length-1 dim. A verify step of T
tokens written as one such sum per token over the window's slices `window[..., t:t + taps]`,
stacked on the last dim (`torch.stack(outs, -1)`, or a cat of [B, C, 1] pieces), is then one
convolution over the window's T + taps - 1 columns: each output column is the same dot product.

fp32 products become the convolution: the canonical form convolves in fp32 (the model's
`window.float()`, `taps.float()`), and fp32 upcasts of a bf16 operand are exact, so conv and window
sum differ only by summation order (measured on CPU at K3's 3·4096 channels, B 1-64: ~38% of the
outputs differ, by at most 1.7e-7 of the largest, 1-2 ulps).

A window sum multiplied in bf16 / fp16 (both operands and the sum in that dtype: spell10's
per-token `(window * taps).sum(-1)`, spell12's `vecdot` of stacked windows) rounds every product
to that dtype, then sums in fp32 and rounds once: no convolution computes that. Its canonical form
is the window sum itself, written one way (`kda_decode`'s `conv_products_rounded`):

    sum(unfold(window, -1, taps, 1) * w[C, 1, taps], [-1])      [B, C, T], in the window's dtype

(then the view the sum had, as for the conv). Exact: the same products of the same pairs, each
row's `taps` products summed alike (a contiguous row of the product either way). `depthwise`
reads a conv of either form for the rules after this one. A loop of adds in bf16 rounds every
partial sum: another computation, left alone (as is any product whose operands are not all in
the sum's dtype).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CAST, LOW
from k3compile.canonical.region import shape as _shape
from k3compile.graph import call

aten = torch.ops.aten
# a short conv's width (K3: 4); a long weighted sum over the last dim is some other reduction,
# which Inductor fuses better than as a convolution
MAX_TAPS = 16


# ops that only re-index a tensor without changing the order of its elements
_ORDER_KEEPING = {aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.unsqueeze.default,
                  aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _squeezed(shape) -> tuple[int, ...]:
    """shape without its leading size-1 dims (broadcasting adds them)."""
    shape = tuple(shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _filters(node: fx.Node, C: int, taps: int) -> fx.Node | None:
    """The [C, 1, taps] tensor that `node` (C x taps filter values, in order) is an
    order-keeping view or exact fp32 upcast of, if the graph holds one."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if _shape(node) == (C, 1, taps):
            return node
        if node.target is aten.select.int and (_shape(node.args[0]) or (0,) * 8)[node.args[1]] == 1:
            node = node.args[0]  # w[:, 0]: a squeeze
        elif node.target in _ORDER_KEEPING or _is_upcast(node):
            node = node.args[0]
        else:
            return None
    return node if _shape(node) == (C, 1, taps) else None


def _is_upcast(node: fx.Node) -> bool:
    return (node.target is CAST
            and node.args[1] == torch.float32
            and _dtype(node.args[0]) in (torch.bfloat16, torch.float16, torch.float32))


def _as_filters(graph: fx.Graph, weight: fx.Node, C: int, taps: int, like: fx.Node) -> fx.Node:
    """`weight` (C x taps values) as the conv's fp32 [C, 1, taps] weight."""
    w = _filters(weight, C, taps)
    if w is None:
        w = call(graph, aten.reshape.default, (weight, [C, 1, taps]), like=like)
    return _fp32(graph, w, like)


def _fp32(graph: fx.Graph, node: fx.Node, like: fx.Node) -> fx.Node:
    if _dtype(node) == torch.float32:
        return node
    return call(graph, CAST, (node, torch.float32), like=like)


def convolve(graph: fx.Graph, site: fx.Node, found: tuple) -> None:
    """Replace `site` by the canonical depthwise conv of window [B, C, L] with weight (a window
    sum multiplied in bf16 / fp16: the canonical product sum)."""
    window, weight, C, taps = found[:4]
    with graph.inserting_before(site):
        if _dtype(site) in LOW:
            w = _filters(weight, C, taps)
            if w is None:
                w = call(graph, aten.reshape.default, (weight, [C, 1, taps]), like=site)
            cols = call(graph, aten.unfold.default, (window, -1, taps, 1), like=site)
            prods = call(graph, aten.mul.Tensor, (cols, w), like=site)
            conv = call(graph, aten.sum.dim_IntList, (prods, [-1]), like=site)
        else:
            w = _as_filters(graph, weight, C, taps, site)
            x = _fp32(graph, window, site)
            conv = call(graph, aten.convolution.default,
                        (x, w, None, [1], [0], [1], False, [0], C), like=site)
        if _shape(conv) != _shape(site):
            conv = call(graph, aten.view.default, (conv, list(_shape(site))), like=site)
    site.replace_all_uses_with(conv)


# ---- (window * w).sum(-1) and its unfold form --------------------------------------------------


def _weight_fits(weight: fx.Node, want: tuple[int, ...]) -> bool:
    """weight broadcasts as the filters: its shape (leading 1s aside) is `want`."""
    shape = _shape(weight)
    return shape is not None and _squeezed(shape) == _squeezed(want) and len(shape) <= len(want) + 1


def _window_sum(node: fx.Node) -> tuple[fx.Node, fx.Node, int, int] | None:
    """(window [B, C, L], weight, C, taps) if node is the sum over taps of window * weight,
    multiplied in fp32, or in bf16 / fp16 (both operands and the sum in that dtype) and not
    already the canonical product sum."""
    if node.target is not aten.sum.dim_IntList or node.kwargs.get("dtype") is not None:
        return None
    prod, dims = node.args[0], node.args[1]
    if not (isinstance(prod, fx.Node) and prod.target is aten.mul.Tensor and len(prod.users) == 1
            and dims is not None and len(dims) == 1):
        return None
    dtype = _dtype(prod)
    if dtype in LOW:
        if (_dtype(node) != dtype or any(_dtype(a) != dtype for a in prod.args)
                or products_conv(node) is not None):
            return None
    elif dtype != torch.float32:
        return None
    shape = _shape(prod)
    if len(shape) not in (3, 4) or dims[0] % len(shape) != len(shape) - 1:
        return None
    a, b = prod.args
    for window, weight in ((a, b), (b, a)):
        if isinstance(window, fx.Node) and isinstance(weight, fx.Node) and _shape(window) == shape:
            found = _window_and_filters(window, weight, shape)
            if found is not None:
                return found
    return None


def _window_and_filters(window, weight, shape):
    C, taps = shape[1], shape[-1]
    if taps > MAX_TAPS:
        return None
    if len(shape) == 3:  # [B, C, taps] * [C, taps]
        return (window, weight, C, taps) if _weight_fits(weight, (C, taps)) else None
    # [B, C, T, taps] = window.unfold(-1, taps, 1) * [C, 1, taps]
    if window.target is not aten.unfold.default:
        return None
    src, dim, size, step = window.args
    if (len(_shape(src)) != 3 or dim % 3 != 2 or size != taps or step != 1
            or not _weight_fits(weight, (C, 1, taps))):
        return None
    return src, weight, C, taps


def products_conv(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(window [B, C, L], weight [C, 1, taps], the mul that reads it) if node is the canonical
    window sum multiplied in bf16 / fp16, `sum(unfold(window, -1, taps, 1) * w, [-1])`."""
    if (node.target is not aten.sum.dim_IntList or node.kwargs or list(node.args[1]) != [-1]
            or _dtype(node) not in LOW):
        return None
    prod = node.args[0]
    if not (isinstance(prod, fx.Node) and prod.target is aten.mul.Tensor and len(prod.users) == 1
            and not prod.kwargs):
        return None
    cols, w = prod.args
    if not (isinstance(cols, fx.Node) and cols.target is aten.unfold.default
            and len(cols.users) == 1 and isinstance(w, fx.Node) and _shape(w)
            and list(cols.args[1:]) == [-1, _shape(w)[-1], 1]):
        return None
    window = cols.args[0]
    C = (_shape(window) or (0, 0))[1]
    if _shape(w) != (C, 1, cols.args[2]) or not _dtype(node) == _dtype(window) == _dtype(w):
        return None
    return window, w, prod


def depthwise(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(window input, weight input, the node that reads the weight) of a depthwise short conv:
    a `convolution` whose groups are its output channels, or the canonical product sum (window
    [B, C, L], weight [C, 1, taps], read by its mul). The conv's inputs may be upcasts."""
    if node.target is aten.convolution.default:
        w = _shape(node.args[1])
        return (node.args[0], node.args[1], node) if w and node.args[8] == w[0] else None
    return products_conv(node)


def window_conv(user: fx.Node, window: fx.Node) -> fx.Node | None:
    """The depthwise short conv (`depthwise`: either form) that `user`, a reader of `window`,
    makes of it as its window input: the convolution itself, or the product sum whose unfold
    `user` is."""
    if user.target is aten.unfold.default and len(user.users) == 1:
        (prod,) = user.users
        user = next(iter(prod.users)) if len(prod.users) == 1 else user
    found = depthwise(user)
    return user if found is not None and found[0] is window else None


def convolve_like(graph: fx.Graph, conv: fx.Node, window: fx.Node) -> fx.Node:
    """A depthwise conv of `window` of conv's kind (`depthwise`), with its taps and arguments,
    at the insertion point."""
    if conv.target is aten.convolution.default:
        return call(graph, aten.convolution.default, (window, *conv.args[1:]), like=conv)
    _, w, prod = products_conv(conv)
    cols = call(graph, aten.unfold.default, (window, *prod.args[0].args[1:]), like=conv)
    return call(graph, aten.sum.dim_IntList,
                (call(graph, aten.mul.Tensor, (cols, w), like=conv), *conv.args[1:]), like=conv)


# ---- sum(window[..., j] * w[:, j] for j in range(taps)) ----------------------------------------


def _terms(node: fx.Node, inner: set) -> list[fx.Node] | None:
    """The products an add tree sums (a Python sum's leading `0 +` dropped); the tree's inner
    adds go to `inner`."""
    if node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        parts = []
        for arg in node.args:
            if arg == 0:
                continue
            if not isinstance(arg, fx.Node) or len(arg.users) != 1:
                return None
            sub = _terms(arg, inner)
            if sub is None:
                return None
            parts += sub
        inner.add(node)
        return parts
    return [node] if node.target is aten.mul.Tensor else None


def _tap(prod: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """(window, weight, j) for window[..., j] * weight[..., j] (either order)."""
    a, b = prod.args
    for x, w in ((a, b), (b, a)):
        if not all(isinstance(n, fx.Node) and n.target is aten.select.int for n in (x, w)):
            continue
        window, weight = x.args[0], w.args[0]
        xs, ws = _shape(window), _shape(weight)
        if (xs and ws and len(xs) == 3 and x.args[1] % 3 == 2 and w.args[1] % len(ws) == len(ws) - 1
                and x.args[2] % xs[2] == w.args[2] % ws[-1]):
            return window, weight, x.args[2] % xs[2]
    return None


def _tap_loop(node: fx.Node) -> tuple[fx.Node, fx.Node, int, int, set] | None:
    """(window [B, C, taps], weight, C, taps, inner adds) if node sums one product per tap."""
    inner: set = set()
    prods = _terms(node, inner)
    if not prods or len(prods) < 2 or not inner or _dtype(node) != torch.float32:
        return None
    taps_ = [_tap(p) for p in prods]
    if any(t is None for t in taps_) or any(len(p.users) != 1 for p in prods):
        return None
    windows = {t[0] for t in taps_}
    if len(windows) != 1:
        return None
    (window,) = windows
    _, C, taps = _shape(window)
    if (taps > MAX_TAPS or sorted(t[2] for t in taps_) != list(range(taps))
            or _shape(node) != (_shape(window)[0], C)):
        return None
    weights = {_filters(t[1], C, taps) or t[1] for t in taps_}  # one tensor, however indexed
    if len(weights) != 1:
        return None
    (weight,) = weights
    if _shape(weight) != (C, 1, taps) and not _weight_fits(weight, (C, taps)):
        return None
    return window, weight, C, taps, inner


# ---- one conv per token, stacked on the last dim -----------------------------------------------

_CONV_ARGS = ([1], [0], [1], False, [0])  # stride, padding, dilation, transposed, output_padding


def _through_views(node: fx.Node) -> fx.Node:
    """The node under the single-user order-keeping views that `node` is."""
    while node.target in _ORDER_KEEPING and len(node.args[0].users) == 1:
        node = node.args[0]
    return node


def _unupcast(node: fx.Node) -> tuple[fx.Node, bool]:
    return (node.args[0], True) if _is_upcast(node) else (node, False)


def _token_conv(piece: fx.Node) -> tuple | None:
    """(window, first column, weight source, upcast) if `piece` [B, C, 1] is the depthwise conv
    of window[..., t:t + taps] (upcast to fp32 or not), with one output column."""
    conv = _through_views(piece)
    if (conv.target is not aten.convolution.default or len(conv.users) != 1
            or _shape(conv) != _shape(piece) or conv.args[2] is not None
            or list(conv.args[3:8]) != list(_CONV_ARGS)):
        return None
    (x, upcast), weight = _unupcast(conv.args[0]), conv.args[1]
    if (x.target is not aten.slice.Tensor or len(x.args) > 4 and x.args[4] != 1
            or x.args[1] % 3 != 2 or len(_shape(x) or ()) != 3):
        return None
    window, start, taps = x.args[0], x.args[2], _shape(x)[2]
    if start is None or start < 0 or _shape(weight) != (_shape(x)[1], 1, taps):
        return None
    return window, start, _unupcast(weight)[0], upcast, conv.args[8]


def _stacked_convs(node: fx.Node) -> tuple | None:
    """(window, first column, a piece's conv) if node is cat(pieces, -1) of T >= 2 one-column
    convs over consecutive columns of one window, with one weight."""
    if node.target is not aten.cat.default or len(node.args[0]) < 2:
        return None
    pieces, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    shape = _shape(node)
    if shape is None or len(shape) != 3 or dim % 3 != 2:
        return None
    found = [_token_conv(p) if isinstance(p, fx.Node) and len(p.users) == 1 else None
             for p in pieces]
    if any(f is None for f in found) or len({(f[0], f[2], f[3], f[4]) for f in found}) != 1:
        return None
    start = found[0][1]
    if [f[1] for f in found] != list(range(start, start + len(found))):
        return None
    return found[0][0], start, _through_views(pieces[0])


def _merge_token_convs(graph: fx.Graph, cat: fx.Node, found: tuple) -> None:
    """cat of T one-column convs -> the conv of window[..., start:start + T + taps - 1]."""
    window, start, conv = found
    T, taps = _shape(cat)[2], _shape(conv.args[1])[2]
    end = start + T + taps - 1
    with graph.inserting_before(cat):
        x = window
        if (start, end) != (0, _shape(window)[2]):
            x = call(graph, aten.slice.Tensor, (window, 2, start, end), like=cat)
        if _is_upcast(conv.args[0]):
            x = call(graph, CAST, (x, torch.float32),
                     like=cat)
        merged = call(graph, aten.convolution.default, (x, *conv.args[1:]), like=cat)
    cat.replace_all_uses_with(merged)


def apply(graph: fx.Graph) -> int:
    return _window_sums(graph) + rewrite_sites(
        graph, lambda n: n.op == "call_function" and _stacked_convs(n),
        _merge_token_convs, tidy=False)


def _window_sums(graph: fx.Graph) -> int:
    done = set()  # the inner adds of the tap loops taken

    def site(node: fx.Node):
        if node.op != "call_function" or node in done:
            return None
        found = _window_sum(node)
        if found is None and (loop := _tap_loop(node)) is not None:
            *found, inner = loop
            done.update(inner)
        return found

    # a loop's outermost add first; the sums replaced go at once (rule token_windows wants each
    # window read by its conv and its roll alone)
    return rewrite_sites(graph, site, convolve, reverse=True)


RULE = Rule("short_conv", apply, "depthwise short conv as window sum / unfold / tap loop -> "
            "convolution(window, w[C,1,taps], groups=C)")
