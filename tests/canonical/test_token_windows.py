"""token_windows: a conv state rolled token by token over T > 1 verify rows (spell10's
`causal_conv1d_update` loop: T windows `cat([state, x[:, t, :, None]], -1)`, each convolved and
SiLU'd, `state = window[:, :, 1:]`, the outputs stacked on dim 1) becomes one window of all T
tokens, one conv over it, its SiLU transposed and its last taps-1 columns the state (also where
each conv was a plain window sum that rule short_conv rewrote, or reads the window through an
fp32 upcast: spell11's bf16 step); a T = 1 step, a window read elsewhere, per-token taps,
per-token ops, a chain that reads another tensor, pieces stacked out of order, an upcast read
elsewhere or per token, and a narrowing cast stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import token_windows
from tests.canonical.rule_checks import assert_same, rewrite, rewritten, targets
from tests.canonical.spell10_kda import kda_plan_with_only
from tests.conftest import rel_err

B, C, TAPS = 2, 12, 4
aten = torch.ops.aten


def _args(T):
    g = torch.Generator().manual_seed(T)
    return torch.randn(B, T, C, generator=g), torch.randn(B, C, TAPS - 1, generator=g), \
        torch.randn(C, 1, TAPS, generator=g)


def _loop(x, state, taps, act=lambda t, y: F.silu(y), taps_of=lambda t, w: w, order=None):
    outs = []
    for t in range(x.shape[1]):
        window = torch.cat([state, x[:, t, :, None]], dim=-1)
        outs.append(act(t, F.conv1d(window, taps_of(t, taps), groups=C).view(B, C)))
        state = window[:, :, 1:]
    return torch.stack(outs if order is None else [outs[i] for i in order], dim=1), state


def per_token(x, state, taps):  # spell10's loop, the contraction already a conv (short_conv)
    return _loop(x, state, taps)


def transposed(x, state, taps):  # the canonical form (spell10's probe `conv1d`)
    window = torch.cat([state, x.transpose(1, 2)], dim=-1)
    return (F.silu(F.conv1d(window, taps, groups=C)).transpose(1, 2),
            window[:, :, x.shape[1]:])


def _one_conv(fn, args):
    """(fn traced, rewritten, its one conv): token_windows takes fn's T per-token convs as one
    [B, C, T] conv, no select left, bit for bit"""
    T = args[0].shape[1]
    before, after, n = rewrite(token_windows.RULE, fn, *args)
    assert n == 1
    assert targets(before).count("aten.convolution.default") == T
    assert targets(after).count("aten.convolution.default") == 1
    assert "aten.select.int" not in targets(after)
    conv = next(x for x in after.graph.nodes if x.target is aten.convolution.default)
    assert tuple(conv.meta["val"].shape) == (B, C, T)
    assert_same(after(*args), before(*args))
    return after, conv


@pytest.mark.parametrize("T", [2, 3, 8])
def test_the_windows_are_one_window_and_one_conv(T):
    args = _args(T)
    after, _ = _one_conv(per_token, args)
    for got, want in zip(after(*args), transposed(*args), strict=True):  # eager's fused silu
        assert got.shape == want.shape and rel_err(got, want) <= 1e-6


def bf16_loop(x, state, taps):  # spell10's bf16 loop, each window sum short_conv's product sum
    outs = []
    for t in range(x.shape[1]):
        window = torch.cat([state, x[:, t, :, None]], dim=-1)
        outs.append(F.silu((window.unfold(-1, TAPS, 1) * taps).sum(-1).view(B, C)))
        state = window[:, :, 1:]
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("T", [2, 3, 8])
def test_product_sum_windows_are_one_product_sum(T):
    """bf16, each product rounded (session 34): one window, one product sum over it, bit for bit
    (the same products, each row of taps summed alike), no convolution"""
    from k3compile.canonical import short_conv

    args = [a.bfloat16() for a in _args(T)]
    before, after, n = rewrite(token_windows.RULE, bf16_loop, *args)
    assert n == 1
    assert targets(before).count("aten.unfold.default") == T
    assert targets(after).count("aten.unfold.default") == 1
    assert not {"aten.select.int", "aten.convolution.default"} & set(targets(after))
    (total,) = [x for x in after.graph.nodes if short_conv.products_conv(x) is not None]
    assert tuple(total.meta["val"].shape) == (B, C, T)
    assert_same(after(*args), before(*args))


def plain_sums(x, state, taps):  # the loop's conv written as `(window * w).sum(-1)`
    outs = []
    for t in range(x.shape[1]):
        window = torch.cat([state, x[:, t, :, None]], dim=-1)
        outs.append(F.silu((window * taps.squeeze(1)).sum(-1)))
        state = window[:, :, 1:]
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
def test_plain_window_sums_take_the_chain(T, dtype):
    """The loop's window sum written plainly (spell11's probe `conv_window`, helper conv11):
    short_conv makes each sum a conv (fp32) or the product sum (bf16) and drops the sum it
    replaced, so each window keeps its two readers; then token_column (T = 1) or token_windows
    (T > 1) takes the loop: one window, one contraction over it (session 35; before, the sum's
    dead product was a third reader and T > 1 kept T convs). bf16 bit for bit, fp32 within the
    conv's summation order."""
    from k3compile.canonical import short_conv, token_column

    args = [a.to(dtype) for a in _args(T)]
    gm, counts = rewritten(plain_sums, args, short_conv.RULE, token_column.RULE,
                           token_windows.RULE)
    assert counts == [T, 1, 0] if T == 1 else [T, 0, 1]
    ops = targets(gm)
    kind = "aten.convolution.default" if dtype == torch.float32 else "aten.unfold.default"
    assert ops.count(kind) == 1 and "aten.select.int" not in ops
    want = plain_sums(*args)
    if dtype == torch.bfloat16:
        assert_same(gm(*args), want)
    else:
        for got, ref in zip(gm(*args), want, strict=True):
            assert got.dtype == ref.dtype and got.shape == ref.shape and rel_err(got, ref) <= 1e-6


