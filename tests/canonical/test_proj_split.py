"""proj_split: one in-projection GEMM (spell7's q|k|v|g|f_a|b weight) cut by `narrow` / `split`
into pieces tiling its columns, q|k|v into the short conv's window -> one GEMM per piece on the
weight's row slices; then `qkv_split` cuts q|k|v and `linear_concat[kda,rows]` fuses the six
GEMMs again. Look-alikes stay: a cut that does not tile the output, a GEMM read whole besides its
pieces, a GEMM cut with no short conv (MLA's kv_a)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import linear_concat

from k3compile.canonical import proj_split, qkv_split
from k3compile.rewrite import apply_patterns
from tests.canonical.rule_checks import rewrite, targets
from tests.conftest import rel_err

H, D, R, TAPS, HID = 2, 8, 8, 4, 32
W = H * D
aten = torch.ops.aten


def _args(B=2, T=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B * T, HID, generator=g).to(dtype),
            (torch.randn(4 * W + R + H, HID, generator=g) * HID**-0.5).to(dtype),
            (torch.randn(W, R, generator=g) * R**-0.5).to(dtype),
            torch.randn(4, 3 * W, TAPS - 1, generator=g).to(dtype),
            torch.randn(3 * W, 1, TAPS, generator=g).to(dtype), torch.tensor([2, 0][:B])]


def _front(x, mixed, gate, f_a, b, w_fb, state, taps, slots):
    B = slots.shape[0]
    T = x.shape[0] // B
    window = torch.cat([state[slots], mixed.view(B, T, 3 * W).transpose(1, 2)], dim=-1)
    q, k, v = F.silu(F.conv1d(window, taps, groups=3 * W)).transpose(1, 2).split(W, -1)
    return q, k * 2.0, v, torch.sigmoid(gate), F.linear(f_a, w_fb), torch.sigmoid(b)


def narrowed(x, w, w_fb, state, taps, slots):
    """spell7: one GEMM, cut by narrow"""
    proj = F.linear(x, w)
    return _front(x, proj.narrow(-1, 0, 3 * W), proj.narrow(-1, 3 * W, W),
                  proj.narrow(-1, 4 * W, R), proj.narrow(-1, 4 * W + R, H), w_fb, state, taps,
                  slots)


def split(x, w, w_fb, state, taps, slots):
    """the same cut by `split` (a vLLM in_proj's `split([3W, W, R, H], -1)`)"""
    mixed, gate, f_a, b = F.linear(x, w).split([3 * W, W, R, H], dim=-1)
    return _front(x, mixed, gate, f_a, b, w_fb, state, taps, slots)


def _close(after, before, args):
    """a column of a GEMM depends only on its weight row: equal up to the GEMM's blocking"""
    for got, want in zip(after(*args), before(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("fn", [narrowed, split])
@pytest.mark.parametrize("B,T", [(2, 1), (2, 3)])
def test_one_gemm_per_piece(fn, B, T):
    args = _args(B, T)
    before, after, n = rewrite(proj_split, fn, *args)
    assert n == 1
    _close(after, before, args)
    assert targets(after).count("aten.mm.default") == 5  # 4 pieces + f_b


def test_then_qkv_split_and_one_linear_concat():
    args = _args(2, 3)
    before, after, n = rewrite(proj_split, narrowed, *args)
    assert n == 1 and qkv_split.apply(after.graph) == 1
    after.recompile()
    report = apply_patterns(after.graph, linear_concat.patterns())
    after.recompile()
    assert [h.pattern for h in report.hits] == ["linear_concat[kda,rows]"]
    assert targets(after).count("aten.mm.default") == 1  # f_b's, on f_a's columns
    _close(after, before, args)


def _stays(fn, args):
    before, after, n = rewrite(proj_split, fn, *args)
    assert n == 0
    assert targets(after) == targets(before)


def test_a_cut_that_does_not_tile_the_output_stays():
    def gap(x, w, w_fb, state, taps, slots):  # b skips a column: the pieces leave a gap
        proj = F.linear(x, w)
        return _front(x, proj.narrow(-1, 0, 3 * W), proj.narrow(-1, 3 * W, W),
                      proj.narrow(-1, 4 * W, R), proj.narrow(-1, 4 * W + R + 1, H - 1), w_fb,
                      state, taps, slots)

    def overlap(x, w, w_fb, state, taps, slots):  # gate overlaps q|k|v's last columns
        proj = F.linear(x, w)
        return _front(x, proj.narrow(-1, 0, 3 * W), proj.narrow(-1, 3 * W - 1, W + 1),
                      proj.narrow(-1, 4 * W, R), proj.narrow(-1, 4 * W + R, H), w_fb,
                      state, taps, slots)

    _stays(gap, _args())
    _stays(overlap, _args())


def test_a_gemm_read_whole_stays():
    def whole(x, w, w_fb, state, taps, slots):  # the GEMM's output also returned whole
        proj = F.linear(x, w)
        return (*_front(x, proj.narrow(-1, 0, 3 * W), proj.narrow(-1, 3 * W, W),
                        proj.narrow(-1, 4 * W, R), proj.narrow(-1, 4 * W + R, H), w_fb, state,
                        taps, slots), proj * 2.0)

    _stays(whole, _args())


def test_a_cut_with_no_short_conv_stays():
    def kv_a(x, w, w_fb, state, taps, slots):  # MLA's [latent | rope]: one GEMM, two pieces
        c, pe = F.linear(x, w).split([4 * W, R + H], dim=-1)
        return torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * c, pe

    _stays(kv_a, _args())
