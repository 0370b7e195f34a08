"""kda_decode / fb_kda_decode with `state_v_major`: the recurrent state [S, H, V, K] (fla's
`transpose_state_layout`, tests/models/spell6_k3.py): the op's reference against the unfused step
and against the K-major reference on the transposed buffer, the pattern variant's rewrite, a
K-major step left to the K-major variant, and the CUDA build (GPU)."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import fb_kda_decode, kda_decode

from k3compile.ops.kda_decode import KDAVariant
from tests.kernel_checks import assert_cuda_op_equals_cpu

from .pattern_checks import rewrite, targets

STATES = (kda_decode.NAMES.index("conv_state"), kda_decode.NAMES.index("recurrent_state"))
V_MAJOR = "state_v_major"  # the op's variant


def _variant(T, B, dtype, v_major=True, time_major=False):
    return kda_decode._variant(T, B, dtype, variant=KDAVariant(conv_time_major=time_major,
                                                               state_v_major=v_major))


def _inputs(T, B, dtype, time_major=False):
    torch.manual_seed(0)
    args = _variant(T, B, dtype, True, time_major).example_inputs()
    args[kda_decode.NAMES.index("q_scale")] = kda_decode.K**-0.5
    return args


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _unfused(*args, time_major=False):
    return kda_decode._step(*args, silu_written_out=False, variant=KDAVariant(
        conv_time_major=time_major, state_v_major=True))


@pytest.mark.parametrize("dtype,B,T", [(torch.float32, 2, 1), (torch.float32, 2, 3),
                                       (torch.bfloat16, 1, 2)])
def test_reference_equals_the_unfused_step(dtype, B, T):
    args = _inputs(T, B, dtype)
    state, conv, o = _unfused(*_clone(args))
    got = _clone(args)
    o_op = torch.ops.k3.kda_decode(*got, None, None, V_MAJOR)
    torch.testing.assert_close(o_op, o, rtol=0, atol=0)
    torch.testing.assert_close(got[STATES[0]], conv, rtol=0, atol=0)
    torch.testing.assert_close(got[STATES[1]], state, rtol=0, atol=0)


def test_v_major_reference_equals_the_k_major_one():
    """the same values whatever the layout of the recurrent state (the buffer transposed)"""
    args = _inputs(2, 2, torch.float32)
    k_major = _clone(args)
    k_major[STATES[1]] = args[STATES[1]].transpose(-1, -2).contiguous()
    o_v = torch.ops.k3.kda_decode(*args, None, None, V_MAJOR)
    o_k = torch.ops.k3.kda_decode(*k_major, None, None)
    torch.testing.assert_close(o_v, o_k, rtol=0, atol=0)
    torch.testing.assert_close(args[STATES[1]].transpose(-1, -2), k_major[STATES[1]],
                               rtol=0, atol=0)
    torch.testing.assert_close(args[STATES[0]], k_major[STATES[0]], rtol=0, atol=0)


@pytest.mark.parametrize("dtype,B,T,time_major", [(torch.float32, 2, 1, False),
                                                  (torch.bfloat16, 2, 2, False),
                                                  (torch.float32, 1, 1, False),
                                                  (torch.float32, 2, 1, True)])
def test_v_major_variant_rewrites_and_equals_eager(dtype, B, T, time_major):
    args = _inputs(T, B, dtype, time_major)

    def fn(*a):
        return _unfused(*a, time_major=time_major)

    gm, report = rewrite(fn, _clone(args), [_variant(T, B, dtype, True, time_major)], joint=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.kda_decode.default")
    assert op.args[-1] == ("conv_time_major,state_v_major" if time_major else V_MAJOR)
    for w, g in zip(fn(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_k_major_step_is_not_the_v_major_variant():
    """a K-major step (no transpose of the gathered rows): the V-major variant leaves it alone,
    and its `fits` says why"""
    args = _inputs(1, 2, torch.float32)

    def k_major(*a):
        return kda_decode._step(*a, silu_written_out=False)

    variant = _variant(1, 2, torch.float32)
    gm, report = rewrite(k_major, _clone(args), [variant], joint=True)
    assert not report.hits
    assert "k3.kda_decode.default" not in targets(gm)
    assert "transpose" in variant.fits(gm.graph)


def test_v_major_step_is_not_the_k_major_variant():
    args = _inputs(1, 2, torch.float32)
    gm, report = rewrite(_unfused, _clone(args), [_variant(1, 2, torch.float32, False)],
                         joint=True)
    assert not report.hits
    assert "k3.kda_decode.default" not in targets(gm)


def _fb_step(*args):
    i = fb_kda_decode.NAMES.index
    return (fb_kda_decode.search(*args, None, None, V_MAJOR), args[i("conv_state")],
            args[i("recurrent_state")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fb_v_major_variant_rewrites_and_equals_eager(dtype):
    torch.manual_seed(0)
    args = fb_kda_decode.example_inputs(dtype)
    args[fb_kda_decode.NAMES.index("q_scale")] = kda_decode.K**-0.5
    gm, report = rewrite(_fb_step, _clone(args), fb_kda_decode.patterns())
    assert [h.pattern for h in report.hits] == ["fb_kda_decode[state_v_major]"], report
    assert "aten.mm.default" not in targets(gm)
    for w, g in zip(_fb_step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("v_major", [False, True])
@pytest.mark.parametrize("B,T", [(2, 1), (3, 4)])
def test_cuda_op_equals_the_cpu_reference_for_both_layouts(cuda_kernels, v_major, B, T):
    """on CUDA, at K3's head dim: the kernel's build for each state layout against the CPU
    reference, states included, two steps on the carried states (bf16 activations)"""
    from k3compile.kernels import kda_decode as kernel

    torch.manual_seed(0)
    H, K, taps, S = 2, kernel.HEAD_DIM, 4, 5
    W = H * K
    bf = torch.bfloat16
    args = [*(torch.randn(B, T, W, dtype=bf) for _ in range(5)), torch.randn(B, T, H, dtype=bf),
            torch.randn(S, 3 * W, taps - 1, dtype=bf), torch.randn(S, H, K, K) * 0.1,
            torch.tensor([4, 0, 2][:B]), *(torch.randn(W, 1, taps, dtype=bf) for _ in range(3)),
            torch.randn(H), torch.randn(W), torch.randn(K, dtype=bf), -5.0, 1e-6, K**-0.5,
            1e-5, None, None]
    spec = (V_MAJOR,) if v_major else ()
    assert_cuda_op_equals_cpu(cuda_kernels, "kda_decode", args, STATES, spec)


def test_kernel_takes_each_state_layout_with_its_flag_only():
    """the CUDA kernel's refusal (metadata): a K-major state without the flag, a V-major one
    with it (its own build reads the transposed view); a V-major view that is not the transpose
    of a buffer with contiguous rows is refused"""
    from k3compile.kernels import kda_decode as kernel

    Hn, Kd, taps, B, T, S = 2, kernel.HEAD_DIM, 4, 2, 1, 3
    W = Hn * Kd
    meta = {"device": "meta"}
    bf = dict(dtype=torch.bfloat16, **meta)
    head = [*(torch.empty(B, T, W, **bf) for _ in range(5)), torch.empty(B, T, Hn, **bf),
            torch.empty(S, 3 * W, taps - 1, **bf)]
    tail = [torch.empty(B, dtype=torch.int64, **meta),
            *(torch.empty(W, 1, taps, **bf) for _ in range(3)),
            torch.empty(Hn, dtype=torch.float32, **meta),
            torch.empty(W, dtype=torch.float32, **meta), torch.empty(Kd, **bf)]
    state = torch.empty(S, Hn, Kd, Kd, dtype=torch.float32, **meta)
    assert kernel.refusal(*head, state, *tail) is None
    assert kernel.refusal(*head, state, *tail, variant=V_MAJOR) is None
    strided = torch.empty(S, Hn, Kd, 2 * Kd, dtype=torch.float32, **meta)[..., ::2]
    assert "recurrent_state" in kernel.refusal(*head, strided, *tail, variant=V_MAJOR)


def test_v_major_site_fuses_on_gpu_graphs():
    """As on a GPU graph (`kernels_only`): the V-major build passed its GPU test with the kernel
    launched (H100, 2026-12-06, session 29: test_cuda_op_equals_the_cpu_reference_for_both_layouts;
    `kda_decode.GPU_TESTED_FLAGS`), so the site fuses there too."""
    args = _inputs(1, 2, torch.float32)
    gm, report = rewrite(_unfused, _clone(args), [_variant(1, 2, torch.float32)], joint=True,
                         kernels_only=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    assert "kda_decode" not in report.deferred
    for w, g in zip(_unfused(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w)  # the op's CPU reference against the unfused step