def _upcast_loop(x, state, taps, cast_of):
    outs = []
    for t in range(x.shape[1]):
        window = torch.cat([state, x[:, t, :, None]], dim=-1)
        y = F.conv1d(window.to(cast_of(t)), taps.to(cast_of(t)), groups=C).view(B, C)
        outs.append(F.silu(y).to(x.dtype))
        state = window[:, :, 1:]
    return torch.stack(outs, dim=1), state


def upcast_loop(x, state, taps):
    """spell11's bf16 loop as a cat window: the bf16 window convolved in fp32 through `.float()`
    with fp32 master taps, the SiLU in fp32, each output rounded to the window's dtype."""
    return _upcast_loop(x, state, taps, lambda t: torch.float32)


def _upcast_args(T):
    x, state, taps = _args(T)
    return x.bfloat16(), state.bfloat16(), taps


@pytest.mark.parametrize("T", [2, 3, 8])
def test_upcast_windows_are_one_upcast_window(T):
    """bf16 windows each convolved through an fp32 upcast (spell11 at T > 1, session 37): one
    window, one upcast of it, one conv; the same fp32 elements per column, rounded once: bit for
    bit, outputs and state"""
    args = _upcast_args(T)
    after, conv = _one_conv(upcast_loop, args)
    assert conv.args[0].target is torch.ops.prims.convert_element_type.default
    assert_same(after(*args), upcast_loop(*args))


def upcast_read_elsewhere(x, state, taps):  # the upcast window also returned
    outs, ups = [], []
    for t in range(x.shape[1]):
        window = torch.cat([state, x[:, t, :, None]], dim=-1)
        up = window.float()
        outs.append(F.silu(F.conv1d(up, taps, groups=C).view(B, C)).to(x.dtype))
        ups.append(up)
        state = window[:, :, 1:]
    return torch.stack(outs, dim=1), state, torch.stack(ups)


def upcast_some_tokens(x, state, taps):  # token 0 convolved in bf16, the rest through fp32
    return _upcast_loop(x, state, taps, lambda t: torch.bfloat16 if t == 0 else torch.float32)


