"""kda_decode / fb_kda_decode for a mixed-precision codebase's KDA step (spell11, session 36): the
output gate in an fp32 island (`gate_fp32`: the built-in norm rounded to bf16 after the norm and
the weight, then `bf16(float(normed) * sigmoid(float(g)))`, one rounding) and fp32 master conv
weights read as they are (the pattern variants' `conv_weight_fp32`: the op reads the weights'
dtype off its arguments). The reference against the unfused step and spell11's own gate, the
pattern variants' rewrites, the look-alikes each leaves, the kernel's refusal, its GPU test, and
the sites kept off GPU graphs until that test passes."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import kda_decode

from k3compile.math import rms_norm
from k3compile.ops.kda_decode import KDAVariant
from tests.kernel_checks import assert_cuda_op_equals_cpu, kda_kernel_inputs
from tests.models.spell11_k3 import RMSNorm

from .kda_checks import (
    STATES,
    assert_fb_variant_takes,
    assert_op_equals_step,
    assert_variant_leaves,
    assert_variant_takes,
    clone,
    decode_inputs,
    spec,
)
from .pattern_checks import rewrite, targets

GATE = KDAVariant(gate_fp32=True)
BUILTIN = KDAVariant()
TAPS = ("q_conv_weight", "k_conv_weight", "v_conv_weight")
# (variant, fp32 conv weights): spell11 under autocast has both; with its checkpoint's bf16
# weights (probe `checkpoint_weights`) the gate alone; fp32 masters beside the built-in gate
CASES = [(GATE, True), (GATE, False), (BUILTIN, True)]
IDS = ["spell11", "gate", "taps"]


def _variant(T, B, variant, taps_fp32, dtype=torch.bfloat16):
    return kda_decode._variant(T, B, dtype, variant=variant, conv_weight_fp32=taps_fp32)


def _inputs(T, B, variant, taps_fp32, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return decode_inputs(_variant(T, B, variant, taps_fp32, dtype).example_inputs())


def _unfused(variant):
    def step(*args):
        return kda_decode._step(*args, silu_written_out=False, variant=variant)
    return step


@pytest.mark.parametrize("variant,taps_fp32", CASES, ids=IDS)
@pytest.mark.parametrize("B,T", [(2, 1), (1, 2), (2, 3)])
def test_reference_equals_the_unfused_step(variant, taps_fp32, B, T):
    assert_op_equals_step(_unfused(variant), _inputs(T, B, variant, taps_fp32), variant)


def test_the_gate_is_spell11s():
    """spell11's output norm and gate (tests/models/spell11_k3.py, `KDA.forward`: its RMSNorm
    of the fp32 o to bf16, times the weight in bf16, then `.float() * sigmoid(g.float())` rounded
    once) against the reference's gate_fp32 form, bit for bit, on the o rule `norm_round` hands
    it (the fp32 o rounded to bf16 before the norm: to an ulp of bf16, that rule's bound, not
    this variant's); the built-in gate differs"""
    torch.manual_seed(0)
    B, T, H, D = 3, 2, 4, 64
    o, g = torch.randn(B, T, H, D).bfloat16().float(), torch.randn(B, T, H * D).bfloat16()
    norm = RMSNorm(D, 1e-5)
    norm.weight.data = torch.randn(D)
    spelled = (norm(o, torch.bfloat16).float()
               * torch.sigmoid(g.float().unflatten(-1, (H, D)))).to(torch.bfloat16)
    w = norm.weight.to(torch.bfloat16)
    normed = rms_norm(o.to(torch.bfloat16), w, 1e-5)
    ours = (normed.float() * torch.sigmoid(g.float().view(B, T, H, D))).to(torch.bfloat16)
    torch.testing.assert_close(ours, spelled, rtol=0, atol=0)
    assert not torch.equal(normed * torch.sigmoid(g.view(B, T, H, D)), spelled)


def test_the_flag_changes_the_bf16_output_only():
    """bf16: another output than the built-in gate's, a rounding apart, the same states; fp32:
    one computation"""
    args = _inputs(1, 2, GATE, False)
    gated, plain = clone(args), clone(args)
    o_gate = torch.ops.k3.kda_decode(*gated, None, None, GATE.spec)
    o_plain = torch.ops.k3.kda_decode(*plain, None, None)
    assert o_gate.dtype == o_plain.dtype == torch.bfloat16
    assert not torch.equal(o_gate, o_plain)
    torch.testing.assert_close(o_gate, o_plain, rtol=2e-2, atol=2e-2)
    for i in STATES:
        torch.testing.assert_close(gated[i], plain[i], rtol=0, atol=0)
    f32 = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
           for a in args]
    torch.testing.assert_close(torch.ops.k3.kda_decode(*clone(f32), None, None, GATE.spec),
                               torch.ops.k3.kda_decode(*clone(f32), None, None), rtol=0, atol=0)


def test_fp32_conv_weights_are_read_unrounded():
    """fp32 taps that bf16 cannot hold: the reference convolves them as they are (another output
    and conv state than the same taps rounded to bf16 would give: the outputs differ)"""
    args = _inputs(1, 2, GATE, True)
    rounded = clone(args)
    for name in TAPS:
        i = kda_decode.NAMES.index(name)
        assert not torch.equal(args[i], args[i].bfloat16().float())
        rounded[i] = args[i].bfloat16()
    o_fp32 = torch.ops.k3.kda_decode(*clone(args), None, None, GATE.spec)
    o_bf16 = torch.ops.k3.kda_decode(*rounded, None, None, GATE.spec)
    assert not torch.equal(o_fp32, o_bf16)


