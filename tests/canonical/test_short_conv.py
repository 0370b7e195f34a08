"""short_conv: every window-sum spelling of KDA's depthwise short conv becomes the convolution
`F.conv1d(window, taps, groups=C)` traces to, with the same values (up to summation order: the
measured difference is one fp32 ulp of the result), dtype and shape; a window sum multiplied in
bf16 / fp16 becomes the canonical product sum, bit for bit; look-alikes stay."""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import short_conv
from k3compile.models import k3 as k3_model
from tests.canonical.rule_checks import rewrite
from tests.conftest import TOL, rel_err
from tests.fusions.attention_checks import one_thread, step_pair  # noqa: F401
from tests.fusions.pattern_checks import targets

B, C, TAPS = 3, 24, 4
CONV = "aten.convolution.default"


_rewrite = functools.partial(rewrite, short_conv)


def _window(T=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, C, TAPS - 1 + T, generator=g).to(dtype),
            torch.randn(C, 1, TAPS, generator=g).to(dtype))


SPELLINGS = {  # name: (fn(window, w[C, 1, taps]), tokens)
    "sum_squeezed": (lambda x, w: (x * w.squeeze(1)).sum(-1), 1),
    "sum_weight_first": (lambda x, w: (w[:, 0] * x).sum(dim=2), 1),
    "sum_keepdim": (lambda x, w: (x * w.view(C, TAPS)).sum(-1, keepdim=True), 1),
    "sum_2d_weight": (lambda x, w: (x * w.reshape(1, C, TAPS)).sum(-1), 1),
    "unfold": (lambda x, w: (x.unfold(-1, TAPS, 1) * w).sum(-1), 1),
    "unfold_T3": (lambda x, w: (x.unfold(2, TAPS, 1) * w).sum(-1), 3),
    "loop_view": (lambda x, w: sum(x[..., j] * w.view(C, TAPS)[:, j] for j in range(TAPS)), 1),
    "loop_index": (lambda x, w: sum(w[:, 0, j] * x[:, :, j] for j in range(TAPS)), 1),
    "loop_acc": (lambda x, w: _acc_loop(x, w.squeeze(1)), 1),
}


def _acc_loop(x, w):
    out = x[..., 0] * w[:, 0]
    for j in range(1, TAPS):
        out = out + x[..., j] * w[:, j]
    return out


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_becomes_the_conv(name):
    fn, T = SPELLINGS[name]
    args = _window(T)
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    conv = next(node for node in after.graph.nodes if str(node.target) == CONV)
    assert conv.args[2:] == (None, [1], [0], [1], False, [0], C)  # depthwise, no padding
    assert tuple(conv.args[1].meta["val"].shape) == (C, 1, TAPS)
    assert not {"aten.sum.dim_IntList", "aten.unfold.default"} & set(targets(after))
    got, want = after(*args), before(*args)
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    assert rel_err(got, want) <= 1e-6  # conv and window sum: summation order only
    torch.testing.assert_close(got.reshape(B, C, T), F.conv1d(*args, groups=C), rtol=0, atol=0)


@pytest.mark.parametrize("upcast", ["before_squeeze", "after_squeeze"])
def test_bf16_window_convolves_in_fp32(upcast):
    """`window.float() * taps.float()` in a bf16 model: the exact upcasts stay on the conv's
    inputs, and the conv runs in fp32."""
    x, w = _window(dtype=torch.bfloat16)
    if upcast == "before_squeeze":
        fn = lambda x, w: (x.float() * w.float().squeeze(1)).sum(-1)
    else:
        fn = lambda x, w: (x.float() * w.squeeze(1).float()).sum(-1)
    before, after, n = _rewrite(fn, x, w)
    assert n == 1
    conv = next(node for node in after.graph.nodes if str(node.target) == CONV)
    assert all(a.meta["val"].dtype == torch.float32 for a in conv.args[:2])
    assert tuple(conv.args[1].meta["val"].shape) == (C, 1, TAPS)
    got, want = after(x, w), before(x, w)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got, want) <= 1e-6


