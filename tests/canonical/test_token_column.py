"""token_column: a [B, 1, C] decode step appended to a channel-major conv window as
`x[:, 0, :, None]` (spell10's per-token `causal_conv1d_update` loop at T = 1) becomes
`x.transpose(1, 2)`, and the conv output squeezed for the SiLU and stacked back becomes the SiLU
of the conv transposed, bit for bit; a step of two tokens, a cat no conv reads and a column of
another dim stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import token_column
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.canonical.spell10_kda import assert_kda_fuses_with_only
from tests.conftest import rel_err

B, C, TAPS = 2, 12, 4
aten = torch.ops.aten


def _args(T=1):
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, T, C, generator=g), torch.randn(B, C, TAPS - 1, generator=g), \
        torch.randn(C, 1, TAPS, generator=g)


def per_token(x, state, taps):  # spell10's loop at T = 1, the contraction already a conv
    window = torch.cat([state, x[:, 0, :, None]], dim=-1)
    y = F.conv1d(window, taps, groups=C).view(B, C)
    return torch.stack([F.silu(y)], dim=1), window[:, :, 1:]


def transposed(x, state, taps):  # the canonical form (spell10's probe `conv1d`)
    window = torch.cat([state, x.transpose(1, 2)], dim=-1)
    return F.silu(F.conv1d(window, taps, groups=C)).transpose(1, 2), window[:, :, 1:]


def test_the_column_is_the_transpose():
    args = _args()
    before, after, n = rewrite(token_column.RULE, per_token, *args)
    assert n == 1
    assert "aten.select.int" not in targets(after)
    conv = next(x for x in after.graph.nodes if x.target is aten.convolution.default)
    assert not any(u.target in (aten.view.default, aten.reshape.default)
                   for u in conv.users)  # the output fold: silu (neg, exp, add, div) on the conv
    assert_same(after(*args), before(*args))
    for got, want in zip(after(*args), transposed(*args), strict=True):  # eager's fused silu
        assert got.shape == want.shape and rel_err(got, want) <= 1e-6


def two_tokens(x, state, taps):  # T = 2: the first of two columns (rule token_windows's)
    window = torch.cat([state, x[:, 0, :, None]], dim=-1)
    return F.conv1d(window, taps, groups=C), x[:, 1]


def no_conv(x, state, taps):
    return torch.cat([state, x[:, 0, :, None]], dim=-1) * 2.0


def channel_column(x, state, taps):  # a [B, C, T] value's column: no [B, 1, C] step
    window = torch.cat([state, x.transpose(1, 2)[:, :, 0, None]], dim=-1)
    return F.conv1d(window, taps, groups=C)


@pytest.mark.parametrize("fn,T", [(two_tokens, 2), (no_conv, 1), (channel_column, 1)])
def test_lookalikes_stay(fn, T):
    args = _args(T)
    before, after, n = rewrite(token_column.RULE, fn, *args)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(*args), before(*args))


def upcast_window(x, state, taps):  # spell11's: a bf16 window convolved in fp32 (fp32 taps)
    window = torch.cat([state, x[:, 0, :, None]], dim=-1)
    y = F.conv1d(window.float(), taps, groups=C).view(B, C)
    return torch.stack([F.silu(y).to(x.dtype)], dim=1), window[:, :, 1:]


def downcast_window(x, state, taps):  # look-alike: the window narrowed before the conv
    window = torch.cat([state, x[:, 0, :, None]], dim=-1)
    return F.conv1d(window.bfloat16(), taps.bfloat16(), groups=C), window[:, :, 1:]


def test_a_window_convolved_through_its_upcast_takes_the_transpose():
    """A bf16 conv state and token convolved in fp32 (`window.float()`, spell11): the column is
    the transpose all the same, bit for bit."""
    x, state, taps = _args()
    args = (x.bfloat16(), state.bfloat16(), taps)
    before, after, n = rewrite(token_column.RULE, upcast_window, *args)
    assert n == 1 and "aten.select.int" not in targets(after)
    assert_same(after(*args), before(*args))


def test_a_window_narrowed_before_the_conv_stays():
    args = _args()
    before, after, n = rewrite(token_column.RULE, downcast_window, *args)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(*args), before(*args))


@pytest.mark.slow
def test_spell10_kda_fuses_with_its_per_token_conv():
    """spell10 with its per-token conv loop (T = 1) and its other KDA idioms on the fused
    spellings (fp32; in bf16 the loop rounds each product, which no kda_decode variant does)"""
    assert_kda_fuses_with_only("conv1d")
