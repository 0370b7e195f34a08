"""norm_linear_residual: the MoE's `routed + shared` add in the routed up-projection's epilogue."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import norm_linear_residual

from .pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite

EPS = 1e-5


def _inputs(width=64, out=128, dtype=torch.bfloat16, residual_rows=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, width, generator=g).to(dtype),
            (1 + 0.1 * torch.randn(width, generator=g)).to(dtype),
            (torch.randn(out, width, generator=g) / width**0.5).to(dtype),
            torch.randn(residual_rows, out, generator=g).to(dtype)]


def moe_out(u, norm_w, w, shared):  # LatentMoE's tail after norm_linear: routed + shared
    return torch.ops.k3.norm_linear(u, norm_w, w, EPS) + shared


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rewrites_and_equals_eager(dtype):
    args = _inputs(dtype=dtype)
    gm, report = rewrite(moe_out, args, norm_linear_residual.patterns())
    assert_rewritten_equal(gm, report, moe_out, args, "k3.norm_linear")
    (op,) = [n for n in gm.graph.nodes if str(n.target) == "k3.norm_linear.default"]
    assert len(op.args) == 5 and op.args[3] == EPS
    assert not any("add" in str(n.target) for n in gm.graph.nodes)


def test_escaping_routed_output_is_a_near_miss():
    def escaped(u, norm_w, w, shared):
        routed = torch.ops.k3.norm_linear(u, norm_w, w, EPS)  # also returned: escapes
        return routed + shared, routed

    _, report = rewrite(escaped, _inputs(), norm_linear_residual.patterns())
    assert_near_miss(report, "norm_linear_residual", "user")


def test_check_refuses_a_broadcast_residual():
    _, report = rewrite(moe_out, _inputs(residual_rows=1), norm_linear_residual.patterns())
    assert_near_miss(report, "norm_linear_residual", "check refused", "broadcast")


def moe_out_fp32(u, norm_w, w, shared):  # the weight_fp32 variant's tail (u the fp32 expert sum)
    return torch.ops.k3.norm_linear(u, norm_w, w, EPS, None, True) + shared


def test_weight_fp32_rewrites_and_keeps_the_flag():
    u, norm_w, w, shared = _inputs()
    args = [u.float() * 3, norm_w, w, shared]
    gm, report = rewrite(moe_out_fp32, args, norm_linear_residual.patterns())
    assert_rewritten_equal(gm, report, moe_out_fp32, args, "k3.norm_linear")
    (op,) = [n for n in gm.graph.nodes if str(n.target) == "k3.norm_linear.default"]
    assert op.args[-1] is True and op.args[4] is not None
    plain = moe_out(args[0].bfloat16(), *args[1:])
    assert not torch.equal(gm(*args), plain)  # the flag's rounding, not the plain one


def test_weight_fp32_refuses_a_residual_of_another_dtype():
    u, norm_w, w, shared = _inputs()
    args = [u.float(), norm_w, w, shared.float()]
    _, report = rewrite(moe_out_fp32, args, norm_linear_residual.patterns())
    assert_near_miss(report, "norm_linear_residual", "check refused", "output")
