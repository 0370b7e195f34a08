"""head_repeat: a per-head vector repeated over its head's channels on flat [N, H*D] rows, then
viewed per head (spell10's KDA decay `exp(A_log).repeat_interleave(D) * (graw + dt_bias)`),
becomes the product on the per-head view, bit for bit; a tiled vector (`repeat`), a product read
flat elsewhere, a sum in the chain and a view that is no (H, D) split stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import head_repeat
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.canonical.spell10_kda import assert_kda_fuses_with_only

B, T, H, D = 2, 3, 4, 8
W = H * D


def _args(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(H, generator=g), torch.randn(B * T, W, generator=g).to(dtype),
            torch.randn(W, generator=g))


def spell10_decay(a_log, graw, dt_bias):  # spell10's flat decay, viewed [B, T, H, D] last
    z = torch.exp(a_log).repeat_interleave(D) * (graw.float() + dt_bias)
    return torch.exp(z.sigmoid().mul(-5.0)).view(B, T, H, D)


def through_rows_view(a_log, graw, dt_bias):  # viewed [B, T, W] first, no bias add
    z = graw.float() * a_log.repeat_interleave(D)
    return torch.sigmoid(z).view(B, T, W).view(B, T, H, D)


def per_head(a_log, graw, dt_bias):  # the pattern's form (spell10's probe `decay_per_head`)
    z = torch.exp(a_log)[:, None] * (graw.float().view(B, T, H, D) + dt_bias.view(H, D))
    return torch.exp(-5.0 * torch.sigmoid(z))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", [spell10_decay, through_rows_view])
def test_a_repeated_head_vector_broadcasts_per_head(fn, dtype):
    args = _args(dtype)
    before, after, n = rewrite(head_repeat.RULE, fn, *args)
    assert n == 1
    assert "aten.expand.default" not in targets(after)
    assert "aten.clone.default" not in targets(after)
    assert_same(after(*args), before(*args))


def test_the_decay_is_the_patterns_form():
    args = _args()
    _, after, _ = rewrite(head_repeat.RULE, spell10_decay, *args)
    assert_same(after(*args), per_head(*args))
    muls = [x for x in after.graph.nodes if x.target is torch.ops.aten.mul.Tensor]
    assert [tuple(m.meta["val"].shape) for m in muls] == [(B, T, H, D)] * 2


def tiled(a_log, graw, dt_bias):  # a.repeat(D): element j is a[j % H], not a[j // D]
    return torch.sigmoid(a_log.repeat(D) * graw).view(B, T, H, D)


def read_flat(a_log, graw, dt_bias):
    z = a_log.repeat_interleave(D) * graw
    return torch.sigmoid(z).view(B, T, H, D), z


def summed(a_log, graw, dt_bias):  # a reduction between the product and the view
    z = a_log.repeat_interleave(D) * graw
    return z.sum(0, keepdim=True).expand(B * T, W).reshape(B, T, H, D)


def other_split(a_log, graw, dt_bias):  # the channels viewed (D, H): no per-head view
    return torch.sigmoid(a_log.repeat_interleave(D) * graw).view(B, T, D, H)


@pytest.mark.parametrize("fn", [tiled, read_flat, summed, other_split])
def test_lookalikes_stay(fn):
    args = _args()
    before, after, n = rewrite(head_repeat.RULE, fn, *args)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(*args), before(*args))


@pytest.mark.slow
def test_spell10_kda_fuses_with_its_flat_decay():
    """spell10 with its decay on flat [N, W] rows and its other KDA idioms on fused spellings"""
    assert_kda_fuses_with_only("decay_per_head")
