"""sigmoid_round: a bf16 / fp16 value's sigmoid computed on its fp32 upcast and rounded back
(spell14's KDA output gate `torch.sigmoid(g.view(B, T, H, K).float()).to(x.dtype)`) becomes the
sigmoid in that dtype, as `k3compile/math.py` and the kda_decode pattern write it; bit-equal. A
round to another dtype, an fp32 sigmoid also read in fp32, an fp32 input and a computing op
under the sigmoid stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import sigmoid_round
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite

B, T, H, K = 2, 1, 4, 8
CAST = sigmoid_round.CAST


def _x(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_low_precision_sigmoid_is_the_fp32_one_rounded_once(dtype):
    """why the rule is exact: over every bf16 / fp16 bit pattern (NaNs and infinities too) torch's
    sigmoid in that dtype equals the fp32 sigmoid of the upcast, rounded, bit for bit; and on a
    strided view (the non-vectorised path)"""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    got, want = torch.sigmoid(x), torch.sigmoid(x.float()).to(dtype)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))
    y = x[:3000].view(30, 100)[:, 1::7]
    assert torch.equal(torch.sigmoid(y).view(torch.int16),
                       torch.sigmoid(y.float()).to(dtype).view(torch.int16))


def _heads(g):
    return torch.sigmoid(g.view(B, T, H, K)) * 2


# spelling -> (its function, the canonical form it becomes)
SPELLINGS = {
    # spell14 (gpt-fast's): heads, upcast, sigmoid, back to the activations' dtype
    "spell14": (lambda g: torch.sigmoid(g.view(B, T, H, K).float()).to(g.dtype) * 2, _heads),
    # the upcast first (rule cast_view's order), a method call, `.to(dtype=...)`
    "cast_then_view": (lambda g: g.float().view(B, T, H, K).sigmoid().to(dtype=g.dtype) * 2,
                       _heads),
    # no view; F.sigmoid
    "flat": (lambda g: torch.nn.functional.sigmoid(g.float()).to(g.dtype) * 2,
             lambda g: torch.sigmoid(g) * 2),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_rounded_fp32_sigmoid_becomes_the_low_precision_one(name, dtype):
    fn, canonical = SPELLINGS[name]
    args = (_x(B, T, H * K, dtype=dtype),)
    before, after, n = rewrite(sigmoid_round, fn, *args)
    assert n == 1 and not any(n.target is CAST for n in after.graph.nodes)
    assert ops(after) == ops(rewrite(sigmoid_round, canonical, *args)[1])
    assert_same(before, after, args)


LOOKALIKES = {
    # an fp16 value's sigmoid rounded to bf16: no sigmoid in one dtype rounds so
    "other_dtype": (lambda g: torch.sigmoid(g.float()).to(torch.bfloat16), torch.float16),
    # the fp32 sigmoid is read too: its unrounded values are used
    "read_in_fp32": (lambda g: (s := torch.sigmoid(g.float())).to(g.dtype) * 2 + s.sum(),
                     torch.bfloat16),
    # an fp32 value: no upcast
    "fp32_input": (lambda g: torch.sigmoid(g).to(torch.bfloat16), torch.float32),
    # a product under the sigmoid, computed in fp32 and not rounded to bf16
    "computed": (lambda g: torch.sigmoid(g.float() * 3).to(g.dtype), torch.bfloat16),
    # fp32 -> fp64 -> fp32: not a bf16 / fp16 upcast
    "fp64": (lambda g: torch.sigmoid(g.double()).float(), torch.float32),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_look_alikes_stay(name):
    fn, dtype = LOOKALIKES[name]
    args = (_x(B, T, H * K, dtype=dtype),)
    before, after, n = rewrite(sigmoid_round, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)