LOOK_ALIKES = {
    # a real conv (padding 3, the causal conv of a prefill) is a convolution already: not touched
    "padded_conv": lambda x, w: F.conv1d(x, w, padding=TAPS - 1, groups=C),
    # products rounded to bf16, summed in fp32 by the sum's dtype: not the bf16 window sum
    "bf16_products_fp32_sum": lambda x, w: (x.bfloat16() * w.bfloat16().squeeze(1)).sum(
        -1, dtype=torch.float32),
    # a loop of adds in bf16 rounds every partial sum: neither the conv nor the product sum
    "bf16_loop_of_adds": lambda x, w: _acc_loop(x.bfloat16(), w.bfloat16().squeeze(1)).float(),
    # weights that differ per batch row: no filter
    "per_row_weights": lambda x, w: (x * x.flip(0)).sum(-1),
    # a dot over a long axis: a reduction, not a short conv
    "long_dot": lambda x, w: (x.repeat(1, 1, 8) * w.squeeze(1).repeat(1, 8)).sum(-1),
    # a loop that misses a tap, and one that takes a tap twice
    "loop_missing_tap": lambda x, w: sum(x[..., j] * w[:, 0, j] for j in range(TAPS - 1)),
    "loop_tap_twice": lambda x, w: sum(x[..., j] * w[:, 0, j] for j in (0, 1, 2, 2)),
    # a loop pairing tap j of the window with tap j+1 of the filter
    "loop_shifted": lambda x, w: sum(x[..., j] * w[:, 0, (j + 1) % TAPS] for j in range(TAPS)),
    # the sum over channels, not taps
    "sum_over_channels": lambda x, w: (x * w.squeeze(1)).sum(1),
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alike_is_left_alone(name):
    args = _window()
    before, after, n = _rewrite(LOOK_ALIKES[name], *args)
    assert n == 0
    assert targets(after) == targets(before)
    torch.testing.assert_close(after(*args), LOOK_ALIKES[name](*args), rtol=0, atol=0)


PRODUCT_SPELLINGS = {  # name: (fn(window, w[C, 1, taps]) in the window's dtype, tokens)
    "per_token": (lambda x, w: (x * w.squeeze(1)).sum(-1), 1),  # spell10's, taps [C, taps]
    "weight_first": (lambda x, w: (w.view(C, TAPS) * x).sum(dim=2), 1),
    "unfold_T3": (lambda x, w: (x.unfold(2, TAPS, 1) * w).sum(-1), 3),
    # spell12's contraction (after rule window_stack): vecdot is the mul and the sum
    "vecdot_T3": (lambda x, w: torch.linalg.vecdot(x.unfold(2, TAPS, 1), w), 3),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(PRODUCT_SPELLINGS))
def test_low_precision_window_sum_becomes_the_product_sum(name, dtype):
    """bf16 / fp16 products, summed in that dtype: `sum(unfold(window, -1, taps, 1) * w, [-1])`,
    bit for bit (the same products, each row's taps summed alike); no convolution"""
    fn, T = PRODUCT_SPELLINGS[name]
    args = _window(T, dtype)
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    assert CONV not in targets(after)
    (total,) = [x for x in after.graph.nodes if short_conv.products_conv(x) is not None]
    window, w, _ = short_conv.products_conv(total)
    assert window.op == "placeholder" and tuple(w.meta["val"].shape) == (C, 1, TAPS)
    got, want = after(*args), before(*args)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_product_sum_is_left_as_it_is():
    """the canonical product sum is no site (the rule is idempotent on it)"""
    args = _window(3, torch.bfloat16)
    before, after, n = _rewrite(lambda x, w: (x.unfold(-1, TAPS, 1) * w).sum(-1), *args)
    assert n == 0 and targets(after) == targets(before)


def test_the_product_sum_is_not_a_loop_of_bf16_adds():
    """what the look-alike computes: every partial sum rounded, another value on some outputs
    (K3's channels, 4 taps: the two differ on ~11 % of them, measured), so no rule takes it"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3 * 4096, TAPS, generator=g).bfloat16()
    w = torch.randn(3 * 4096, TAPS, generator=g).bfloat16()
    products = (x * w).sum(-1)
    adds = _acc_loop(x, w)
    assert 0.02 < (products != adds).float().mean() < 0.5


def _unfold_conv1d(window, taps, groups):
    return (window.unfold(-1, taps.shape[-1], 1) * taps).sum(-1)


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 8])
def test_kda_with_an_unfolded_conv_fuses(monkeypatch, tokens):
    """The model's KDA block with its conv written as an unfold window sum gets k3.kda_decode
    under backend="k3", and equals its own eager run."""
    conv1d = types.SimpleNamespace(**{**vars(F), "conv1d": _unfold_conv1d})
    monkeypatch.setattr(k3_model, "F", conv1d)
    want, got, eager_states, states, report = step_pair("kda", torch.float32, 2, tokens, 2,
                                                        "kda_decode")
    assert [h.op for h in report.hits] == ["k3.kda_decode"]
    for g, w in zip(got, want):
        assert rel_err(g, w) <= TOL["aten_cpu"]
    for name, s in states.items():
        assert rel_err(s, eager_states[name]) <= TOL["aten_cpu"], name


# ---- a verify step written as one conv per token -------------------------------------------------

T = 3


def _per_token(x, w, starts=range(T), dim=-1, weight=lambda w, t: w.squeeze(1)):
    return torch.stack([(x[..., t:t + TAPS] * weight(w, t)).sum(-1) for t in starts], dim)


TOKEN_SPELLINGS = {  # name: (fn(window, w), window dtype, window columns before token 0)
    "stack_of_sums": (lambda x, w: _per_token(x, w), torch.float32, 0),
    "stack_of_bf16_upcasts": (lambda x, w: torch.stack(
        [(x[..., t:t + TAPS].float() * w.squeeze(1).float()).sum(-1) for t in range(T)], -1),
        torch.bfloat16, 0),
    "cat_of_keepdim_sums": (lambda x, w: torch.cat(
        [(x[..., t:t + TAPS] * w.view(C, TAPS)).sum(-1, keepdim=True) for t in range(T)], -1),
        torch.float32, 0),
    "cat_of_conv1d": (lambda x, w: torch.cat(
        [F.conv1d(x[..., t:t + TAPS], w, groups=C) for t in range(T)], dim=2), torch.float32, 0),
    "window_with_older_columns": (lambda x, w: _per_token(x, w, starts=range(2, 2 + T)),
                                  torch.float32, 2),
}


@pytest.mark.parametrize("name", sorted(TOKEN_SPELLINGS))
def test_one_conv_per_token_becomes_one_conv(name):
    fn, dtype, skip = TOKEN_SPELLINGS[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, C, skip + TAPS - 1 + T, generator=g).to(dtype)
    w = torch.randn(C, 1, TAPS, generator=g).to(dtype)
    before, after, n = _rewrite(fn, x, w)
    assert n >= 1
    (conv,) = [node for node in after.graph.nodes if str(node.target) == CONV]
    assert tuple(conv.meta["val"].shape) == (B, C, T)  # the step's T columns, one conv
    assert conv.args[2:] == (None, [1], [0], [1], False, [0], C)
    assert "aten.cat.default" not in targets(after) and "aten.stack.default" not in targets(after)
    got, want = after(x, w), before(x, w)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got, want) <= 1e-6
    torch.testing.assert_close(got, F.conv1d(x[..., skip:].float(), w.float(), groups=C),
                               rtol=0, atol=0)


TOKEN_LOOK_ALIKES = {
    # every other column: a dilated window, not T consecutive tokens
    "every_other_column": lambda x, w: _per_token(x[..., :TAPS + 2 * T], w, starts=(0, 2, 4)),
    # the tokens in reverse order
    "tokens_reversed": lambda x, w: _per_token(x, w, starts=reversed(range(T))),
    # another filter per token
    "filter_per_token": lambda x, w: _per_token(x, w, weight=lambda w, t: w.squeeze(1) * (t + 1)),
    # stacked as [B, T, C]: the token dim is not the conv's output dim
    "stacked_on_dim_1": lambda x, w: _per_token(x, w, dim=1),
    # a token's output read on its own as well
    "token_read_twice": lambda x, w: _read_twice(x, w),
}


def _read_twice(x, w):
    outs = [(x[..., t:t + TAPS] * w.squeeze(1)).sum(-1) for t in range(T)]
    return torch.stack(outs, -1), outs[1] * 2


@pytest.mark.parametrize("name", sorted(TOKEN_LOOK_ALIKES))
def test_per_token_look_alike_keeps_its_convs(name):
    fn = TOKEN_LOOK_ALIKES[name]
    x, w = _window(T + 3)
    _, after, _ = _rewrite(fn, x, w)
    convs = [node for node in after.graph.nodes if str(node.target) == CONV]
    assert len(convs) == T and all(c.meta["val"].shape[-1] == 1 for c in convs)
    for got, want in zip(torch.utils._pytree.tree_leaves(after(x, w)),
                         torch.utils._pytree.tree_leaves(fn(x, w)), strict=True):
        assert rel_err(got, want) <= 1e-6
