"""norm_round: an RMSNorm of fp32 activations rounded to bf16 / fp16 after becomes the norm of the
activations rounded first (math.rms_norm's order; KDA's output norm in patterns/kda_decode.py),
within one ulp of that dtype; a norm of an upcast, a norm kept in fp32 or read in fp32 stays."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import norm_round
from k3compile.math import rms_norm
from tests.canonical.rule_checks import assert_same, rewrite
from tests.fusions.pattern_checks import targets

EPS = 1e-5


_rewrite = functools.partial(rewrite, norm_round, joint=True)


def _fp32_norm(dtype):
    """tests/spellings/blind_k3.py's KDA output norm: the fp32 recurrence output normalised in
    fp32, rounded, scaled by the weight"""
    def fn(o, w):
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS)
        return o.to(dtype) * w
    return fn


def _squared(dtype):
    def fn(o, w):
        return w * (o * torch.rsqrt((o * o).mean(dim=-1, keepdim=True) + EPS)).to(dtype)
    return fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [_fp32_norm, _squared])
def test_fp32_norm_rounded_after_becomes_the_norm_of_the_rounded_input(dtype, make):
    g = torch.Generator().manual_seed(0)
    o, w = torch.randn(64, 2, 2, 32, generator=g) * 3, torch.randn(32, generator=g).to(dtype)
    before, after, n = _rewrite(make(dtype), o, w)
    assert n == 1
    # the canonical form, bit for bit: math.rms_norm of o rounded to the activations' dtype
    assert_same(after(o, w), rms_norm(o.to(dtype), w, EPS))
    # within an ulp of the rounded norm, carried through the weight's product (which rounds
    # again): two ulps of the output
    got, want = after(o, w).float(), before(o, w).float()
    ulp = torch.finfo(dtype).eps * torch.maximum(got.abs(), want.abs())
    assert bool(((got - want).abs() <= 2 * ulp).all())


def _upcast(o, w):
    """the canonical form itself: the norm of an upcast of bf16"""
    return rms_norm(o.bfloat16(), w, EPS)


def _kept_fp32(o, w):
    """an fp32 norm that stays fp32"""
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS) * w.float()


def _read_fp32(o, w):
    """the normalised row also read in fp32: rounding the input would change that read"""
    h = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS)
    return h.bfloat16() * w, h.sum(-1)


def _other_dim(o, w):
    """a mean over another dim than the normalised one"""
    return (o * torch.rsqrt(o.pow(2).mean(1, keepdim=True) + EPS)).bfloat16() * w


@pytest.mark.parametrize("fn", [_upcast, _kept_fp32, _read_fp32, _other_dim])
def test_look_alikes_stay(fn):
    g = torch.Generator().manual_seed(0)
    o, w = torch.randn(4, 2, 2, 32, generator=g), torch.randn(32, generator=g).bfloat16()
    before, after, n = _rewrite(fn, o, w)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(o, w), before(o, w))
