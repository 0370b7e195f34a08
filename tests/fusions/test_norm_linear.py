"""norm_linear: the routed latent's RMSNorm and the up-projection GEMM as one op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import norm_linear

from .pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite


def _inputs(width=64, out=128, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, width, generator=g).to(dtype),
            (1 + 0.1 * torch.randn(width, generator=g)).to(dtype),
            (torch.randn(out, width, generator=g) / width**0.5).to(dtype)]


def rms(u, w, eps=1e-5):  # K3's RMSNorm
    h = u.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(u.dtype)


def up(u, norm_w, w):
    return F.linear(rms(u, norm_w), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rewrites_and_captures_eps(dtype):
    args = _inputs(dtype=dtype)
    gm, report = rewrite(up, args, norm_linear.patterns())
    assert_rewritten_equal(gm, report, up, args, "k3.norm_linear")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.norm_linear.default")
    assert op.args[-1] == 1e-5


def test_escaping_normalised_value_is_a_near_miss():
    def escaped(u, norm_w, w):
        h = rms(u, norm_w)  # also returned: escapes the fusion
        return F.linear(h, w), h

    _, report = rewrite(escaped, _inputs(), norm_linear.patterns())
    assert_near_miss(report, "norm_linear", "user")


def test_check_refuses_unaligned_width():
    _, report = rewrite(up, _inputs(width=60), norm_linear.patterns())
    assert_near_miss(report, "norm_linear", "check refused", "multiples of 8")
