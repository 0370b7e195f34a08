"""kda_decode / fb_kda_decode with `o_fp32`: the recurrent output o goes into fla's fp32 gated
norm as the fp32 recurrence leaves it, one cast after the norm (the red-team spelling and spell8
keep o in fp32 through their gated norm); `norm_fp32` alone rounds o to bf16 first. The op's
reference against the unfused step, the pattern variant's rewrite, the look-alikes each variant
leaves alone, the CUDA build's refusal and its GPU test."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import fb_kda_decode, kda_decode

from k3compile.ops.kda_decode import KDAVariant
from tests.kernel_checks import assert_cuda_op_equals_cpu

from .kda_checks import assert_op_equals_step, spec
from .pattern_checks import rewrite, targets

STATES = (kda_decode.NAMES.index("conv_state"), kda_decode.NAMES.index("recurrent_state"))
O_FP32 = KDAVariant(norm_fp32=True, o_fp32=True)
NORM_FP32 = KDAVariant(norm_fp32=True)


def _variant(T, B, dtype, o_fp32=True):
    return kda_decode._variant(T, B, dtype, variant=O_FP32 if o_fp32 else NORM_FP32)


def _inputs(T, B, dtype=torch.bfloat16):
    torch.manual_seed(0)
    args = _variant(T, B, dtype).example_inputs()
    i = kda_decode.NAMES.index
    args[i("recurrent_state")] = args[i("recurrent_state")] * 0.05  # a decode-sized state
    args[i("q_scale")] = kda_decode.K**-0.5
    return args


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _unfused(*args, o_fp32=True):
    return kda_decode._step(*args, silu_written_out=False,
                            variant=O_FP32 if o_fp32 else NORM_FP32)


@pytest.mark.parametrize("B,T", [(2, 1), (1, 2)])
def test_reference_equals_the_unfused_step(B, T):
    assert_op_equals_step(_unfused, _inputs(T, B), O_FP32)


def test_o_fp32_rounds_once_where_norm_fp32_rounds_twice():
    """bf16: the two references differ (o rounded or not before the norm), the states do not;
    fp32: one computation"""
    args = _inputs(1, 2)
    once, twice = _clone(args), _clone(args)
    o_once = torch.ops.k3.kda_decode(*once, None, None, O_FP32.spec)
    o_twice = torch.ops.k3.kda_decode(*twice, None, None, NORM_FP32.spec)
    assert not torch.equal(o_once, o_twice)
    torch.testing.assert_close(o_once, o_twice, rtol=2e-2, atol=2e-2)  # a rounding apart
    for i in STATES:
        torch.testing.assert_close(once[i], twice[i], rtol=0, atol=0)
    f32 = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
           for a in args]
    torch.testing.assert_close(torch.ops.k3.kda_decode(*_clone(f32), None, None, O_FP32.spec),
                               torch.ops.k3.kda_decode(*_clone(f32), None, None, "norm_fp32"),
                               rtol=0, atol=0)


def test_o_fp32_without_the_fp32_norm_is_an_error():
    with pytest.raises(ValueError, match="needs norm_fp32"):
        torch.ops.k3.kda_decode(*_inputs(1, 2), None, None, "o_fp32")
    with pytest.raises(ValueError, match="needs norm_fp32"):
        KDAVariant(o_fp32=True)


@pytest.mark.parametrize("B,T", [(2, 1), (1, 1), (2, 2)])
def test_o_fp32_variant_rewrites_and_equals_eager(B, T):
    args = _inputs(T, B)
    gm, report = rewrite(_unfused, _clone(args), [_variant(T, B, torch.bfloat16)], joint=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.kda_decode.default")
    assert op.args[21:] == ("norm_fp32,o_fp32",)
    for w, g in zip(_unfused(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("step_o_fp32", [False, True])
def test_each_norm_is_not_the_other_variant(step_o_fp32):
    """o rounded before the fp32 norm (fla's own form) is not the o_fp32 variant's, and o kept
    fp32 is not the norm_fp32 variant's: each leaves the other's graph as it is"""
    args = _inputs(1, 2)

    def fn(*a):
        return _unfused(*a, o_fp32=step_o_fp32)

    variant = _variant(1, 2, torch.bfloat16, o_fp32=not step_o_fp32)
    gm, report = rewrite(fn, _clone(args), [variant], joint=True)
    assert not report.hits
    assert "k3.kda_decode.default" not in targets(gm)
    if not step_o_fp32:  # the variant is not even traced for a graph with no fp32 o's norm
        assert "fp32 o" in variant.fits(gm.graph)
    for w, g in zip(fn(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _fb_step(*args):
    i = fb_kda_decode.NAMES.index
    return (fb_kda_decode.search(*args, None, None, *spec(O_FP32)), args[i("conv_state")],
            args[i("recurrent_state")])


def test_fb_o_fp32_variant_rewrites_and_equals_eager():
    torch.manual_seed(0)
    args = fb_kda_decode.example_inputs(torch.bfloat16)
    i = fb_kda_decode.NAMES.index
    args[i("recurrent_state")] = args[i("recurrent_state")] * 0.05
    args[i("q_scale")] = kda_decode.K**-0.5
    gm, report = rewrite(_fb_step, _clone(args), fb_kda_decode.patterns())
    assert [h.pattern for h in report.hits] == ["fb_kda_decode[norm_fp32,o_fp32]"], report
    assert "aten.mm.default" not in targets(gm)
    for w, g in zip(_fb_step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _kernel_inputs(B, T, S=5):
    from k3compile.kernels import kda_decode as kernel

    torch.manual_seed(0)
    H, K, taps = 2, kernel.HEAD_DIM, 4
    W = H * K
    bf = torch.bfloat16
    return [*(torch.randn(B, T, W, dtype=bf) for _ in range(5)), torch.randn(B, T, H, dtype=bf),
            torch.randn(S, 3 * W, taps - 1, dtype=bf), torch.randn(S, H, K, K) * 0.1,
            torch.tensor([4, 0, 2][:B]), *(torch.randn(W, 1, taps, dtype=bf) for _ in range(3)),
            torch.randn(H), torch.randn(W), torch.randn(K, dtype=bf), -5.0, 1e-6, K**-0.5, 1e-5,
            None, None]


def test_kernel_takes_the_flag():
    """the CUDA kernel's refusal (metadata): o_fp32 is a build flag, no input it refuses"""
    from k3compile.kernels import kda_decode as kernel

    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in _kernel_inputs(2, 1)]
    assert kernel.refusal(*meta, O_FP32.spec) is None


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(2, 1), (3, 4)])
def test_cuda_op_equals_the_cpu_reference(cuda_kernels, B, T):
    """on CUDA, at K3's head dim: the o_fp32 build against the CPU reference, states included,
    two steps on the carried states"""
    assert_cuda_op_equals_cpu(cuda_kernels, "kda_decode", _kernel_inputs(B, T), STATES,
                              spec(O_FP32))


def test_o_fp32_site_fuses_on_gpu_graphs():
    """As on a GPU graph (`kernels_only`): the o_fp32 build passed its GPU test with the kernel
    launched (H100, 2026-12-06, session 29: test_cuda_op_equals_the_cpu_reference;
    `kda_decode.GPU_TESTED_FLAGS`), so the site fuses there too."""
    args = _inputs(1, 2)
    gm, report = rewrite(_unfused, _clone(args), [_variant(1, 2, torch.bfloat16)], joint=True,
                         kernels_only=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    assert "kda_decode" not in report.deferred
    for w, g in zip(_unfused(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w)