def upcast_per_token_dtypes(x, state, taps):  # token 0 through fp64, the rest through fp32
    return _upcast_loop(x, state, taps, lambda t: torch.float64 if t == 0 else torch.float32)


@pytest.mark.parametrize("fn", [upcast_read_elsewhere, upcast_some_tokens,
                                upcast_per_token_dtypes])
def test_upcast_lookalikes_stay(fn):
    args = _upcast_args(3)
    before, after, n = rewrite(token_windows.RULE, fn, *args)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(*args), before(*args))


def narrowing_loop(x, state, taps):  # fp32 windows convolved in bf16: a narrowing cast
    return _upcast_loop(x, state, taps, lambda t: torch.bfloat16)


def test_a_narrowed_window_stays():
    args = _args(3)
    before, after, n = rewrite(token_windows.RULE, narrowing_loop, *args)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(*args), before(*args))


def one_token(x, state, taps):  # T = 1: rule token_column's
    return _loop(x, state, taps)


def window_read_elsewhere(x, state, taps):  # each token's window also kept (a state per token)
    outs, windows = [], []
    for t in range(x.shape[1]):
        window = torch.cat([state, x[:, t, :, None]], dim=-1)
        outs.append(F.silu(F.conv1d(window, taps, groups=C).view(B, C)))
        windows.append(window)
        state = window[:, :, 1:]
    return torch.stack(outs, dim=1), state, torch.stack(windows)


def taps_per_token(x, state, taps):
    return _loop(x, state, taps, taps_of=lambda t, w: w * (t + 1))


def ops_per_token(x, state, taps):
    return _loop(x, state, taps, act=lambda t, y: F.silu(y) if t == 0 else torch.tanh(y))


def chain_reads_a_bias(x, state, taps):  # another tensor in the chain: not per element of y
    return _loop(x, state, taps, act=lambda t, y: F.silu(y) * taps[:, 0, 0])


def stacked_out_of_order(x, state, taps):
    return _loop(x, state, taps, order=[1, 0])


@pytest.mark.parametrize("fn,T", [(one_token, 1), (window_read_elsewhere, 2),
                                  (taps_per_token, 2), (ops_per_token, 2),
                                  (chain_reads_a_bias, 2), (stacked_out_of_order, 2)])
def test_lookalikes_stay(fn, T):
    args = _args(T)
    before, after, n = rewrite(token_windows.RULE, fn, *args)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(*args), before(*args))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spell10_kda_fuses_with_its_per_token_conv_over_verify_rows(dtype):
    """spell10 blind (every KDA idiom its own) with 3 verify rows: fb_kda_decode and
    linear_concat in both KDA layers, compiled equal to eager (fp32 within TOL["aten_cpu"];
    bf16, each window's products rounded, within TOL["diffsuite_bf16"]: measured 1.15e-2,
    session 34)"""
    for layer, ops in kda_plan_with_only(None, dtype, rows=3).items():
        assert ops.get("fb_kda_decode") == 1 and ops.get("linear_concat") == 1, (layer, ops)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [0, 3])
def test_spell11_plain_window_sums_fuse_kda(rows):
    """spell11 with its conv probed (`conv_window`: `(cat(W, x).float() * taps).sum(-1)` per
    token, the state `cat(..)[..., 1:]`): fb_kda_decode and linear_concat in both KDA layers
    at one token and at 3 verify rows (fp32), compiled equal to eager (before session 35: T = 1
    only; helper conv11's finding)"""
    from tests.conftest import TOL
    from tests.models.spell11_k3 import from_builtin
    from tests.spellings import foreign

    builtin = foreign.builtin(torch.float32)
    model, eager = (from_builtin(builtin).set_probe("conv_window") for _ in range(2))
    assert foreign.steps(foreign.compile_k3(model), eager, n=2, rows=rows) <= TOL["aten_cpu"]
    got = foreign.per_layer(foreign.last_compiled())
    for layer in (0, 1):
        assert got[layer]["fb_kda_decode"] == 1 and got[layer]["linear_concat"] == 1, \
            (layer, dict(got[layer]))
