"""square: `x * x` read by a last-dim mean / sum (a JAX port's norms, spell9) becomes
`x.pow(2)`, bit for bit; the canonical RMS norm's and l2 norm's ops then appear; products of two
different tensors, a square read elsewhere, and reductions over another dim stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import square
from k3compile.math import l2norm, rms_norm
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.fusions.pattern_checks import graph

MUL, POW = "aten.mul.Tensor", "aten.pow.Tensor_Scalar"


def _x(dtype=torch.float32, shape=(2, 1, 64), seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def _jax_rms(x, w=None):
    """spell9's rms_norm: fp32, x * rsqrt(mean(x * x) + eps), times the scale, cast back."""
    h = x.float()
    h = h * torch.rsqrt(torch.mean(h * h, -1, keepdim=True) + 1e-5)
    return (h * w.float() if w is not None else h).to(x.dtype)


SPELLED = {
    "rms_mean": lambda x: _jax_rms(x),
    "rms_weight": lambda x: _jax_rms(x, torch.linspace(0.5, 1.5, x.shape[-1]).to(x.dtype)),
    "l2_sum": lambda x: x * torch.rsqrt(torch.sum(x * x, -1, keepdim=True) + 1e-6),
    "sum_no_keepdim": lambda x: (x * x).sum(-1),
    "mean_positive_dim": lambda x: torch.mean(x * x, x.dim() - 1),
}
def _read_elsewhere(sq):
    return torch.mean(sq, -1, keepdim=True), sq + 1


LOOKALIKES = {
    "two_tensors": lambda x: torch.mean(x * (x + 1), -1, keepdim=True),
    "read_elsewhere": lambda x: _read_elsewhere(x * x),
    "other_dim": lambda x: torch.mean(x * x, 1, keepdim=True),
    "both_dims": lambda x: torch.mean(x * x, (-2, -1)),
    "not_reduced": lambda x: x * x + x,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SPELLED))
def test_self_product_under_a_last_dim_reduction_is_a_square(name, dtype):
    x = _x(dtype)
    before, after, n = rewrite(square.RULE, SPELLED[name], x, joint=True)
    assert n == 1
    assert POW in targets(after)
    assert_same(after(x), before(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norms_then_trace_as_the_canonical_ones(dtype):
    """spell9's unweighted norm becomes the ops of math.rms_norm's normalisation, its l2 norm
    those of math.l2norm (the multiset of ATen ops, the weight's multiply aside)"""
    x = _x(dtype)
    _, after, _ = rewrite(square.RULE, SPELLED["rms_mean"], x, joint=True)
    w = torch.ones(x.shape[-1], dtype=dtype)
    canonical = graph(lambda x, w: rms_norm(x, w, 1e-5), x, w, joint=True)
    assert set(targets(after)) <= set(targets(canonical))
    x32 = _x()
    _, after, _ = rewrite(square.RULE, SPELLED["l2_sum"], x32, joint=True)
    assert sorted(targets(after)) == sorted(targets(graph(lambda x: l2norm(x, 1e-6), x32,
                                                          joint=True)))


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_stay(name):
    x = _x()
    before, after, n = rewrite(square.RULE, LOOKALIKES[name], x, joint=True)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(x), before(x))


def test_pow_is_the_product_bit_for_bit():
    """ATen's pow(x, 2) rounds as x * x does, over a wide range (fp32, bf16, fp16)"""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.linspace(-200, 200, 100_003).to(dtype)
        assert_same(x.pow(2), x * x)
