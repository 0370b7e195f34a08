"""The rms_norm kernel's `fp32_weight` build (`rms_norm_fp32_weight_cuda`): norm_linear's
`weight_fp32` norm (`math.rms_norm_fp32_weight`: normalise in fp32, multiply by the weight in fp32,
one rounding to bf16), x and the weight each bf16 or fp32. Spellings that write it: spell5,
spell7, spell10 and the red-team spelling (the MoE finalize's fp32 sum into the latent norm).

CPU: the refusal reasons; refused and CPU calls take the reference (the same values). sm_90a:
every dtype pair builds, rounding once per element where the plain build rounds twice. GPU: each
dtype pair at the routed-latent width and odd widths against a float64 model (one rounding), and
norm_linear's `weight_fp32` with the kernel launched (no fallback) against the op's reference."""

import re

import pytest
import torch
from k3compile.kernels import norm_linear
from k3compile.kernels import rms_norm as kernel

from k3compile.math import rms_norm_fp32_weight
from k3compile.ops.norm_linear import norm_linear_ref
from tests.kernel_checks import BUCKETS, TOL, assert_written, no_fallback, on_gpu, rel_err

LATENT, EPS = 3584, 1e-5
PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
         (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def pair_id(pair):
    return "x_{}-w_{}".format(*(str(d).removeprefix("torch.") for d in pair))


def make_inputs(gen, n, dim, x_dtype, w_dtype, device="cuda"):
    x = (torch.randn(n, dim, generator=gen, device=device) * 4).to(x_dtype)
    return x, (1 + 0.2 * torch.randn(dim, generator=gen, device=device)).to(w_dtype)


def model(x, w, eps):
    """float64 throughout, one rounding to bf16."""
    xd = x.double()
    return (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()).bfloat16()


# ---- CPU ----------------------------------------------------------------------------------------


def _meta(n=4, dim=LATENT, x_dtype=torch.float32, w_dtype=torch.float32):
    return (torch.empty(n, dim, dtype=x_dtype, device="meta"),
            torch.empty(dim, dtype=w_dtype, device="meta"))


REFUSALS = {
    "width_not_8": (_meta(dim=3588), torch.bfloat16, "width 3588"),
    "out_fp32": (_meta(), torch.float32, "output torch.float32"),
    "x_fp16": (_meta(x_dtype=torch.float16), torch.bfloat16, "x: torch.float16"),
    "x_strided": ((torch.empty(LATENT, 4, device="meta").t(), _meta()[1]), torch.bfloat16, "x:"),
    "w_fp16": (_meta(w_dtype=torch.float16), torch.bfloat16, "weight: torch.float16"),
    "w_short": ((_meta()[0], torch.empty(LATENT - 8, device="meta")), torch.bfloat16, "weight:"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusal_reasons(case):
    (x, w), dtype, reason = REFUSALS[case]
    why = kernel.fp32_weight_refusal(x, w, dtype)
    assert why is not None and reason in why, why


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_accepted_dtypes(pair):
    assert kernel.fp32_weight_refusal(*_meta(x_dtype=pair[0], w_dtype=pair[1]),
                                      torch.bfloat16) is None


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_cpu_calls_take_the_reference(pair):
    gen = torch.Generator().manual_seed(3)
    x, w = make_inputs(gen, 3, 96, *pair, device="cpu")
    got = kernel.rms_norm_fp32_weight_cuda(x, w, EPS, torch.bfloat16)
    assert torch.equal(got, rms_norm_fp32_weight(x, w, EPS, torch.bfloat16))
    torch.testing.assert_close(got.float(), model(x, w, EPS).float(), **TOL["bf16"])
    h = kernel.rms_norm_fp32_weight_cuda(x, w, EPS, torch.float32)  # refused: fp32 out
    assert h.dtype == torch.float32 and torch.equal(h, rms_norm_fp32_weight(x, w, EPS,
                                                                            torch.float32))


@pytest.mark.dsl
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_builds_read_each_dtype(monkeypatch, tmp_path, pair):
    """sm_90a, one vector a thread: a thread's 8 columns of x and of the weight are one 16-byte
    load each in bf16, two in fp32; only bf16 inputs widen (cvt.f32.bf16, 8 per bf16 input);
    y is 8 bf16 (4 cvt.rn.bf16x2.f32)."""
    from k3compile.kernels.common.dsl import ptx_of

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    cfg = kernel.config(LATENT, 1)
    assert cfg.vec_per_thread == 1
    x_fp32, w_fp32 = (d == torch.float32 for d in pair)
    ptx = ptx_of(kernel.build(LATENT, cfg, arch="sm_90a", dump_dir=str(tmp_path),
                              fp32_weight=True, x_fp32=x_fp32, w_fp32=w_fp32))
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == (1 + x_fp32) + (1 + w_fp32)
    assert ptx.count("cvt.f32.bf16") == 8 * ((not x_fp32) + (not w_fp32))
    assert ptx.count("cvt.rn.bf16x2.f32") == 4


# ---- GPU ----------------------------------------------------------------------------------------


def check(x, w):
    with no_fallback():
        out = kernel.rms_norm_fp32_weight_cuda(x, w, EPS, torch.bfloat16)
    assert_written(out)
    want = model(x, w, EPS)
    torch.testing.assert_close(out.float(), want.float(), **TOL["bf16"])
    assert rel_err(out, want) < TOL["bf16_rel_norm"]
    # one rounding of nearly the same fp32 value: at most one bf16 ulp from the model
    assert ((out.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()


@on_gpu
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
@pytest.mark.parametrize("n", BUCKETS)
def test_routed_latent(gen, pair, n):
    check(*make_inputs(gen, n, LATENT, *pair))


@on_gpu
@pytest.mark.parametrize("pair", PAIRS[:2], ids=pair_id)
@pytest.mark.parametrize("dim", [96, 1032, 7168])
def test_other_widths(gen, pair, dim):
    for n in (1, 37):
        check(*make_inputs(gen, n, dim, *pair))


@on_gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_norm_linear_weight_fp32(gen, n):
    """norm_linear's weight_fp32 on CUDA: the kernel then the GEMM, no fallback, against the op's
    reference (fp32 u from the MoE finalize, fp32 norm weight, bf16 W and residual)."""
    x, w = make_inputs(gen, n, LATENT, torch.float32, torch.float32)
    proj = (torch.randn(896, LATENT, generator=gen, device="cuda") * LATENT ** -0.5).bfloat16()
    res = torch.randn(n, 896, generator=gen, device="cuda").bfloat16()
    with no_fallback():
        got = norm_linear.norm_linear_cuda(x, w, proj, EPS, res, weight_fp32=True)
    ref = norm_linear_ref(x, w, proj, EPS, res, True)
    assert got.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), **TOL["bf16"])
    assert rel_err(got, ref) < TOL["bf16_rel_norm"]
