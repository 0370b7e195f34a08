"""fb_kda_decode: KDA's f_b GEMM (graw = fa · W_fbᵀ) folded into the recurrent step's op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import fb_kda_decode, kda_decode

from .pattern_checks import assert_near_miss, rewrite, targets

STATES = (fb_kda_decode.NAMES.index("conv_state"), fb_kda_decode.NAMES.index("recurrent_state"))


def step(*args):  # the graph after kda_decode: f_b's GEMM feeds the op as graw
    return fb_kda_decode.search(*args), args[STATES[0]], args[STATES[1]]


def _inputs(dtype=torch.bfloat16, **change):
    torch.manual_seed(0)
    args = fb_kda_decode.example_inputs(dtype)
    args[fb_kda_decode.NAMES.index("q_scale")] = kda_decode.K**-0.5
    for name, value in change.items():
        args[fb_kda_decode.NAMES.index(name)] = value
    return args


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rewrites_and_equals_eager_incl_states(dtype):
    args = _inputs(dtype)
    gm, report = rewrite(step, _clone(args), fb_kda_decode.patterns())
    assert [h.op for h in report.hits] == ["k3.fb_kda_decode"], report
    assert "k3.fb_kda_decode.default" in targets(gm) and "aten.mm.default" not in targets(gm)
    want, got = step(*_clone(args)), gm(*_clone(args))
    for w, g in zip(want, got):  # o, conv state, recurrent state
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_escaping_graw_is_a_near_miss():
    def escaped(*args):
        graw = F.linear(args[4], args[5])  # also returned: escapes the fusion
        rest = list(args[:4]) + [graw] + list(args[6:])
        return torch.ops.k3.kda_decode(*rest), graw

    _, report = rewrite(escaped, _inputs(), fb_kda_decode.patterns())
    assert_near_miss(report, "fb_kda_decode", "user")


def test_check_refuses_a_wrong_q_scale():
    args = _inputs(q_scale=0.37)
    _, report = rewrite(step, args, fb_kda_decode.patterns())
    assert_near_miss(report, "fb_kda_decode", "check refused", "q scale")


def test_computed_fb_weight_is_a_near_miss():
    """W_fb must be a weight input: the one launch copies it before its PDL wait."""
    def computed(*args):
        rest = list(args)
        rest[5] = args[5] * 2  # W_fb computed in the graph (a kernel of the step writes it)
        return step(*rest)

    _, report = rewrite(computed, _inputs(), fb_kda_decode.patterns())
    assert_near_miss(report, "fb_kda_decode", "check refused", "computed in the graph")
