"""kda_decode / fb_kda_decode with `conv_products_rounded` (session 34): the short conv as a window
sum multiplied in bf16 (`(window * taps).sum(-1)` on bf16: each tap product rounded to bf16, the
products summed in fp32 in tap order, the sum rounded once, then the SiLU; spell10's per-token
`causal_conv1d_update` loop, spell12's `vecdot` of stacked windows). The reference against the
spellings' own conv and the unfused step, bit for bit; the pattern variants' rewrites; the
look-alikes they leave; the kernel's refusal, its GPU test, and the sites kept off GPU graphs
until that test passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import kda_decode

from k3compile.ops.kda_decode import ConvRounding, KDAVariant, window_sum_rounded
from k3compile.rewrite import apply_patterns
from tests.kernel_checks import assert_cuda_op_equals_cpu, kda_kernel_inputs

from .kda_checks import (
    STATES,
    assert_fb_variant_takes,
    assert_op_equals_step,
    assert_variant_leaves,
    assert_variant_takes,
    decode_inputs,
    kernel_refusal,
    spec,
)
from .kda_checks import clone as _clone
from .pattern_checks import graph, rewrite, targets

PRODUCTS = ConvRounding.PRODUCTS_ROUNDED
BUILTIN = KDAVariant(conv=PRODUCTS)  # spell10's, spell12's norm
FLA = KDAVariant(norm_fp32=True, o_fp32=True, conv=PRODUCTS)  # fla's fp32 norm on an fp32 o
SPELLINGS = [BUILTIN, FLA]
C, TAPS = 3 * 2048, 4  # one TP16 rank's q|k|v channels at K3's sizes


def _variant(T, B, variant, dtype=torch.bfloat16):
    return kda_decode._variant(T, B, dtype, variant=variant)


def _inputs(T, B, variant, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return decode_inputs(_variant(T, B, variant, dtype).example_inputs())


def _unfused(variant):
    def step(*args):
        return kda_decode._step(*args, silu_written_out=False, variant=variant)
    return step


def _window(T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(8, C, TAPS - 1 + T, generator=g).to(dtype),
            torch.randn(C, 1, TAPS, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_window_sum_is_spell10s_per_token_conv(dtype):
    """the reference's conv against spell10's `causal_conv1d_update` loop (tests/models/
    spell10_k3.py: `(cat(state, x_t[..., None]) * taps).sum(-1)`, taps [C, K]), 3 tokens, bit
    for bit; and against a bf16 conv rounded once (`conv_rounded`), which differs"""
    window, taps = _window(3, dtype)
    ours = window_sum_rounded(window, taps).to(dtype)
    state, outs = window[..., :TAPS - 1], []
    for t in range(3):
        win = torch.cat([state, window[:, :, TAPS - 1 + t, None]], dim=-1)
        outs.append((win * taps[:, 0]).sum(-1))
        state = win[:, :, 1:]
    torch.testing.assert_close(ours, torch.stack(outs, -1), rtol=0, atol=0)
    once = F.conv1d(window.float(), taps.float(), groups=C).to(dtype)
    assert not torch.equal(ours, once)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_window_sum_is_spell12s_vecdot(dtype):
    """against spell12's `vecdot(stack(shifted slices), taps[:, None, :])`, bit for bit"""
    window, taps = _window(3, dtype, seed=1)
    windows = torch.stack([window[..., j:j + 3] for j in range(TAPS)], -1)
    spelled = torch.linalg.vecdot(windows, taps[:, 0][:, None, :])
    torch.testing.assert_close(window_sum_rounded(window, taps).to(dtype), spelled, rtol=0,
                               atol=0)


def test_the_sum_runs_in_tap_order():
    """products whose fp32 sum depends on the order: 2^24 + 1 rounds back to 2^24 in fp32, so
    tap order gives ((2^24 + 1) + 1) - 2^24 = 0 where pairs give (2^24 + 1) + (1 - 2^24) = 1;
    the reference sums in tap order, as torch's CPU sum of a 4-element bf16 row does"""
    window = torch.tensor([[[2.0**24, 1.0, 1.0, -(2.0**24)]]], dtype=torch.bfloat16)
    taps = torch.ones(1, 1, 4, dtype=torch.bfloat16)
    p = window.float()[0, 0]
    assert ((p[0] + p[1]) + (p[2] + p[3])).item() == 1.0  # the order matters here
    assert window_sum_rounded(window, taps).item() == 0.0
    assert (window * taps[:, 0]).sum(-1).item() == 0.0  # eager's bf16 sum: tap order


