"""Rule `conv_roll`: a short conv over a rolled state (the oldest column rolled out by `roll(W, -1,
-1)`, the new input assigned as the last column, the output the first taps-1 products summed plus
the last tap's) -> the window `cat([W, x[..., None]], -1)` and its canonical convolution (rule
`short_conv`'s), which `token_column` / `token_windows` read (`patterns/kda_decode.py`'s window,
conv and state tail).

spell11 (`tests/models/spell11_k3.py`, `KDA.short_conv`) keeps the state W [B, C, K-1] and, per
token x [B, C] and taps w [C, K], writes

    y = addcmul(sum(W * w[:, :K-1], -1), x, w[:, K-1])  ->  y = conv1d(cat([W, x[..., None]], -1), w)
    R = roll(W, -1, -1);  R[..., -1] = x                ->  R = cat([W, x[..., None]], -1)[..., 1:]

(traced: `index(W, [.., fmod(iota(K-1) + 1, K-1)])`, then `select_scatter` of x, or
`slice_scatter` of x[..., None] for `R[..., -1:] = x[..., None]`); either operand may be read
through one fp32 upcast (a bf16 state under `.float()`: the conv reads the window's upcast), and
`sum + x * w[:, K-1]` is taken as the addcmul. The state: exact (the same elements moved). The
output: the same K fp32 products summed in another order (addcmul is a fused multiply-add on
CPU), so within the fp32 summation bound K·2^-24·Σ|x_j w_j| of the exact dot product
(tests/canonical/test_conv_roll.py). The conv is written here, not left to `short_conv` as a
window sum: that rule leaves the sum's product dead in the graph, a third reader of the window
that keeps `token_windows` from collapsing the per-token windows of verify rows.

Taken only as a pair (the output and the state of the same W and x): a rolled state's output
alone, or a roll alone, is not this conv. Left alone: a roll by another shift or on another dim,
a column that is not the output's input, taps that are not one [C, K] tensor's slices, and a
window sum accumulated in half precision (each partial sum rounded to bf16: not a reordering).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites, short_conv
from k3compile.canonical.region import arange_length, half_upcast, shape, val
from k3compile.graph import call

aten = torch.ops.aten
END = 2**63 - 1  # `[..., 1:]`'s end as traced
_VIEWS = {aten.select.int, aten.slice.Tensor, aten.view.default, aten.unsqueeze.default,
          aten.squeeze.dim}


def _last(node, dim) -> bool:
    """dim is node's last dim."""
    return isinstance(dim, int) and shape(node) is not None and dim % len(shape(node)) == len(
        shape(node)) - 1


def _up(node) -> tuple[fx.Node, bool]:
    """(the tensor node is an exact fp32 upcast of, whether it is one)."""
    if half_upcast(node):
        return node.args[0], True
    return node, False


def _tap(node, taps_len: int) -> tuple[fx.Node, str] | None:
    """(w, "head") for w[:, :K-1], (w, "last") for w[:, K-1], w [C, K]."""
    if not (isinstance(node, fx.Node) and node.target in (aten.select.int, aten.slice.Tensor)
            and not node.kwargs):
        return None
    w = node.args[0]
    if not (isinstance(w, fx.Node) and shape(w) is not None and len(shape(w)) == 2
            and shape(w)[1] == taps_len and _last(w, node.args[1])):
        return None
    if node.target is aten.select.int and node.args[2] in (-1, taps_len - 1):
        return w, "last"
    if (node.target is aten.slice.Tensor and tuple(node.args[2:]) + (1,) * (5 - len(node.args))
            in ((0, e, 1) for e in (-1, taps_len - 1))):
        return w, "head"
    return None


def _product(node) -> tuple | None:
    """(a, b) of a product node whose only reader is its site."""
    if isinstance(node, fx.Node) and node.target is aten.mul.Tensor and len(node.users) == 1:
        return node.args[:2]
    return None


def _output(node: fx.Node) -> tuple | None:
    """(W, x, w) where node = sum(W' * w[:, :K-1], -1) + x' * w[:, K-1] in fp32 (W', x' W and x,
    or both their fp32 upcasts)."""
    if val(node) is None or val(node).dtype != torch.float32:
        return None
    if node.target is aten.addcmul.default and len(node.args) == 3 and (
            set(node.kwargs) <= {"value"} and node.kwargs.get("value", 1) == 1):
        acc, last = node.args[0], node.args[1:]
    elif node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        acc, prod = node.args
        if _product(prod) is None:
            acc, prod = prod, acc
        last = _product(prod)
    else:
        return None
    if not (isinstance(acc, fx.Node) and acc.target is aten.sum.dim_IntList and last
            and len(acc.users) == 1 and not acc.kwargs and len(acc.args) == 2
            and len(acc.args[1]) == 1 and _product(acc.args[0]) is not None):
        return None
    for window, head in (_product(acc.args[0]), _product(acc.args[0])[::-1]):
        W, upcast = _up(window)
        if shape(W) is None or len(shape(W)) < 2 or not _last(window, acc.args[1][0]):
            continue
        K = shape(W)[-1] + 1
        tap = _tap(head, K)
        for x_, tap_last in (last, last[::-1]):
            x, x_upcast = _up(x_)
            found = _tap(tap_last, K)
            if (tap and found == (tap[0], "last") and tap[1] == "head" and x_upcast == upcast
                    and shape(tap[0])[0] == shape(W)[-2] and shape(x) == shape(W)[:-1]
                    and val(x).dtype == val(W).dtype and shape(acc.args[0]) == shape(window)):
                return W, x, tap[0]
    return None


