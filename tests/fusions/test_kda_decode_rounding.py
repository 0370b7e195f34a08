"""kda_decode / fb_kda_decode with `norm_weight_fp32` and `conv_rounded` (session 27): spell9's
JAX/Flax output norm (o kept fp32, the weight multiplied in fp32 before one cast to bf16, the
gate in bf16 after it) and a short conv run in bf16 (its output rounded, then F.silu on it: the
red-team spelling's `F.conv1d` on bf16, spell9's per-token einsum after rule `cell_conv`; spell7's
`F.conv1d` on bf16 with fla's norm on an fp32 o and a V-major state, session 28). The
op's reference against the unfused step and against the spellings' own code, the pattern
variants' rewrites, the look-alikes each leaves alone, the kernel's refusal, its GPU test and the
sites fusing on GPU graphs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import fb_kda_decode, kda_decode

from k3compile.ops.kda_decode import ConvRounding, KDAVariant
from tests.kernel_checks import assert_cuda_op_equals_cpu, kda_kernel_inputs

from .kda_checks import assert_op_equals_step, spec
from .pattern_checks import rewrite, targets

STATES = (kda_decode.NAMES.index("conv_state"), kda_decode.NAMES.index("recurrent_state"))
ROUNDED, FP32 = ConvRounding.ROUNDED, ConvRounding.FP32
# time-major conv state, Flax norm, bf16 conv
SPELL9 = KDAVariant(conv_time_major=True, o_fp32=True, norm_weight_fp32=True, conv=ROUNDED)
# fla's fp32 norm on an fp32 o, bf16 conv
REDTEAM = KDAVariant(norm_fp32=True, o_fp32=True, conv=ROUNDED)
# the red-team's, on a V-major state (session 28)
SPELL7 = KDAVariant(norm_fp32=True, state_v_major=True, o_fp32=True, conv=ROUNDED)
# the built-in norm (o rounded first: rule norm_round), bf16 conv, V-major state (session 29)
SPELL6 = KDAVariant(state_v_major=True, conv=ROUNDED)
SPELLINGS = [SPELL9, REDTEAM, SPELL7, SPELL6]
IDS = ["spell9", "redteam", "spell7", "spell6"]

# the nearest variants before these flags: the built-in norm, fla's norm on an fp32 o; fp32 conv
WITHOUT = {SPELL9: KDAVariant(conv_time_major=True), REDTEAM: replace(REDTEAM, conv=FP32),
           SPELL7: replace(SPELL7, conv=FP32), SPELL6: replace(SPELL6, conv=FP32)}


def _variant(T, B, variant, dtype=torch.bfloat16):
    return kda_decode._variant(T, B, dtype, variant=variant)


def _inputs(T, B, variant, dtype=torch.bfloat16):
    torch.manual_seed(0)
    args = _variant(T, B, variant, dtype).example_inputs()
    i = kda_decode.NAMES.index
    args[i("recurrent_state")] = args[i("recurrent_state")] * 0.05  # a decode-sized state
    args[i("q_scale")] = kda_decode.K**-0.5
    return args


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _unfused(variant):
    def step(*args):
        return kda_decode._step(*args, silu_written_out=False, variant=variant)
    return step


@pytest.mark.parametrize("variant", SPELLINGS, ids=IDS)
@pytest.mark.parametrize("B,T", [(2, 1), (1, 2)])
def test_reference_equals_the_unfused_step(variant, B, T):
    assert_op_equals_step(_unfused(variant), _inputs(T, B, variant), variant)


def test_the_flags_are_the_spellings_roundings():
    """the reference's two pieces against the spellings' own code, bit for bit: spell9's RMSNorm
    (tests/models/spell9_k3.py `rms_norm`, jmp policy bf16) then its bf16 gate; the red-team's
    `F.silu(F.conv1d(window, taps))` on bf16 (K3 sizes: 3 x 2048 channels, 4 taps)"""
    from k3compile.math import rms_norm_fp32_weight
    from tests.models import spell9_k3 as s9

    g = torch.Generator().manual_seed(0)
    o = torch.randn(4, 1, 2, 128, generator=g)
    scale = (torch.randn(128, generator=g) + 1).bfloat16()
    gate = torch.randn(4, 1, 2, 128, generator=g).bfloat16()
    spelled = s9.rms_norm(s9.Policy(torch.bfloat16), o, scale, 1e-5) * torch.sigmoid(gate)
    ours = rms_norm_fp32_weight(o, scale, 1e-5, torch.bfloat16) * torch.sigmoid(gate)
    assert torch.equal(spelled, ours)
    window = torch.randn(8, 3 * 2048, 4, generator=g).bfloat16()
    taps = torch.randn(3 * 2048, 1, 4, generator=g).bfloat16()
    rounded = F.silu(F.conv1d(window.float(), taps.float(), groups=3 * 2048).bfloat16())
    assert torch.equal(F.silu(F.conv1d(window, taps, groups=3 * 2048)), rounded)


@pytest.mark.parametrize("variant", SPELLINGS, ids=IDS)
def test_each_flag_changes_bf16_only(variant):
    """bf16: with the flags the output differs from the op without them (a rounding apart), the
    states do not; fp32: one computation"""
    args = _inputs(1, 2, variant)
    new, old = _clone(args), _clone(args)
    o_new = torch.ops.k3.kda_decode(*new, None, None, variant.spec)
    o_old = torch.ops.k3.kda_decode(*old, None, None, WITHOUT[variant].spec)
    assert not torch.equal(o_new, o_old)
    torch.testing.assert_close(o_new, o_old, rtol=3e-2, atol=3e-2)
    f32 = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
           for a in args]
    torch.testing.assert_close(torch.ops.k3.kda_decode(*_clone(f32), None, None, variant.spec),
                               torch.ops.k3.kda_decode(*_clone(f32), None, None,
                                                       WITHOUT[variant].spec), rtol=0, atol=0)


def test_bad_flag_combinations_are_errors():
    args = _inputs(1, 2, SPELL9)
    with pytest.raises(ValueError, match="two output norms"):
        torch.ops.k3.kda_decode(*_clone(args), None, None,
                                "norm_fp32,conv_time_major,norm_weight_fp32")
    with pytest.raises(ValueError, match="needs norm_fp32 or norm_weight_fp32"):
        torch.ops.k3.kda_decode(*_clone(args), None, None, "conv_time_major,o_fp32,conv_rounded")


@pytest.mark.parametrize("variant", SPELLINGS, ids=IDS)
@pytest.mark.parametrize("B,T", [(2, 1), (1, 1), (2, 2)])
def test_variant_rewrites_and_equals_eager(variant, B, T):
    args = _inputs(T, B, variant)
    step = _unfused(variant)
    assert _variant(T, B, variant).name in {p.name for p in kda_decode.patterns()}  # traced
    gm, report = rewrite(step, _clone(args), [_variant(T, B, variant)], joint=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.kda_decode.default")
    assert op.args[21:] == spec(variant)
    for w, g in zip(step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("variant", SPELLINGS, ids=IDS)
def test_an_fp32_conv_is_not_the_rounded_variant(variant):
    """the conv + SiLU in fp32, rounded once (the built-in's), is not `conv_rounded`'s graph; and
    with no bf16 conv in the graph the rounded variant is not even traced"""
    args = _inputs(1, 2, variant)

    def fp32_conv(*a):
        return kda_decode._step(*a, silu_written_out=False, variant=replace(variant, conv=FP32))

    pattern = _variant(1, 2, variant)
    gm, report = rewrite(fp32_conv, _clone(args), [pattern], joint=True)
    assert not report.hits and "k3.kda_decode.default" not in targets(gm)
    assert "bf16 / fp16" in pattern.fits(gm.graph)


def test_the_weight_after_the_cast_is_not_the_flax_norm():
    """spell9's step with its norm written the built-in way (the normed row rounded, the weight
    multiplied in bf16) takes no norm_weight_fp32 variant"""
    args = _inputs(1, 2, SPELL9)

    def rounded_first(*a):
        return kda_decode._step(*a, silu_written_out=False,
                                variant=KDAVariant(conv_time_major=True, conv=ROUNDED))

    gm, report = rewrite(rounded_first, _clone(args), [_variant(1, 2, SPELL9)], joint=True)
    assert not report.hits and "k3.kda_decode.default" not in targets(gm)
    for w, g in zip(rounded_first(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _fb_step(*args):
    i = fb_kda_decode.NAMES.index
    return (fb_kda_decode.search(*args, None, None, REDTEAM.spec), args[i("conv_state")],
            args[i("recurrent_state")])


def test_fb_variant_rewrites_and_equals_eager():
    torch.manual_seed(0)
    args = fb_kda_decode.example_inputs(torch.bfloat16)
    i = fb_kda_decode.NAMES.index
    args[i("recurrent_state")] = args[i("recurrent_state")] * 0.05
    args[i("q_scale")] = kda_decode.K**-0.5
    gm, report = rewrite(_fb_step, _clone(args), fb_kda_decode.patterns())
    assert [h.pattern for h in report.hits] == ["fb_kda_decode[norm_fp32,o_fp32,conv_rounded]"]
    assert "aten.mm.default" not in targets(gm)
    for w, g in zip(_fb_step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("variant", SPELLINGS, ids=IDS)
def test_kernel_takes_the_flags(variant):
    """the CUDA kernel's refusal (metadata): both flags are build options, no input they
    refuse"""
    from k3compile.kernels import kda_decode as kernel

    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a
            for a in kda_kernel_inputs(2, 1, variant.conv_time_major)]
    assert kernel.refusal(*meta, variant.spec) is None


@pytest.mark.gpu
@pytest.mark.parametrize("variant", SPELLINGS, ids=IDS)
@pytest.mark.parametrize("B,T", [(2, 1), (3, 4)])
def test_cuda_op_equals_the_cpu_reference(cuda_kernels, variant, B, T):
    """on CUDA, at K3's head dim: the builds against the CPU reference, states included, two
    steps on the carried states (the kernel registered and launched: before session 29 this
    test compared the CUDA reference with the CPU one, so its passes of 2026-12-05/06 proved
    nothing about the builds)"""
    assert_cuda_op_equals_cpu(cuda_kernels, "kda_decode",
                              kda_kernel_inputs(B, T, variant.conv_time_major), STATES,
                              spec(variant))


@pytest.mark.parametrize("variant", SPELLINGS, ids=IDS)
def test_site_fuses_on_gpu_graphs(variant):
    """As on a GPU graph (`kernels_only`): the builds passed their GPU test with the kernel
    launched (`test_cuda_op_equals_the_cpu_reference`, H100, 2026-12-06, session 29;
    `kda_decode.GPU_TESTED_FLAGS`), so the site fuses there too, no deferral, values as the
    unfused step's"""
    args = _inputs(1, 2, variant)
    step = _unfused(variant)
    gm, report = rewrite(step, _clone(args), [_variant(1, 2, variant)], joint=True,
                         kernels_only=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    assert "kda_decode" not in report.deferred
    for w, g in zip(step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_fb_site_fuses_on_gpu_graphs():
    """fb_kda_decode's rounding variant on a GPU graph: its CUDA path is the f_b GEMM, then the
    kda_decode build above"""
    torch.manual_seed(0)
    args = fb_kda_decode.example_inputs(torch.bfloat16)
    i = fb_kda_decode.NAMES.index
    args[i("recurrent_state")] = args[i("recurrent_state")] * 0.05
    args[i("q_scale")] = kda_decode.K**-0.5
    gm, report = rewrite(_fb_step, _clone(args), fb_kda_decode.patterns(), kernels_only=True)
    assert [h.pattern for h in report.hits] == ["fb_kda_decode[norm_fp32,o_fp32,conv_rounded]"]
    for w, g in zip(_fb_step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_spell7_norm_is_the_fp32_gated_norm():
    """spell7's output norm (tests/models/spell7_k3.py: o fp32 on flat rows, the bf16 weight
    upcast, the bf16 gate upcast, one cast at the end) is `rms_norm_gated_fp32`, bit for bit"""
    from k3compile.math import rms_norm_gated_fp32

    g = torch.Generator().manual_seed(0)
    o = torch.randn(4, 2, 128, generator=g)
    w = (torch.randn(128, generator=g) + 1).bfloat16()
    gate = torch.randn(4, 2 * 128, generator=g).bfloat16()
    spelled = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    spelled = (spelled * torch.sigmoid(gate.float().reshape(-1, 2, 128))).to(torch.bfloat16)
    ours = rms_norm_gated_fp32(o, w, gate.float().view(4, 2, 128), 1e-5).to(torch.bfloat16)
    assert torch.equal(spelled, ours)  # the op's o_fp32 norm: the fp32 gated norm, one cast


def test_a_rounded_conv_is_not_the_unrounded_variant():
    """spell7's step (bf16 conv, V-major state) is not taken by the V-major variant that
    convolves in fp32 (`WITHOUT`): that op would round the conv once, not twice"""
    args = _inputs(1, 2, SPELL7)
    step = _unfused(SPELL7)
    fp32_conv = kda_decode._variant(1, 2, torch.bfloat16, variant=WITHOUT[SPELL7])
    gm, report = rewrite(step, _clone(args), [fp32_conv], joint=True)
    assert not report.hits and "k3.kda_decode.default" not in targets(gm)
    for w, g in zip(step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_written_out_silu_on_the_rounded_conv_stays():
    """`x * sigmoid(x)` on the bf16 conv rounds the sigmoid as well: not `conv_rounded`'s F.silu,
    so the V-major rounded variant leaves it (and no variant rounds that way)"""
    args = _inputs(1, 2, SPELL7)

    def written_out(*a):
        return kda_decode._step(*a, silu_written_out=True, variant=SPELL7)

    gm, report = rewrite(written_out, _clone(args), [_variant(1, 2, SPELL7)], joint=True)
    assert not report.hits and "k3.kda_decode.default" not in targets(gm)
    assert not any("silu_written_out" in p.name and "conv_rounded" in p.name
                   for p in kda_decode.patterns())


def _fb_rows_step(*args):
    i = fb_kda_decode.NAMES.index
    return (fb_kda_decode.search_rows(*args, None, None, SPELL7.spec), args[i("conv_state")],
            args[i("recurrent_state")])


def test_fb_rows_variant_on_a_v_major_state_rewrites_and_equals_eager():
    """spell7's f_b GEMM on flat f_a rows into the rounded-conv, V-major step"""
    torch.manual_seed(0)
    args = fb_kda_decode.example_inputs(torch.bfloat16, rows=True)
    i = fb_kda_decode.NAMES.index
    args[i("recurrent_state")] = args[i("recurrent_state")] * 0.05
    args[i("q_scale")] = kda_decode.K**-0.5
    gm, report = rewrite(_fb_rows_step, _clone(args), fb_kda_decode.patterns())
    assert [h.pattern for h in report.hits] == [
        "fb_kda_decode[norm_fp32,state_v_major,o_fp32,conv_rounded,rows]"]
    assert "aten.mm.default" not in targets(gm)
    for w, g in zip(_fb_rows_step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