@pytest.mark.parametrize("spec_", ["gate_fp32,norm_fp32", "norm_fp32,gate_fp32",
                                   "norm_weight_fp32,gate_fp32"])
def test_gate_fp32_with_another_norm_is_an_error(spec_):
    """gate_fp32 is the built-in norm's: with fla's norm (which gates in fp32 already) or the
    Flax norm it is an error naming it, written in any order"""
    with pytest.raises(ValueError, match="gate_fp32"):
        torch.ops.k3.kda_decode(*_inputs(1, 2, GATE, False), None, None, spec_)


@pytest.mark.parametrize("variant,taps_fp32", CASES, ids=IDS)
@pytest.mark.parametrize("B,T", [(2, 1), (1, 1), (2, 2)])
def test_variant_rewrites_and_equals_eager(variant, taps_fp32, B, T):
    assert_variant_takes(_variant(T, B, variant, taps_fp32), _unfused(variant),
                         _inputs(T, B, variant, taps_fp32), variant)


@pytest.mark.parametrize("step,taps_fp32", [(GATE, True), (BUILTIN, False)],
                         ids=["spell11", "builtin"])
def test_each_variant_leaves_the_other_gate(step, taps_fp32):
    """the gate_fp32 variant (with the same taps) does not take the built-in gate, nor the
    built-in variant an fp32 gate; values unchanged"""
    other = BUILTIN if step is GATE else GATE
    args = _inputs(1, 2, step, taps_fp32)
    assert_variant_leaves(_variant(1, 2, other, taps_fp32), _unfused(step), args)


@pytest.mark.parametrize("variant", [GATE, BUILTIN], ids=["gate", "builtin"])
def test_bf16_taps_are_not_the_fp32_taps_variant(variant):
    """taps in the activations' dtype (upcast for the conv) are the plain variant's: the fp32
    taps variant leaves them, and with no fp32-weight conv in the graph is not even traced"""
    args = _inputs(1, 2, variant, False)
    taps_variant = _variant(1, 2, variant, True)
    gm = assert_variant_leaves(taps_variant, _unfused(variant), args)
    assert "fp32 weights" in taps_variant.fits(gm.graph)


def test_fb_variant_rewrites_and_equals_eager():
    assert_fb_variant_takes(GATE, "fb_kda_decode[gate_fp32]")


@pytest.mark.parametrize("variant,taps_fp32", CASES, ids=IDS)
def test_kernel_takes_the_variant(variant, taps_fp32):
    """the CUDA kernel's refusal (metadata): build options, no input it refuses; fp32 taps only
    all three fp32"""
    from k3compile.kernels import kda_decode as kernel

    meta = _kernel_inputs(2, 1, taps_fp32, "meta")
    assert kernel.refusal(*meta, variant.spec) is None
    if taps_fp32:
        i = kda_decode.NAMES.index("k_conv_weight")
        meta[i] = meta[i].bfloat16()
        assert "k_conv_weight" in kernel.refusal(*meta, variant.spec)


def _kernel_inputs(B, T, taps_fp32, device=None):
    args = kda_kernel_inputs(B, T)
    if taps_fp32:
        for name in TAPS:
            i = kda_decode.NAMES.index(name)
            args[i] = args[i].float() + 1e-3 * torch.randn_like(args[i].float())
    return [a.to(device) if device and isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,taps_fp32", CASES, ids=IDS)
@pytest.mark.parametrize("B,T", [(2, 1), (3, 4)])
def test_cuda_op_equals_the_cpu_reference(cuda_kernels, variant, taps_fp32, B, T):
    """on CUDA, at K3's head dim: the builds against the CPU reference, states included, two
    steps on the carried states, the kernel launched (as the other variants' tests)"""
    assert_cuda_op_equals_cpu(cuda_kernels, "kda_decode", _kernel_inputs(B, T, taps_fp32),
                              STATES, spec(variant))


@pytest.mark.parametrize("tested", [True, False], ids=["tested", "untested"])
@pytest.mark.parametrize("variant,taps_fp32", CASES, ids=IDS)
def test_site_on_gpu_graphs_once_its_gpu_test_passed(variant, taps_fp32, tested, monkeypatch):
    """As on a GPU graph (`kernels_only`): `gate_fp32` and `conv_weight_fp32` are in
    `kda_decode.GPU_TESTED_FLAGS` (this file's GPU tests passed, H100, session 38), so the site
    fuses; with them out of the set it stays with Inductor, deferred naming the flags. Values:
    the fused graph runs the reference op, the unfused one is the step itself."""
    names = {"gate_fp32", "conv_weight_fp32"}
    assert names <= kda_decode.GPU_TESTED_FLAGS
    if not tested:
        monkeypatch.setattr(kda_decode, "GPU_TESTED_FLAGS", kda_decode.GPU_TESTED_FLAGS - names)
    args = _inputs(1, 2, variant, taps_fp32)
    step = _unfused(variant)
    gm, report = rewrite(step, clone(args), [_variant(1, 2, variant, taps_fp32)], joint=True,
                         kernels_only=True)
    if tested:
        assert len(report.hits) == 1, report
    else:
        assert not report.hits and "k3.kda_decode.default" not in targets(gm)
        deferred = report.deferred["kda_decode"]
        assert all(n in deferred for n in (*variant.names, *(("conv_weight_fp32",)
                                                               if taps_fp32 else ()))), deferred
    for w, g in zip(step(*clone(args)), gm(*clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
