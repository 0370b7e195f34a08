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
        return torch.ops.k3.kda_decode(*rest, None, None), graw

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


def step_rows(*args):  # f_a as flat [B*T, R] token rows: f_b a plain mm viewed to [B, T, W]
    return fb_kda_decode.search_rows(*args, None, None), args[STATES[0]], args[STATES[1]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flat_fa_rows_rewrite_and_equal_eager_incl_states(dtype):
    args = _inputs(dtype)
    fa = fb_kda_decode.NAMES.index("fa")
    args[fa] = args[fa].reshape(-1, args[fa].shape[-1])
    gm, report = rewrite(step_rows, _clone(args), fb_kda_decode.patterns())
    assert [h.pattern for h in report.hits] == ["fb_kda_decode[rows]"], report
    assert "aten.mm.default" not in targets(gm)
    want, got = step_rows(*_clone(args)), gm(*_clone(args))
    for w, g in zip(want, got):  # o, conv state, recurrent state
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_flat_fa_rows_not_the_step_tokens_are_refused():
    """f_a rows that are not the step's B·T tokens (viewed to [B, T, W] only through the GEMM's
    columns): the op reads fa as [B, T, R]; the match is refused, not rewritten."""
    args = _inputs()
    fa = fb_kda_decode.NAMES.index("fa")
    args[fa] = torch.randn(4, args[fa].shape[-1], dtype=args[fa].dtype)  # 4 rows, B·T = 2

    def mixed(*a):
        graw = F.linear(a[4], a[5]).view(2, 1, -1)[:, :, : a[0].shape[-1]]
        return (torch.ops.k3.kda_decode(*a[:4], graw, *a[6:], None, None), a[STATES[0]],
                a[STATES[1]])

    gm, report = rewrite(mixed, _clone(args), fb_kda_decode.patterns())
    assert not report.hits
    want, got = mixed(*_clone(args)), gm(*_clone(args))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