def _same(a, b) -> bool:
    """a and b are one value: the same node, or the same view of one (`x[:, t]` taken twice)."""
    if a is b:
        return True
    return (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "call_function"
            and a.target is b.target and a.target in _VIEWS and a.kwargs == b.kwargs
            and len(a.args) == len(b.args) and _same(a.args[0], b.args[0])
            and a.args[1:] == b.args[1:])


def _rolls_left(node: fx.Node, W: fx.Node) -> bool:
    """node is W rolled by -1 on its last dim (`roll`, or its `index` / `index_select` by
    (arange(n) + 1) % n)."""
    n = shape(W)[-1]
    if node.target is aten.roll.default:
        shifts, dims = (list(a) if isinstance(a, (list, tuple)) else [a] for a in node.args[1:3])
        return len(shifts) == len(dims) == 1 and shifts[0] % n == n - 1 and _last(W, dims[0])
    if node.target is aten.index.Tensor:
        idx = node.args[1]
        if len(idx) != len(shape(W)) or any(i is not None for i in idx[:-1]):
            return False
        idx = idx[-1]
    elif node.target is aten.index_select.default and _last(W, node.args[1]):
        idx = node.args[2]
    else:
        return False
    return _shifted_by_one(idx, n)


def _shifted_by_one(idx, n: int) -> bool:
    """idx is (arange(n) + 1) % n as traced: fmod / remainder of iota(n) plus 1."""
    if not (isinstance(idx, fx.Node) and idx.target in (aten.fmod.Scalar, aten.remainder.Scalar)
            and idx.args[1] == n):
        return False
    add = idx.args[0]
    if not (isinstance(add, fx.Node) and add.target is aten.add.Tensor and not add.kwargs):
        return False
    iota, one = add.args
    if not isinstance(iota, fx.Node):
        iota, one = one, iota
    return arange_length(iota) == n and isinstance(one, int) and one % n == 1


def _written(src, dst_of) -> fx.Node:
    """The value scattered: s for `copy(dst, s)` of the view being assigned (same shape and dtype),
    else src itself."""
    if (isinstance(src, fx.Node) and src.target is aten.copy.default and dst_of(src.args[0])
            and shape(src.args[1]) == shape(src) and val(src.args[1]).dtype == val(src).dtype):
        return src.args[1]
    return src


def _column(scatter: fx.Node, R: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """(x, x[..., None] or None) the scatter assigns to R's last column."""
    n = shape(R)[-1]
    if (scatter.kwargs or len(scatter.args) < 3 or scatter.args[0] is not R
            or not _last(R, scatter.args[2])):
        return None
    if scatter.target is aten.select_scatter.default and scatter.args[3] in (-1, n - 1):
        index = scatter.args[2:]
        x = _written(scatter.args[1], lambda d: d.target is aten.select.int and d.args[0] is R
                     and d.args[1] % len(shape(R)) == index[0] % len(shape(R))
                     and d.args[2] % n == index[1] % n)
        return x, None
    if scatter.target is aten.slice_scatter.default:
        bounds = tuple(scatter.args[3:]) + (None, None, 1)[len(scatter.args) - 3:]
        if bounds[0] not in (-1, n - 1) or bounds[1] not in (None, n, END) or bounds[2] != 1:
            return None
        col = _written(scatter.args[1], lambda d: d.target is aten.slice.Tensor and d.args[0] is R)
        if (isinstance(col, fx.Node) and col.target is aten.unsqueeze.default
                and _last(col, col.args[1])):
            return col.args[0], col
    return None


def _site(node: fx.Node):
    """(scatter, W, x, x[..., None] or None, w) of the output node's rolled state."""
    found = _output(node)
    if found is None:
        return None
    W, x, w = found
    sites = [(scatter, col) for R in W.users if _rolls_left(R, W) for scatter in R.users
             if scatter.target in (aten.select_scatter.default, aten.slice_scatter.default)
             and (col := _column(scatter, R)) is not None and _same(col[0], x)]
    if len(sites) != 1:
        return None
    (scatter, (_, col)), = sites
    return scatter, W, x, col, w


def _write(graph: fx.Graph, out: fx.Node, site) -> None:
    scatter, W, x, col, w = site
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(out, scatter, key=order.__getitem__)
    dim = len(shape(W)) - 1
    with graph.inserting_before(last):
        if col is None:
            col = call(graph, aten.unsqueeze.default, (x, -1), like=scatter)
        window = call(graph, aten.cat.default, ([W, col], -1), like=scatter)
        state = call(graph, aten.slice.Tensor, (window, dim, 1, END), like=scatter)
    scatter.replace_all_uses_with(state)
    short_conv.convolve(graph, out, (window, w, *shape(w)))  # the canonical conv


def apply(graph: fx.Graph) -> int:
    # the new window is placed after the later of the two sites: a reader of the earlier may
    # precede it (sort)
    return rewrite_sites(graph, _site, _write, targets={aten.addcmul.default, aten.add.Tensor},
                         sort=True)


RULE = Rule("conv_roll", apply,
            "addcmul(sum(W * w[:, :K-1], -1), x, w[:, K-1]) with roll(W, -1, -1)[..., -1] = x -> "
            "sum(cat([W, x[..., None]], -1) * w, -1) with cat(..)[..., 1:]")

__all__ = ["RULE", "apply"]
