"""moe_front: the fp32 router GEMM and the latent down GEMM on the same x become one op."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from k3compile.patterns import moe_front

from .pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite, targets


def _inputs(d=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, d, generator=g).to(dtype), torch.randn(16, d, generator=g).to(dtype),
            torch.randn(32, d, generator=g).to(dtype)]


def front(x, wr, wd):  # MoEGate's scores choosing experts and LatentMoE's routed_expert_down_proj
    scores = torch.sigmoid(F.linear(x.float(), wr.float()))
    return scores, F.linear(x, wd), torch.topk(scores + 0.5, 4, dim=-1)[1]


def gated(x, wr, wd):  # KDA's beta or MLA's output gate beside another GEMM: no top-k
    return torch.sigmoid(F.linear(x.float(), wr.float())), F.linear(x, wd)


def test_rewrites_bf16_and_fp32():
    for dtype in (torch.bfloat16, torch.float32):
        args = _inputs(dtype=dtype)
        gm, report = rewrite(front, args, moe_front.patterns())
        assert_rewritten_equal(gm, report, front, args, "k3.moe_front")
        assert "aten.mm.default" not in targets(gm)  # both GEMMs taken, not the router's twice


def test_escaping_logits_is_a_near_miss():
    def escaped(x, wr, wd):
        logits = F.linear(x.float(), wr.float())  # also read outside: escapes the fusion
        scores = torch.sigmoid(logits)
        return scores, F.linear(x, wd), logits * 2, torch.topk(scores, 4, dim=-1)[1]

    _, report = rewrite(escaped, _inputs(), moe_front.patterns())
    assert_near_miss(report, "moe_front", "user")


def test_a_sigmoid_that_chooses_nothing_is_no_router():
    for dtype in (torch.bfloat16, torch.float32):  # fp32: the casts vanish, any two GEMMs look alike
        gm, report = rewrite(gated, _inputs(dtype=dtype), moe_front.patterns())
        assert not report.hits and "k3.moe_front.default" not in targets(gm)
        assert_near_miss(report, "moe_front", "check refused", "feeds no top-k")


def test_check_refuses_unaligned_hidden():
    _, report = rewrite(front, _inputs(d=36), moe_front.patterns())
    assert_near_miss(report, "moe_front", "check refused", "not a multiple of 8")


def _fp32_router(args):
    """bf16 x and latent weight beside an fp32 router that bf16 cannot hold (fp32 masters under
    torch.autocast, the router in an fp32 island: spell11)."""
    x, wr, wd = args
    g = torch.Generator().manual_seed(1)
    return [x, wr.float() * (1 + 1e-3 * torch.randn(wr.shape, generator=g)), wd]


def test_fp32_router_beside_bf16_x_fuses_as_its_variant():
    """Only x is cast: the router_fp32 variant takes both GEMMs, the op reads the fp32 router as
    it is, bit-equal to the unfused graph (not to a router rounded to bf16)."""
    args = _fp32_router(_inputs())
    gm, report = rewrite(front, args, moe_front.patterns())
    assert_rewritten_equal(gm, report, front, args, "k3.moe_front")
    assert [h.pattern for h in report.hits] == ["moe_front[bfloat16,router_fp32]"]
    assert "aten.mm.default" not in targets(gm)
    rounded = front(args[0], args[1].bfloat16(), args[2])[0]
    assert not torch.equal(gm(*args)[0], rounded)


def test_fp32_router_gate_that_chooses_nothing_is_no_router():
    """Look-alike: an fp32 gate weight beside bf16 x whose sigmoid feeds no top-k (KDA's beta,
    MLA's output gate in an fp32 island): refused, the graph computes as before."""
    args = _fp32_router(_inputs())
    gm, report = rewrite(gated, args, moe_front.patterns())
    assert not report.hits and "k3.moe_front.default" not in targets(gm)
    assert_near_miss(report, "moe_front[bfloat16,router_fp32]", "feeds no top-k")
    for got, want in zip(gm(*args), gated(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