@pytest.mark.parametrize("variant", SPELLINGS, ids=["builtin", "fla"])
@pytest.mark.parametrize("B,T", [(2, 1), (1, 2), (2, 3)])
def test_reference_equals_the_unfused_step(variant, B, T):
    assert_op_equals_step(_unfused(variant), _inputs(T, B, variant), variant)


def test_the_flag_changes_bf16_output_only():
    """bf16: another output than the conv rounded once (`conv_rounded`) and than the default,
    a rounding apart, the same states; fp32: the products and their tap-order sum, within fp32
    summation order of the default's conv"""
    args = _inputs(1, 2, BUILTIN)
    o_new = torch.ops.k3.kda_decode(*_clone(args), None, None, *spec(BUILTIN))
    o_once = torch.ops.k3.kda_decode(*_clone(args), None, None, "conv_rounded")
    o_default = torch.ops.k3.kda_decode(*_clone(args), None, None)
    assert not torch.equal(o_new, o_once) and not torch.equal(o_new, o_default)
    torch.testing.assert_close(o_new, o_once, rtol=3e-2, atol=3e-2)
    f32 = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
           for a in args]
    torch.testing.assert_close(torch.ops.k3.kda_decode(*_clone(f32), None, None, *spec(BUILTIN)),
                               torch.ops.k3.kda_decode(*_clone(f32), None, None),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["conv_rounded,conv_products_rounded",
                                     "conv_products_rounded,conv_rounded",
                                     "conv_products_rounded,conv_products_rounded"])
def test_two_conv_roundings_are_an_error(variant):
    """the conv roundings exclude each other: a spec naming two is eager's error, and no
    KDAVariant holds two (one `conv` field)"""
    args = _inputs(1, 2, BUILTIN)
    with pytest.raises(ValueError, match="two conv roundings"):
        torch.ops.k3.kda_decode(*_clone(args), None, None, variant)


@pytest.mark.parametrize("variant", SPELLINGS, ids=["builtin", "fla"])
@pytest.mark.parametrize("B,T", [(2, 1), (1, 1), (2, 2)])
def test_variant_rewrites_and_equals_eager(variant, B, T):
    assert_variant_takes(_variant(T, B, variant), _unfused(variant), _inputs(T, B, variant),
                         variant)


@pytest.mark.parametrize("conv", ["rounded_once", "fp32"])
def test_other_convs_are_not_the_products_variant(conv):
    """a bf16 conv (rounded once) and the fp32 conv are not the window sum: the variant takes
    neither, and with no product sum in the graph it is not even traced"""
    args = _inputs(1, 2, BUILTIN)
    other = KDAVariant(conv=ConvRounding.ROUNDED if conv == "rounded_once" else ConvRounding.FP32)

    def step(*a):
        return kda_decode._step(*a, silu_written_out=False, variant=other)

    variant = _variant(1, 2, BUILTIN)
    gm = assert_variant_leaves(variant, step, args)
    assert "window sum multiplied in bf16" in variant.fits(gm.graph)


def test_the_rounded_once_variant_leaves_the_window_sum():
    """conv_rounded's variant (the conv rounded once) does not take the product sum"""
    rounded = kda_decode._variant(1, 2, torch.bfloat16,
                                  variant=KDAVariant(conv=ConvRounding.ROUNDED))
    assert_variant_leaves(rounded, _unfused(BUILTIN), _inputs(1, 2, BUILTIN))


def test_fb_variant_rewrites_and_equals_eager():
    assert_fb_variant_takes(BUILTIN, "fb_kda_decode[conv_products_rounded]")


@pytest.mark.parametrize("variant", SPELLINGS, ids=["builtin", "fla"])
def test_kernel_takes_the_flag(variant):
    """the CUDA kernel's refusal (metadata): a build option, no input it refuses"""
    assert kernel_refusal(variant) is None


@pytest.mark.gpu
@pytest.mark.parametrize("variant", SPELLINGS, ids=["builtin", "fla"])
@pytest.mark.parametrize("B,T", [(2, 1), (3, 4)])
def test_cuda_op_equals_the_cpu_reference(cuda_kernels, variant, B, T):
    """on CUDA, at K3's head dim: the build against the CPU reference, states included, two steps
    on the carried states, the kernel launched (as the other rounding builds' tests)"""
    assert_cuda_op_equals_cpu(cuda_kernels, "kda_decode", kda_kernel_inputs(B, T), STATES,
                              spec(variant))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3])
