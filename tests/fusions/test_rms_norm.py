"""rms_norm: a plain RMSNorm left after the larger fusions (layer 0's input_layernorm)."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import rms_norm

from .pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite


def norm(x, w):  # K3's RMSNorm (models/k3.py)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    return w * h.to(x.dtype)


def _args(dtype=torch.bfloat16, width=64):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 8, 64, generator=gen).to(dtype),
            (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rewrites_and_captures_eps(dtype):
    args = _args(dtype)
    gm, report = rewrite(norm, args, rms_norm.patterns())
    assert_rewritten_equal(gm, report, norm, args, "k3.rms_norm")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.rms_norm.default")
    assert op.args[-1] == 1e-5


def test_escaping_normalised_value_is_a_near_miss():
    def leaky(x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * h.to(x.dtype), h

    _, report = rewrite(leaky, _args(), rms_norm.patterns())
    assert_near_miss(report, "rms_norm", "users")


def test_check_refuses_a_broadcast_weight():
    _, report = rewrite(norm, _args(width=1), rms_norm.patterns())
    assert_near_miss(report, "rms_norm", "check refused", "does not fit width 64")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swapped_products_and_sums_match(dtype):
    """Every binary mul/add matches either operand order (k3compile.rewrite.inductor.commutative)."""
    def swapped(x, w):
        h = x.float()
        h = torch.rsqrt(1e-5 + h.pow(2).mean(-1, keepdim=True)) * h
        return h.to(x.dtype) * w

    args = _args(dtype)
    gm, report = rewrite(swapped, args, rms_norm.patterns())
    assert_rewritten_equal(gm, report, swapped, args, "k3.rms_norm")


def test_swapped_spelling_with_an_escaping_value_is_still_a_near_miss():
    """Trying the other operand order must not turn a refused site into a match."""
    def leaky(x, w):
        h = x.float()
        h = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * h
        return h.to(x.dtype) * w, h

    _, report = rewrite(leaky, _args(), rms_norm.patterns())
    assert_near_miss(report, "rms_norm", "users")
