"""window_stack: a short conv's windows stacked from shifted slices of the window tensor (spell12's
`stack([xs[..., j:j + T] ...], -1)`) become `xs.unfold(-1, K, 1)`, bit for bit, which rule
short_conv then takes as the canonical convolution (in bf16: the canonical product sum); look-alikes
stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import short_conv, window_stack

from .rule_checks import assert_same, rewrite, targets

B, C, K = 2, 12, 4
_rewrite = functools.partial(rewrite, window_stack)


def _args(tokens=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, C, K - 1, generator=g).to(dtype),
            torch.randn(B, tokens, C, generator=g).to(dtype),
            torch.randn(C, K, generator=g).to(dtype)]


def spell12(state, x, taps):
    """tests/models/spell12_k3.py's KDA.conv: the windows contracted by vecdot"""
    T = x.shape[1]
    xs = torch.cat([state, x.transpose(1, 2)], -1)
    windows = torch.stack([xs[..., j:j + T] for j in range(K)], -1)
    return torch.nn.functional.silu(torch.linalg.vecdot(windows, taps[:, None, :])), xs[..., T:]


def summed(state, x, taps):
    """the windows of a given window tensor, multiplied and summed"""
    T = x.shape[1]
    xs = torch.cat([state, x.transpose(1, 2)], -1)
    windows = torch.stack([xs[..., j:j + T] for j in range(K)], dim=3)
    return (windows * taps[:, None, :]).sum(-1)


def last_as_input(state, x, taps):
    """spell12's windows as Dynamo traces them: the last T columns are the cat's input itself
    (a second transpose of x)"""
    T = x.shape[1]
    xs = torch.cat([state, x.transpose(1, 2)], -1)
    windows = torch.stack([xs[..., j:j + T] for j in range(K - 1)] + [x.transpose(1, 2)], -1)
    return torch.linalg.vecdot(windows, taps[:, None, :])


@pytest.mark.parametrize("fn", [spell12, summed, last_as_input])
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_stacked_windows_become_an_unfold(fn, tokens):
    args = _args(tokens)
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    assert "aten.unfold.default" in targets(after) and "aten.cat.default" in targets(before)
    assert_same(after(*args), before(*args))
    # the form short_conv takes: one depthwise convolution
    assert short_conv.apply(after.graph) == 1
    after.graph.eliminate_dead_code()
    after.recompile()
    assert "aten.convolution.default" in targets(after)
    torch.testing.assert_close(after(*args), before(*args), rtol=1e-6, atol=1e-6)


def out_of_order(state, x, taps):
    xs = torch.cat([state, x.transpose(1, 2)], -1)
    return torch.stack([xs[..., j:j + 1] for j in (1, 0, 2, 3)], -1)


def strided(state, x, taps):
    xs = torch.cat([state, x.transpose(1, 2), x.transpose(1, 2)], -1)
    return torch.stack([xs[..., j:j + 2:2] for j in range(K)], -1)


def other_dim(state, x, taps):
    xs = torch.cat([state, x.transpose(1, 2)], -1)
    return torch.stack([xs[..., j:j + 1] for j in range(K)], -2)


def two_tensors(state, x, taps):
    xs = torch.cat([state, x.transpose(1, 2)], -1)
    ys = xs * 2
    return torch.stack([(xs if j % 2 else ys)[..., j:j + 1] for j in range(K)], -1)


def last_of_another(state, x, taps):
    """the last piece a transpose of another tensor than the cat's input"""
    xs = torch.cat([state, x.transpose(1, 2)], -1)
    return torch.stack([xs[..., j:j + 1] for j in range(K - 1)] + [(x * 2).transpose(1, 2)], -1)


@pytest.mark.parametrize("fn", [out_of_order, strided, other_dim, two_tensors, last_of_another])
def test_look_alikes_stay(fn):
    args = _args()
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)


@pytest.mark.parametrize("tokens", [1, 3])
def test_a_bf16_window_becomes_the_product_sum(tokens):
    """contracted in bf16, each product rounds (session 34): the stack becomes the unfold, bit
    for bit, and short_conv then writes the canonical product sum (kda_decode's
    `conv_products_rounded`), bit for bit, no convolution"""
    args = _args(tokens, dtype=torch.bfloat16)
    before, after, n = _rewrite(spell12, *args)
    assert n == 1 and "aten.stack.default" not in targets(after)
    assert_same(after(*args), before(*args))
    assert short_conv.RULE.apply(after.graph) == 1
    after.graph.eliminate_dead_code()
    after.recompile()
    assert "aten.convolution.default" not in targets(after)
    assert any(short_conv.products_conv(x) is not None for x in after.graph.nodes)
    assert_same(after(*args), before(*args))