def test_cuda_eager_window_sum_is_the_references(T):
    """CUDA's own bf16 `(windows * taps).sum(-1)` (what eager runs on the GPU) against the
    reference's tap-order sum, bit for bit: where it holds, the compiled step rounds its conv as
    GPU eager does (on the CPU it holds, measured; CUDA's order for a 4-element row not yet)"""
    window, taps = _window(T, torch.bfloat16)
    cuda = (window.cuda().unfold(-1, TAPS, 1) * taps.cuda()).sum(-1).cpu()
    torch.testing.assert_close(cuda, window_sum_rounded(window, taps).bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("tested", [True, False], ids=["tested", "untested"])
@pytest.mark.parametrize("flags", SPELLINGS, ids=["builtin", "fla"])
def test_site_on_gpu_graphs_once_its_gpu_test_passed(flags, tested, monkeypatch):
    """As on a GPU graph (`kernels_only`): `conv_products_rounded` fuses now that it is in
    `kda_decode.GPU_TESTED_FLAGS` (its GPU tests passed on an H100, session 35); without it in
    the set the site stays with Inductor, deferred naming the flag. Values: the fused graph runs
    the reference op (its rounding is the spelling's), the unfused one is the step itself."""
    if not tested:
        monkeypatch.setattr(kda_decode, "GPU_TESTED_FLAGS",
                            kda_decode.GPU_TESTED_FLAGS - {"conv_products_rounded"})
    args = _inputs(1, 2, flags)
    step = _unfused(flags)
    gm, report = rewrite(step, _clone(args), [_variant(1, 2, flags)], joint=True,
                         kernels_only=True)
    if tested:
        assert len(report.hits) == 1, report
        assert "k3.kda_decode.default" in targets(gm)
    else:
        assert not report.hits and "k3.kda_decode.default" not in targets(gm)
        assert "conv_products_rounded" in report.deferred["kda_decode"]
    for w, g in zip(step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _norm_rounded_again(x, weight, gate, eps):
    """fla's gated norm with the normalised o rounded before the weight: once too often."""
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (h.to(x.dtype).float() * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def test_a_look_alike_norm_near_miss_names_the_node(monkeypatch):
    """The window sum with an output norm one rounding away from fla's (on a rounded o): no
    variant takes it, the values hold, and the near miss of each products variant names the
    extra rounding (the states match; the output o finds no node to start at), not a bare "no
    anchor found" (session 34's review)"""
    variant = KDAVariant(norm_fp32=True, conv=PRODUCTS)
    args = _inputs(1, 2, variant)
    with monkeypatch.context() as patch:  # the look-alike only while this graph is traced
        patch.setattr(kda_decode, "rms_norm_gated_fp32", _norm_rounded_again)
        gm = graph(_unfused(variant), *_clone(args), joint=True)
    want = gm(*_clone(args))
    family = [p for p in kda_decode.patterns() if p.name.startswith("kda_decode[T=1,B=n,bf")
              and "conv_products_rounded" in p.name]
    report = apply_patterns(gm.graph, family)
    gm.recompile()
    assert not report.hits and len(family) == 3

    def cast(n, dtype):
        return n.target is torch.ops.prims.convert_element_type.default and n.args[1] == dtype

    (rounding,) = [n for n in gm.graph.nodes if cast(n, torch.bfloat16)  # h.to(bf16).float()
                   and n.args[0].target is torch.ops.aten.mul.Tensor
                   and any(cast(u, torch.float32) for u in n.users)]
    named = [m for m in report.near_misses
             if m.reason.startswith("no anchor found: an output of the pattern reads ")]
    assert {m.pattern for m in named} >= {p.name for p in family[:2]}, report.near_misses
    for miss in named:
        assert f"{rounding.name} (" in miss.reason, miss
    for w, g in zip(want, gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_window_sum_in_fp32_is_refused_by_name():
    """Inductor's matcher ignores keyword arguments the pattern's node lacks, so a sum of the
    bf16 products with dtype=fp32 (not rounded to bf16) matched the variant's sum; the engine's
    match refuses it, naming the sum and its keyword, and the values hold (before the refusal
    the op rounded the sum: another value)"""
    args = _inputs(1, 2, BUILTIN)
    gm = graph(_unfused(BUILTIN), *_clone(args), joint=True)
    total = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList)
    (upcast,) = total.users  # the SiLU's fp32: a no-op on an fp32 sum
    assert upcast.target is torch.ops.prims.convert_element_type.default
    total.kwargs = {"dtype": torch.float32}
    total.meta["val"] = total.meta["val"].float()
    gm.recompile()
    want = gm(*_clone(args))
    report = apply_patterns(gm.graph, [_variant(1, 2, BUILTIN)])
    gm.recompile()
    assert not report.hits
    (miss,) = report.near_misses
    assert miss.reason.startswith(f"keyword_mismatch: {total.name} (sum.dim_IntList float32"), miss
    assert "has dtype=torch.float32, which the pattern's op does not pass" in miss.reason, miss
    for w, g in zip(want, gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
