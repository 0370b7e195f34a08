"""conv_states: per-projection short convs over one conv state buffer each (fla's three
`ShortConvolution` caches; spell8) read their past rows as slices of the gathered rows'
concatenation, so that conv_merge merges them into the one q|k|v conv of the three-state form
(`patterns/kda_decode.py`); values equal to the unrewritten graph. Look-alikes stay: a gather read
elsewhere too, gathers by different slots, a single conv."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.canonical import conv_merge, conv_states

from .rule_checks import assert_same, trace

B, S, C, TAPS, T = 2, 5, 8, 4, 1
aten = torch.ops.aten


def _conv(x, buf, slots, w):
    """spell8's short conv, as F.conv1d: the window from buf's rows, buf's new rows written."""
    window = torch.cat([buf[slots], x.transpose(1, 2)], -1)
    y = F.silu(F.conv1d(window, w, groups=w.shape[0])).transpose(1, 2)
    return y, torch.index_put(buf, (slots,), window[..., x.shape[1]:])


def _projections(h, w_in):
    """q, k, v: one layer's projections of its input h (what groups the three convs)"""
    return (h @ w_in).split(C, -1)


def three(h, w_in, bq, bk, bv, slots, wq, wk, wv):
    xq, xk, xv = _projections(h, w_in)
    outs = [_conv(x, b, slots, w) for x, b, w in ((xq, bq, wq), (xk, bk, wk), (xv, bv, wv))]
    return tuple(y for y, _ in outs) + tuple(s for _, s in outs)


def _args():
    g = torch.Generator().manual_seed(0)
    h, w_in = torch.randn(B, T, 2 * C, generator=g), torch.randn(2 * C, 3 * C, generator=g)
    bufs = [torch.randn(S, C, TAPS - 1, generator=g) for _ in range(3)]
    ws = [torch.randn(C, 1, TAPS, generator=g) for _ in range(3)]
    return [h, w_in, *bufs, torch.tensor([3, 0]), *ws]


def _targets(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def _apply(fn, args):
    """(unrewritten graph, rewritten graph, conv_states' sites, conv_merge's); values are
    compared between the two graphs (eager's matmul may round otherwise)."""
    before, gm = trace(fn, args), trace(fn, args)
    sites = conv_states.apply(gm.graph)
    merged = conv_merge.apply(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return before, gm, sites, merged


def test_three_buffers_become_one_conv_with_three_writes():
    args = _args()
    before, gm, sites, merged = _apply(three, args)
    assert (sites, merged) == (1, 1)
    assert len(_targets(gm, aten.convolution.default)) == 1
    (window,) = [n for n in _targets(gm, aten.cat.default)
                 if n.args[0][0].target is aten.cat.default]
    assert [p.target for p in window.args[0][0].args[0]] == [aten.index.Tensor] * 3
    writes = _targets(gm, aten.index_put.default)
    assert [w.args[2].target for w in writes] == [aten.slice.Tensor] * 3
    assert_same(gm(*args), before(*args))


def test_a_gather_read_elsewhere_stays():
    def leaked(h, w_in, bq, bk, bv, slots, wq, wk, wv):
        xq, xk, xv = _projections(h, w_in)
        yq, sq = _conv(xq, bq, slots, wq)
        past = bk[slots]  # k's gathered rows, also read outside its window
        window = torch.cat([past, xk.transpose(1, 2)], -1)
        yk = F.silu(F.conv1d(window, wk, groups=C)).transpose(1, 2)
        sk = torch.index_put(bk, (slots,), window[..., T:])
        yv, sv = _conv(xv, bv, slots, wv)
        return yq, yk, yv, sq, sk, sv, past * 2

    args = _args()
    before, gm, sites, _ = _apply(leaked, args)
    assert sites == 0
    assert len(_targets(gm, aten.convolution.default)) == 3
    assert_same(gm(*args), before(*args))


def test_gathers_by_different_slots_stay():
    def two_slots(h, w_in, bq, bk, bv, slots, wq, wk, wv):
        xq, xk, _ = _projections(h, w_in)
        yq, sq = _conv(xq, bq, slots, wq)
        yk, sk = _conv(xk, bk, slots.flip(0), wk)
        return yq, yk, sq, sk

    args = _args()
    before, gm, sites, _ = _apply(two_slots, args)
    assert sites == 0
    assert len(_targets(gm, aten.convolution.default)) == 2
    assert_same(gm(*args), before(*args))


def test_a_single_conv_stays():
    def single(h, w_in, bq, bk, bv, slots, wq, wk, wv):
        return _conv(_projections(h, w_in)[0], bq, slots, wq)

    args = _args()
    before, gm, sites, _ = _apply(single, args)
    assert sites == 0
    assert_same(gm(*args), before(*args))


def test_convs_of_two_inputs_stay_apart():
    """two layers' convs (projections of different activations) are not one group"""
    def two_layers(h, w_in, bq, bk, bv, slots, wq, wk, wv):
        xq, xk, _ = _projections(h, w_in)
        _, _, xv = _projections(h * 2, w_in)
        return three_of(xq, xk, xv, bq, bk, bv, slots, wq, wk, wv)

    args = _args()
    before, gm, sites, _ = _apply(two_layers, args)
    assert sites == 1  # q and k, not v
    assert len(_targets(gm, aten.convolution.default)) == 2
    assert_same(gm(*args), before(*args))


def three_of(xq, xk, xv, bq, bk, bv, slots, wq, wk, wv):
    outs = [_conv(x, b, slots, w) for x, b, w in ((xq, bq, wq), (xk, bk, wk), (xv, bv, wv))]
    return tuple(y for y, _ in outs) + tuple(s for _, s in outs)
