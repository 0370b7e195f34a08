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
