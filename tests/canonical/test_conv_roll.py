"""conv_roll: a short conv over a rolled state (spell11's `addcmul(sum(W * w[:, :3], -1), x,
w[:, 3])`, then `roll(W, -1, -1)` with x assigned as the last column) becomes the window form
convolved (`conv1d(cat([W, x[..., None]], -1), w)`) with the state `cat(..)[..., 1:]`: the state
bit for bit, the output a reordered fp32 sum of the same products (within K·2^-24·Σ|x_j w_j| of
the exact dot product), equal bit for bit to that form's eager value; a roll by +1, a roll on
another dim, a column that is not the input, an output without its roll and a sum accumulated in
bf16 stay. Slow: spell11 compiled blind (no probe) fuses its KDA layers, one token and 3 verify
rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functionalize

from k3compile.canonical import conv_roll
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.conftest import TOL
from tests.spellings import foreign

B, C, K = 3, 24, 4
ROLLED = {"aten.roll.default", "aten.fmod.Scalar", "aten.select_scatter.default",
          "aten.slice_scatter.default", "aten.addcmul.default"}


def _args(dtype=torch.float32, T=1, seed=0):
    """x [B, T, C], the state W [B, C, K-1] (both dtype) and fp32 taps w [C, K]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, C, generator=g).to(dtype), torch.randn(B, C, K - 1, generator=g)
            .to(dtype), torch.randn(C, K, generator=g))


def _output(W, x, w):  # spell11's: the taps-1 oldest products summed, the last tap's added
    return torch.addcmul((W.float() * w[:, :-1]).sum(-1), x.float(), w[:, -1])


def _select_assign(W, x):
    R = torch.roll(W, -1, -1)
    R[..., -1] = x
    return R


def _slice_assign(W, x):
    R = torch.roll(W, -1, dims=-1)
    R[..., K - 2:] = x.unsqueeze(-1)
    return R


def _loop(x, W, taps, out=_output, roll=_select_assign):
    ys = []
    for t in range(x.shape[1]):
        ys.append(out(W, x[:, t], taps))
        W = roll(W, x[:, t])
    return torch.stack(ys, 1), W


def select_assign(x, W, taps):  # spell11's `window[..., -1] = x`
    return _loop(x, W, taps)


def slice_assign(x, W, taps):  # `R[..., K-2:] = x[..., None]`
    return _loop(x, W, taps, roll=_slice_assign)


def select_scatter(x, W, taps):  # functional, the output as a sum plus a product
    return _loop(x, W, taps, out=lambda W, x, w: (W.float() * w[:, :3]).sum(-1) + x.float() * w[:, 3],
                 roll=lambda W, x: torch.select_scatter(W.roll(K - 2, 2), x, 2, K - 2))


def window_form(x, W, taps):  # the canonical form: spell11's probe `conv_window`, convolved
    ys = []
    for t in range(x.shape[1]):
        full = torch.cat([W, x[:, t].unsqueeze(-1)], -1)
        ys.append(F.conv1d(full.float(), taps[:, None], groups=C).view(B, C))
        W = full[..., 1:]
    return torch.stack(ys, 1), W


def _rewrite(fn, args):
    return rewrite(conv_roll.RULE, functionalize(fn), *args)  # slice assignment as the backend


def assert_within_summation_order(got, x, W, w):
    """|got - exact| <= K 2^-24 Σ_j |x_j w_j| per token: K fp32 products summed in any order."""
    ys = []
    for t in range(x.shape[1]):
        window = torch.cat([W, x[:, t, :, None]], -1).double()
        ys.append((window * w.double(), window[..., 1:]))
        W = window[..., 1:].to(W.dtype)
    exact = torch.stack([p.sum(-1) for p, _ in ys], 1)
    bound = K * 2.0 ** -24 * torch.stack([p.abs().sum(-1) for p, _ in ys], 1)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_state"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("fn", [select_assign, slice_assign, select_scatter],
                         ids=lambda f: f.__name__)
def test_the_rolled_state_is_the_window(fn, T, dtype):
    """bf16_state: the state and x in bf16 read through `.float()` (spell11 under autocast)."""
    args = _args(dtype, T)
    before, after, n = _rewrite(fn, args)
    assert n == T
    cats = [targets(gm).count("aten.cat.default") for gm in (before, after)]
    assert not ROLLED & set(targets(after)) and cats[1] == cats[0] + T  # one window per token
    assert targets(after).count("aten.convolution.default") == T
    (y0, s0), (y, s) = before(*args), after(*args)
    assert_same(s, s0)
    assert y.dtype == y0.dtype and y.shape == y0.shape
    assert_within_summation_order(y, *args)
    assert_within_summation_order(y0, *args)
    assert_same((y, s), window_form(*args))


def roll_right(x, W, taps):
    return _loop(x, W, taps, roll=lambda W, x: torch.select_scatter(W.roll(1, -1), x, -1, -1))


def roll_channels(x, W, taps):
    return _loop(x, W, taps, roll=lambda W, x: torch.select_scatter(W.roll(-1, 1), x, -1, -1))


def other_column(x, W, taps):
    return _loop(x, W, taps, roll=lambda W, x: _select_assign(W, 2 * x))


def first_column(x, W, taps):
    return _loop(x, W, taps, roll=lambda W, x: torch.select_scatter(W.roll(-1, -1), x, -1, 0))


def no_roll(x, W, taps):  # the output alone, the state kept
    return _loop(x, W, taps, roll=lambda W, x: W + 1)


def bf16_sum(x, W, taps):  # each partial sum rounded to bf16: not a reordering
    return _loop(x, W, taps, out=lambda W, x, w: torch.addcmul((W * w[:, :-1]).sum(-1), x, w[:, -1]))


def taps_of_two_tensors(x, W, taps):
    return _loop(x, W, taps, out=lambda W, x, w: torch.addcmul((W * w[:, :-1]).sum(-1), x,
                                                            (2 * w)[:, -1]))


@pytest.mark.parametrize("fn", [roll_right, roll_channels, other_column, first_column, no_roll,
                                bf16_sum, taps_of_two_tensors], ids=lambda f: f.__name__)
def test_lookalikes_stay(fn):
    args = _args(torch.bfloat16 if fn is bf16_sum else torch.float32)
    if fn is bf16_sum:
        args = (*args[:2], args[2].bfloat16())
    before, after, n = _rewrite(fn, args)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(*args), before(*args))


@pytest.mark.slow
@pytest.mark.parametrize("rows", [0, 3], ids=["T1", "T3"])
def test_spell11_kda_fuses_with_its_rolled_conv_state(rows):
    """spell11 blind (no probe: the conv from its rolled state, the rank-1 write `addcmul_`, the
    reads by matmul), fp32, one token or 3 verify rows (the per-token windows collapsed by
    `token_windows`): fb_kda_decode and linear_concat in both KDA layers."""
    from tests.models.spell11_k3 import from_builtin

    builtin = foreign.builtin(torch.float32)
    model, eager = from_builtin(builtin), from_builtin(builtin)
    assert foreign.steps(foreign.compile_k3(model), eager, n=2, rows=rows) <= TOL["aten_cpu"]
    got = foreign.per_layer(foreign.last_compiled())
    for layer in (0, 1):
        assert got[layer]["fb_kda_decode"] == 1 and got[layer]["linear_concat"] == 1, \
            (layer, dict(got[layer]))
