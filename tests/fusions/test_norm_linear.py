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


# weight_fp32: the norm of an fp32 u (the routed experts' unrounded sum) with the weight multiplied
# in fp32 before the one rounding to the GEMM's dtype, in two spellings: torch's F.rms_norm with
# the weight upcast (tests/models/redteam_k3.py) and an RMSNorm module whose bf16 weight meets the
# fp32 row by type promotion (tests/models/spell5_k3.py)
def up_f_rms_norm(u, norm_w, w):
    """`F.rms_norm(u, (L,), norm_w.float(), eps).to(w.dtype)` as the compiled graph has it
    (torch's decomposition, functionalised: a mean over dim 1, eps float32-rounded)."""
    r = torch.rsqrt(torch.mean(u.pow(2), [1], keepdim=True) + 9.999999747378752e-06)
    return F.linear((u * r * norm_w.float()).to(w.dtype), w)


def up_module_norm(u, norm_w, w):
    xf = u.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    return F.linear((xf.type_as(u) * norm_w).to(w.dtype), w)


def _fp32_inputs(width=64, out=128):
    u, norm_w, w = _inputs(width, out)
    return [u.float() * 3, norm_w, w]


@pytest.mark.parametrize("fn", [up_f_rms_norm, up_module_norm], ids=lambda f: f.__name__)
def test_weight_fp32_rewrites_two_spellings_bit_for_bit(fn):
    args = _fp32_inputs()
    gm, report = rewrite(fn, args, norm_linear.patterns())
    assert_rewritten_equal(gm, report, fn, args, "k3.norm_linear")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.norm_linear.default")
    assert op.args[4:] == (None, True) and op.meta["val"].dtype == torch.bfloat16
    # the plain op's rounding (normalised row rounded, weight multiplied in bf16) differs
    plain = torch.ops.k3.norm_linear(args[0].bfloat16(), *args[1:], 1e-5)
    assert not torch.equal(plain, fn(*args))


def test_weight_fp32_refuses_a_bf16_row_normalised_in_bf16():
    """u bf16 normalised then multiplied by the weight in bf16: K3's norm (the plain variant),
    not this one; and an fp32 u whose norm output is rounded before the weight is neither."""
    def rounded_first(u, norm_w, w):
        xf = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-5)
        return F.linear(xf.to(w.dtype) * norm_w, w)

    args = _fp32_inputs()
    gm, report = rewrite(rounded_first, args, norm_linear.patterns())
    assert not [h for h in report.hits if "weight_fp32" in h.pattern]
    torch.testing.assert_close(gm(*args), rounded_first(*args), rtol=0, atol=0)


def test_weight_fp32_leaves_an_fp32_gemm_to_the_plain_variant():
    """fp32 weights: one rounding in fp32 is the plain fp32 norm; the plain variant takes it
    (the weight_fp32 variants, traced with bf16 casts, do not match an fp32 graph)."""
    u, norm_w, w = _fp32_inputs()
    args = [u, norm_w.float(), w.float()]
    gm, report = rewrite(up_f_rms_norm, args, norm_linear.patterns())
    assert_rewritten_equal(gm, report, up_f_rms_norm, args, "k3.norm_linear")
    assert report.hits[0].pattern == "norm_linear[float32]"
    (op,) = [n for n in gm.graph.nodes if str(n.target) == "k3.norm_linear.default"]
    assert op.args[4:] == ()
    _, report = rewrite(up_f_rms_norm, args, norm_linear.patterns()[2:])
    assert_near_miss(report, "norm_linear[bfloat16,weight_fp32")


def test_weight_fp32_escaping_norm_is_a_near_miss():
    def escaped(u, norm_w, w):
        h = (u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w).to(w.dtype)
        return F.linear(h, w), h

    _, report = rewrite(escaped, _fp32_inputs(), norm_linear.patterns())
    assert_near_miss(report, "norm_linear", "user")


def test_weight_fp32_check_refuses_unaligned_width():
    _, report = rewrite(up_module_norm, _fp32_inputs(width=60), norm_linear.patterns())
    assert_near_miss(report, "norm_linear[bfloat16,weight_fp32", "check refused",
                     "multiples of 8")
