"""baddbmm_mask: scores as one `baddbmm` of an additive where(visible, 0, -inf) bias (spell12's
MLA attention: the bias viewed to [B, T·H, L], `alpha` the softmax scale) become
`masked_fill(alpha · bmm, ~visible, -inf)`: -inf at the same places, the rest the same product
(fp32 within an ulp, bf16 one rounding more), the softmax after it the same. A bias of other
values (a finite mask value, not 0 where visible), a negative beta and a bias that is not a
`where` of literals stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import baddbmm_mask
from tests.canonical.rule_checks import assert_same, rewrite, targets

_rewrite = functools.partial(rewrite, baddbmm_mask.RULE)
B, T, H, L, W = 2, 3, 4, 10, 24
SCALE = 0.125 ** 0.5
INF = float("-inf")


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T * H, W, generator=gen).to(dtype)
    cache = torch.randn(B, L, W, generator=gen).to(dtype)
    pos = torch.tensor([[2, 3, 4], [6, 7, 8]])
    return q, cache, pos


def _bias(pos, dtype, values=(0.0, INF)):  # spell12's: where over [B, T, L], viewed [B, T·H, L]
    valid = torch.arange(L) <= pos[..., None]
    bias = torch.where(valid, *values).to(dtype)
    return bias[:, :, None, :].expand(B, T, H, L).reshape(B, T * H, L)


def _spell12(q, cache, pos):
    s = torch.baddbmm(_bias(pos, q.dtype), q, cache.transpose(1, 2), alpha=SCALE)
    return s, s.float().softmax(-1)


def _masked_true_beta(q, cache, pos):
    """where(hidden, -inf, 0) on [B, 1, L] (broadcast over the rows), beta 0.5, alpha 1."""
    hidden = torch.arange(L) > pos[:, :1, None]  # [B, 1, L]
    bias = torch.where(hidden, INF, 0.0).to(q.dtype)
    return torch.baddbmm(bias, q, cache.transpose(1, 2), beta=0.5).softmax(-1)


def _beta_zero(q, cache, pos):
    """beta 0: baddbmm ignores its input (the -inf included)."""
    return torch.baddbmm(_bias(pos, q.dtype), q, cache.transpose(1, 2), beta=0, alpha=SCALE)


def _assert_close_product(got, want, dtype):
    """-inf (and p = 0) at the same places; elsewhere within the rounding of the scaled product
    (bf16: one rounding more, an ulp of scores of magnitude <= 2 also in the softmax after)."""
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want),
                    strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(torch.isneginf(g), torch.isneginf(w)) and torch.equal(g == 0, w == 0)
        finite = torch.isfinite(w)
        torch.testing.assert_close(g[finite].float(), w[finite].float(), rtol=2 * ulp,
                                   atol=1e-6 if dtype == torch.float32 else 4 * ulp)


@pytest.mark.parametrize("fn", [_spell12, _masked_true_beta, _beta_zero])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bias_becomes_a_mask(fn, dtype):
    args = _inputs(dtype)
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    assert "aten.baddbmm.default" not in targets(after) and "aten.bmm.default" in targets(after)
    assert ("aten.masked_fill.Scalar" in targets(after)) == (fn is not _beta_zero)
    _assert_close_product(after(*args), before(*args), dtype)


def test_fp32_small_inner_dim_is_bit_equal():
    """Measured on CPU: fp32 baddbmm and bmm·alpha agree bit for bit at inner dim 24."""
    args = _inputs()
    before, after, n = _rewrite(_spell12, *args)
    assert n == 1
    assert_same(after(*args), before(*args))


def _finite_mask(q, cache, pos):
    return torch.baddbmm(_bias(pos, q.dtype, (0.0, -1e4)), q, cache.transpose(1, 2), alpha=SCALE)


def _not_zero_where_visible(q, cache, pos):
    return torch.baddbmm(_bias(pos, q.dtype, (0.5, INF)), q, cache.transpose(1, 2), alpha=SCALE)


def _negative_beta(q, cache, pos):
    return torch.baddbmm(_bias(pos, q.dtype), q, cache.transpose(1, 2), beta=-1.0, alpha=SCALE)


def _bias_of_values(q, cache, pos):
    """An additive bias computed from values (an ALiBi-like slope), not a where of literals."""
    bias = (torch.arange(L) - pos[..., None]).to(q.dtype) * 0.25
    bias = bias[:, :, None, :].expand(B, T, H, L).reshape(B, T * H, L)
    return torch.baddbmm(bias, q, cache.transpose(1, 2), alpha=SCALE)


@pytest.mark.parametrize("fn", [_finite_mask, _not_zero_where_visible, _negative_beta,
                                _bias_of_values])
def test_other_biases_stay(fn):
    args = _inputs()
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), before(*args))
