"""token_select: a T = 1 token selected from a short conv's output before the per-token feature
math (split, head view, L2 norm, casts) moves below that math, where the KDA pattern selects it;
bit for bit the same values. Look-alikes stay: a select not below a convolution, a select of a
dim of size > 1, a select read by an unsqueeze (the delta rule's), a reduction without keepdim,
a binary op with a tensor that is not the same token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import token_select

from .rule_checks import assert_same, rewrite

B, C, TAPS, H = 2, 24, 4, 2
aten = torch.ops.aten


def _conv(window, w):
    """the canonical time-major conv of a [B, TAPS - 1 + T, C] window: [B, T, C]"""
    return F.silu(F.conv1d(window.transpose(1, 2), w, groups=C)).transpose(1, 2)


def _l2(x, scale=1.0):
    return x * torch.rsqrt(torch.sum(torch.square(x), -1, keepdim=True) + 1e-6) * scale


def features(window, w):
    """spell9's cell after rule cell_conv: the token first, then q | k | v cast to fp32 (bf16:
    a convert), heads, L2 norms"""
    y = _conv(window, w)[:, 0]
    q, k, v = (t.float().unflatten(-1, (H, C // 3 // H)) for t in y.split(C // 3, -1))
    return _l2(q, 0.5).unsqueeze(-1), _l2(k), v


def _args(tokens=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, TAPS - 1 + tokens, C, generator=g).to(dtype),
            torch.randn(C, 1, TAPS, generator=g).to(dtype)]


def _selects(gm):
    return [n for n in gm.graph.nodes if n.target is aten.select.int]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_token_is_selected_after_the_feature_math(dtype):
    args = _args(dtype=dtype)
    before, after, n = rewrite(token_select.RULE, features, *args, joint=True)
    assert n > 0
    sels = _selects(after)
    assert len(sels) == 3  # one per q / k / v, none left on the conv output
    # q and k after their L2 norms, v after its head view; each on [B, 1, H, K]
    for s in sels:
        assert s.args[1] == 1 and len(s.args[0].meta["val"].shape) == 4
    assert sorted(str(s.args[0].target) for s in sels) == sorted(
        ["aten.mul.Tensor", "aten.mul.Tensor", "aten.view.default"])
    assert_same(after(*args), before(*args))


def _not_from_a_conv(window, w):
    """the same math on a token of the window itself (no convolution above it)"""
    y = window[:, :1].clone()[:, 0]
    return _l2(y.unflatten(-1, (H * 3, C // 3 // H)))


def _tokens(window, w):
    """T = 2: selecting token 0 first is less work, and the pattern has no such form"""
    y = _conv(window, w)[:, 0]
    return _l2(y.unflatten(-1, (H * 3, C // 3 // H)))


def _unsqueezed(window, w):
    """the token read by an unsqueeze (the delta rule's): nothing to move"""
    return _conv(window, w)[:, 0].unsqueeze(-1) * 2


def _no_keepdim(window, w):
    """a reduction without keepdim (a row sum, not a norm's)"""
    return torch.sum(_conv(window, w)[:, 0], -1)


def _other_operand(window, w):
    """a product with a tensor that is not the same token"""
    return _conv(window, w)[:, 0] * window[:, 0]


@pytest.mark.parametrize(("fn", "tokens"), [(_not_from_a_conv, 1), (_tokens, 2),
                                            (_unsqueezed, 1), (_no_keepdim, 1),
                                            (_other_operand, 1)])
def test_look_alikes_stay(fn, tokens):
    args = _args(tokens)
    before, after, n = rewrite(token_select.RULE, fn, *args, joint=True)
    assert n == 0
    assert_same(after(*args), before(*args))
