"""kda_decode / fb_kda_decode with `conv_time_major`: the conv state [S, taps-1, 3W] (vLLM v1's
layout, tests/models/spell5_k3.py): the op's reference against the unfused step on CPU, the
pattern variant's rewrite, and a channel-major graph left to the channel-major variant."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import fb_kda_decode, kda_decode

from k3compile.ops.kda_decode import KDAVariant
from tests.kernel_checks import assert_cuda_op_equals_cpu, kda_kernel_inputs

from .pattern_checks import rewrite, targets

STATES = (kda_decode.NAMES.index("conv_state"), kda_decode.NAMES.index("recurrent_state"))
TIME_MAJOR = KDAVariant(conv_time_major=True)


def _variant(T, B, dtype, time_major):
    return kda_decode._variant(T, B, dtype, variant=KDAVariant(conv_time_major=time_major))


def _inputs(T, B, dtype, time_major=True):
    torch.manual_seed(0)
    args = _variant(T, B, dtype, time_major).example_inputs()
    args[kda_decode.NAMES.index("q_scale")] = kda_decode.K**-0.5
    return args


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _unfused(*args):
    """the step as the graph computes it (functional state writes)"""
    return kda_decode._step(*args, silu_written_out=False, variant=TIME_MAJOR)


@pytest.mark.parametrize("dtype,B,T", [(torch.float32, 2, 1), (torch.float32, 2, 3),
                                       (torch.bfloat16, 1, 2)])
def test_reference_equals_the_unfused_step(dtype, B, T):
    """the op mutates the states in place; the unfused step returns them"""
    args = _inputs(T, B, dtype)
    state, conv, o = _unfused(*_clone(args))
    got = _clone(args)
    o_op = torch.ops.k3.kda_decode(*got, None, None, "conv_time_major")
    torch.testing.assert_close(o_op, o, rtol=0, atol=0)
    torch.testing.assert_close(got[STATES[0]], conv, rtol=0, atol=0)
    torch.testing.assert_close(got[STATES[1]], state, rtol=0, atol=0)


def test_time_major_reference_equals_the_channel_major_one():
    """the same values whatever the layout of the conv state"""
    args = _inputs(2, 2, torch.float32)
    channel_major = _clone(args)
    channel_major[STATES[0]] = args[STATES[0]].transpose(1, 2).contiguous()
    o_t = torch.ops.k3.kda_decode(*args, None, None, "conv_time_major")
    o_c = torch.ops.k3.kda_decode(*channel_major, None, None)
    torch.testing.assert_close(o_t, o_c, rtol=0, atol=0)
    torch.testing.assert_close(args[STATES[0]].transpose(1, 2), channel_major[STATES[0]],
                               rtol=0, atol=0)
    torch.testing.assert_close(args[STATES[1]], channel_major[STATES[1]], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_time_major_variant_rewrites_and_equals_eager(dtype):
    args = _inputs(1, 2, dtype)
    gm, report = rewrite(_unfused, _clone(args), [_variant(1, 2, dtype, True)], joint=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.kda_decode.default")
    assert op.args[-1] == "conv_time_major"
    for w, g in zip(_unfused(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_time_major_site_fuses_on_gpu_graphs():
    """As on a GPU graph (`kernels_only`): the time-major build passed its GPU tests (H100,
    2026-12-05, test_kda_decode_kernel.py::test_time_major_conv_state), so the site fuses there
    too and is no longer deferred to Inductor."""
    args = _inputs(1, 2, torch.float32)
    gm, report = rewrite(_unfused, _clone(args), [_variant(1, 2, torch.float32, True)],
                         joint=True, kernels_only=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    assert "kda_decode" not in report.deferred
    for w, g in zip(_unfused(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_channel_major_step_is_not_the_time_major_variant():
    """a channel-major step: the time-major variant leaves it alone (its check: the conv state's
    channels on dim 1)"""
    args = _inputs(1, 2, torch.float32, time_major=False)

    def channel_major(*a):
        return kda_decode._step(*a, silu_written_out=False)

    gm, report = rewrite(channel_major, _clone(args), [_variant(1, 2, torch.float32, True)],
                         joint=True)
    assert not report.hits
    assert "k3.kda_decode.default" not in targets(gm)


def _fb_step(*args):
    i = fb_kda_decode.NAMES.index
    return (fb_kda_decode.search(*args, None, None, "conv_time_major"), args[i("conv_state")],
            args[i("recurrent_state")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fb_time_major_variant_rewrites_and_equals_eager(dtype):
    torch.manual_seed(0)
    args = fb_kda_decode.example_inputs(dtype, conv_time_major=True)
    args[fb_kda_decode.NAMES.index("q_scale")] = kda_decode.K**-0.5
    gm, report = rewrite(_fb_step, _clone(args), fb_kda_decode.patterns())
    assert [h.op for h in report.hits] == ["k3.fb_kda_decode"], report
    assert "aten.mm.default" not in targets(gm)
    for w, g in zip(_fb_step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("time_major", [False, True])
@pytest.mark.parametrize("B,T", [(2, 1), (3, 4)])
def test_cuda_op_equals_the_cpu_reference_for_both_layouts(cuda_kernels, time_major, B, T):
    """on CUDA, at K3's head dim: the kernel's build for each layout against the CPU reference,
    states included, two steps (bf16, one rounding apart). Before session 29 the inputs had the
    tracing head dim 8, which the kernel refuses, and no kernel was registered: the test
    compared the CUDA reference with the CPU one."""
    spec = ("conv_time_major",) if time_major else ()
    assert_cuda_op_equals_cpu(cuda_kernels, "kda_decode", kda_kernel_inputs(B, T, time_major),
                              STATES, spec)


def test_kernel_takes_each_layout_with_its_flag_only():
    """the CUDA kernel's refusal (metadata): a channel-major state without the flag, a time-major
    one with it (its own build reads the transposed view); either layout under the other's flag
    is refused, as is a time-major view that is not the transpose of a contiguous buffer"""
    from k3compile.kernels import kda_decode as kernel

    Hn, Kd, taps, B, T, S = 2, kernel.HEAD_DIM, 4, 2, 1, 3
    W = Hn * Kd
    meta = {"device": "meta"}
    bf = dict(dtype=torch.bfloat16, **meta)
    acts = [torch.empty(B, T, W, **bf) for _ in range(5)]
    conv_cm = torch.empty(S, 3 * W, taps - 1, **bf)
    rest = [torch.empty(B, T, Hn, **bf)]
    tail = [torch.empty(S, Hn, Kd, Kd, dtype=torch.float32, **meta),
            torch.empty(B, dtype=torch.int64, **meta),
            *(torch.empty(W, 1, taps, **bf) for _ in range(3)),
            torch.empty(Hn, dtype=torch.float32, **meta),
            torch.empty(W, dtype=torch.float32, **meta), torch.empty(Kd, **bf)]
    conv_tm = torch.empty(S, taps - 1, 3 * W, **bf)
    assert kernel.refusal(*acts, *rest, conv_cm, *tail) is None
    assert kernel.refusal(*acts, *rest, conv_tm, *tail, variant="conv_time_major") is None
    assert kernel.refusal(*acts, *rest, conv_tm, *tail) is not None
    assert kernel.refusal(*acts, *rest, conv_cm, *tail, variant="conv_time_major") is not None
    strided = torch.empty(S, taps - 1, 6 * W, **bf)[..., ::2]  # channels 2 apart
    assert "conv_state" in kernel.refusal(*acts, *rest, strided, *tail, variant="conv_time_major")
