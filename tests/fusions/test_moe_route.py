"""moe_route: sigmoid scores, bias-corrected top-k and renormalised unbiased weights."""

from __future__ import annotations

import torch
from k3compile.patterns import moe_route

from .pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 16, generator=g).to(dtype), 0.1 * torch.randn(16, generator=g)]


def route(logits, bias, top_k=4, scaling=1.0):  # MoEGate after its GEMM
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + bias, top_k, dim=-1)
    weights = scores.gather(-1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def _route_with(k, scaling):
    def fn(logits, bias):
        return route(logits, bias, k, scaling)

    return fn


def test_rewrites_and_captures_top_k_and_scaling():
    args = _inputs()
    for k, scaling in ((4, 1.0), (2, 2.5)):
        fn = _route_with(k, scaling)
        gm, report = rewrite(fn, args, moe_route.patterns())
        assert_rewritten_equal(gm, report, fn, args, "k3.moe_route")
        op = next(n for n in gm.graph.nodes if str(n.target) == "k3.moe_route.default")
        assert op.args[2:] == (k, scaling)


def test_escaping_scores_is_a_near_miss():
    def escaped(logits, bias):
        scores = torch.sigmoid(logits)  # also returned: escapes the fusion
        _, ids = torch.topk(scores + bias, 4, dim=-1)
        weights = scores.gather(-1, ids)
        return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * 1.0, scores

    _, report = rewrite(escaped, _inputs(), moe_route.patterns())
    assert_near_miss(report, "moe_route", "user")


def test_check_refuses_bf16_logits():
    args = _inputs(torch.bfloat16)
    _, report = rewrite(lambda lg, b: route(lg, b), args, moe_route.patterns())
    assert_near_miss(report, "moe_route", "check refused", "fp32")


def _renormalised(gather_dim=-1, sum_dim=-1, eps=1e-20):
    """route() with the literals the matcher does not compare (ints and floats are wildcards)."""

    def fn(logits, bias):
        scores = torch.sigmoid(logits)
        _, ids = torch.topk(scores + bias, 4, dim=-1)
        weights = scores.gather(gather_dim, ids)
        return ids, weights / (weights.sum(sum_dim, keepdim=True) + eps) * 2.5

    return fn


def test_check_refuses_other_dims_and_epsilons():
    args = [torch.rand(16, 16), torch.zeros(16)]  # 16 tokens: a gather along dim 0 is valid
    for literals, words in (({"gather_dim": 0}, "gathers along dim 0"),
                            ({"sum_dim": 0}, "sums dims [0]"),
                            ({"eps": 1e-6}, "epsilon 1e-06")):
        gm, report = rewrite(_renormalised(**literals), args, moe_route.patterns())
        assert_near_miss(report, "moe_route", "check refused", words)


def test_positive_dims_and_an_int_scaling_are_the_same_routing():
    def fn(logits, bias):
        scores = torch.sigmoid(logits)
        _, ids = torch.topk(scores + bias, 4)
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(1, keepdim=True) + 1e-20) * 2

    args = _inputs()
    gm, report = rewrite(fn, args, moe_route.patterns())
    assert_rewritten_equal(gm, report, fn, args, "k3.moe_route")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.moe_route.default")
    assert op.args[2:] == (4, 2.0)
