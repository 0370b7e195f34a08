"""gemv kernel (y = x · Wᵀ [+ r], M <= 16) at one K3 TP16 rank's weight shapes for every batch
bucket, rows between buckets, an odd aligned shape, the fp32 router output, the residual
epilogue, strided operands, and the torch fallback of refused inputs (GPU).

Its one-launch variants (norm prologue, SiTU epilogue, split output): on any machine, a torch
model of the kernel's blocking (`kernel_sums`: the kernel's fp32 sums bit for bit, `norm_model`:
its normalised x) against each op's reference at the real TP16 shapes, refusals, configs and the
compile key; on the GPU each variant against its op's reference and against the two launches it
replaces, and the model against the kernel."""

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from k3compile.kernels.common import dsl
from k3compile.kernels.common import gemv as kernel
from k3compile.kernels.common.launch import Kernel

from k3compile import settings
from k3compile.math import situ as situ_ref
from k3compile.ops.moe_front import moe_front_ref
from k3compile.ops.norm_linear import norm_linear_ref
from k3compile.ops.rms_norm import rms_norm_ref
from k3compile.ops.situ_gate_up import situ_gate_up_ref
from tests.kernel_checks import (
    TOL,
    assert_written,
    check_gemm,
    gemm_inputs,
    gemm_model,
    on_gpu,
    poisoned,
    rel_err,
)

# [N, K] of one TP16 rank: KDA in-proj, MLA q_a|kv_a, latent down, latent up, router, gates /
# shared gate_up, o_proj, MLA q_b, shared down, KDA f_b
SHAPES = [(3206, 7168), (2112, 7168), (3584, 7168), (7168, 3584), (896, 7168), (7168, 768),
          (768, 7168), (1152, 1536), (7168, 384), (768, 128)]
ODD = (1000, 1032)  # N not a multiple of any R; K/8 = 129 vectors: a predicated tail
ROUTER = (896, 7168)
# fp32 sums of up to 7168 products of size ~1/sqrt(K): ~sqrt(K)·2^-24 absolute from fp64
FP32_SUMS = {"rtol": 1e-4, "atol": 1e-4}


make_inputs, model = gemm_inputs, gemm_model


def check(x, w, residual=None, out_dtype=torch.bfloat16, **kw):
    return check_gemm(kernel.gemv_cuda, x, w, residual, out_dtype, fp32_tol=FP32_SUMS, **kw)


@on_gpu
@pytest.mark.parametrize("m", kernel.BUCKETS)
@pytest.mark.parametrize("n,k", [*SHAPES, ODD], ids=lambda v: str(v))
def test_shapes(gen, n, k, m):
    check(*make_inputs(gen, m, n, k))


@on_gpu
@pytest.mark.parametrize("m", [3, 5, 7, 12])
@pytest.mark.parametrize("n,k", [(3206, 7168), (7168, 768), ODD], ids=lambda v: str(v))
def test_rows_between_buckets(gen, n, k, m):
    check(*make_inputs(gen, m, n, k))


@on_gpu
@pytest.mark.parametrize("m", kernel.BUCKETS)
def test_router_fp32_logits(gen, m):
    check(*make_inputs(gen, m, *ROUTER), out_dtype=torch.float32)


@on_gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(7168, 768), (7168, 384), ODD], ids=lambda v: str(v))
def test_residual(gen, n, k, m):
    x, w = make_inputs(gen, m, n, k)
    r = (4 * torch.randn(m, n, generator=gen, device="cuda")).bfloat16()
    check(x, w, r)
    check(x, w, r, out_dtype=torch.float32)


@on_gpu
def test_strided_operands_and_determinism(gen):
    x, w = make_inputs(gen, 8, 2112 + 16, 7168 + 64)
    x, w = x[:, 64:], w[16:, 64:]  # row strides K + 64, 16-byte aligned row starts
    r = torch.randn(8, 2 * 2112, generator=gen, device="cuda").bfloat16()[:, ::2]
    assert kernel.refusal(x, w, r) is not None  # residual with strided columns: refused
    r = r.contiguous()
    first = check(x, w, r)
    assert torch.equal(first, check(x, w, r)), "not deterministic"


@on_gpu
def test_empty_batch(gen):
    x, w = make_inputs(gen, 0, 768, 128)
    assert kernel.gemv_cuda(x, w).shape == (0, 768)


@on_gpu
@pytest.mark.parametrize("case", ["k_not_multiple_of_8", "fp32_x", "batch_17"])
def test_refused_inputs_fall_back_to_torch(gen, caplog, case):
    m, n, k = {"k_not_multiple_of_8": (4, 256, 1001), "fp32_x": (4, 768, 128),
               "batch_17": (17, 768, 7168)}[case]
    x, w = make_inputs(gen, m, n, k)
    if case == "fp32_x":
        x = x.float()
    assert not kernel.can_implement(x, w)
    r = torch.randn(m, n, generator=gen, device="cuda").to(x.dtype)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        y = kernel.gemv_cuda(x, w)
        y_res = kernel.gemv_cuda(x, w, r)
    assert "gemv" in caplog.text
    if case == "batch_17":
        assert "batch above 16: cuBLAS" in caplog.text
    assert torch.equal(y, kernel.gemm_ref(x, w))
    assert torch.equal(y_res, kernel.gemm_ref(x, w, r))
    tol = TOL["bf16"] if y.dtype == torch.bfloat16 else FP32_SUMS
    torch.testing.assert_close(y.float(), model(x, w, None, y.dtype).float(), **tol)
    torch.testing.assert_close(y_res.float(), model(x, w, r, y.dtype).float(), **tol)


# ---- one-launch variants --------------------------------------------------------------------------

HIDDEN, LATENT, EXPERTS, SHARED, DENSE, EPS, BETA, LINEAR_BETA = (
    7168, 3584, 896, 384, 2112, 1e-5, 4.0, 25.0)  # DENSE: layer 0's I per TP16 rank


@pytest.fixture
def cpu_gen():
    seed = int(torch.randint(1 << 30, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def _blocks(k, threads=None):
    """(T, J): the kernel's threads per CTA (default: the heuristic's at width K) and vectors per
    thread."""
    threads = threads or kernel.heuristic_config(1, k, 1).threads
    return threads, -(-(k // 8) // threads)


def _per_thread(x, k, threads=None):
    """x [..., K] -> [..., J, T, 8] fp32: thread t's vectors t, t + T, ... (zeros past K)."""
    T, J = _blocks(k, threads)
    return F.pad(x.float(), (0, J * T * 8 - k)).unflatten(-1, (J, T, 8))


def _butterfly(v):
    """[..., 32] lanes -> the xor-butterfly total (every lane's: the adds commute)."""
    lane = torch.arange(32, device=v.device)
    for offset in (16, 8, 4, 2, 1):
        v = v + v[..., lane ^ offset]
    return v[..., 0]


def _in_order(v):
    total = v[..., 0]
    for i in range(1, v.shape[-1]):
        total = total + v[..., i]
    return total


def kernel_sums(x, w, threads=None):
    """The kernel's fp32 sums Σ_k x[m, k]·w[n, k], bit for bit: thread t of T adds its elements
    in order (bf16 products are exact in fp32, so its fused multiply-adds round as these adds
    do), a butterfly over each warp's lanes, then the warps in order. The order depends on K and
    T alone, not on R, the grid, M or the variant."""
    k = x.shape[1]
    xv, wv = _per_thread(x, k, threads), _per_thread(w, k, threads)
    T, J = _blocks(k, threads)
    acc = torch.zeros(x.shape[0], w.shape[0], T, device=x.device)
    for j in range(J):
        for e in range(8):
            acc += xv[:, None, j, :, e] * wv[None, :, j, :, e]
    return _in_order(_butterfly(acc.unflatten(-1, (T // 32, 32))))


def norm_model(x, g, eps, m_bucket, threads=None):
    """(x̂, rstd) of the norm prologue: the kernel's sum of squares (per thread in vector order,
    warp butterflies, then block_sum across warps: lane k adds column k in order at >= 4 values,
    a butterfly over the zero-padded warp totals below), rstd = rsqrt(ss / K + eps) (torch's
    rsqrt standing in for the kernel's approximate one), x̂ rounded as rms_norm_ref rounds it."""
    k = x.shape[1]
    T, _ = _blocks(k, threads)
    xv = _per_thread(x, k, threads)
    s = torch.zeros(x.shape[0], T, device=x.device)
    for j in range(xv.shape[1]):
        for e in range(8):
            s = s + xv[:, j, :, e] ** 2
    warps = _butterfly(s.unflatten(-1, (T // 32, 32)))
    ss = _in_order(warps) if m_bucket >= 4 else _butterfly(F.pad(warps, (0, 32 - T // 32)))
    rstd = torch.rsqrt(ss / k + eps)
    return _normalised(x, g, rstd), rstd


def _normalised(x, g, rstd):
    return ((x.float() * rstd[:, None]).bfloat16().float() * g.float()).bfloat16()


def norm_inputs(gen, m, n=HIDDEN, k=LATENT, residual=True):
    device = gen.device
    u = (3 * torch.randn(m, k, generator=gen, device=device)).bfloat16()
    g = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).bfloat16()
    w = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).bfloat16()
    r = torch.randn(m, n, generator=gen, device=device).bfloat16() if residual else None
    return u, g, w, r


def gate_up_inputs(gen, m, width=SHARED, k=HIDDEN):
    device = gen.device
    x = torch.randn(m, k, generator=gen, device=device).bfloat16()
    wg, wu = ((torch.randn(width, k, generator=gen, device=device) / k ** 0.5).bfloat16()
              for _ in range(2))
    return x, wg, wu


def close_bf16(out, want):
    torch.testing.assert_close(out.float(), want.float(), **TOL["bf16"])
    assert rel_err(out, want) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("m", [1, 5, pytest.param(16, marks=pytest.mark.slow)])  # m 16: ~6 s each
@pytest.mark.parametrize("residual", [False, True])
def test_norm_model_rounds_as_the_reference(cpu_gen, m, residual):
    """x̂ takes rms_norm_ref's two roundings (bitwise where rstd is the reference's); the
    kernel's order of the squares moves rstd by a few ulps in some rows, where some x · rstd
    (all of one bf16 mantissa at a time) round one bf16 ulp apart; the whole op (fp32 sums, the residual
    added before one rounding) is norm_linear_ref's within the bf16 tolerance. At the TP16
    shape: latent 3584 -> hidden 7168."""
    u, g, w, r = norm_inputs(cpu_gen, m, residual=residual)
    want_rstd = torch.rsqrt(u.float().pow(2).mean(-1) + EPS)
    ref = rms_norm_ref(u, g, EPS)
    assert torch.equal(_normalised(u, g, want_rstd), ref)
    xhat, rstd = norm_model(u, g, EPS, dsl.bucket(m))
    torch.testing.assert_close(rstd, want_rstd, rtol=2 ** -21, atol=0)
    same = rstd == want_rstd
    assert torch.equal(xhat[same], ref[same])
    # one bf16 ulp of x · rstd at most, which g scales before the second rounding
    h, want_h = ((u.float() * s[:, None]).bfloat16().float() for s in (rstd, want_rstd))
    assert ((h - want_h).abs() <= want_h.abs() * 2 ** -7).all(), "more than one bf16 ulp"
    assert ((xhat.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -6).all()
    y = kernel_sums(xhat, w)
    y = (y if r is None else y + r.float()).bfloat16()
    close_bf16(y, norm_linear_ref(u, g, w, EPS, r))


@pytest.mark.parametrize("m", [1, 4, pytest.param(16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("width", [SHARED, DENSE])
def test_situ_model_is_the_reference(cpu_gen, m, width):
    """SiTU of the bf16-rounded gate and up sums (the GEMM output the reference rounds too):
    the reference's roundings, its sums in another order. Shared experts and dense layer 0."""
    x, wg, wu = gate_up_inputs(cpu_gen, m, width)
    sums = kernel_sums(x, torch.cat([wg, wu]))
    got = situ_ref(sums[:, :width].bfloat16(), sums[:, width:].bfloat16(), BETA, LINEAR_BETA)
    close_bf16(got, situ_gate_up_ref(x, wg, wu, BETA, LINEAR_BETA))


@pytest.mark.parametrize("m", [1, pytest.param(16, marks=pytest.mark.slow)])
def test_split_model_is_the_reference(cpu_gen, m):
    """Router logits (fp32 sums of exact products: the reference's up to their order) and the
    latent z (bf16) from one pass over [W_r; W_d]."""
    x, w_r, _ = gate_up_inputs(cpu_gen, m, EXPERTS)
    w_d = (torch.randn(LATENT, HIDDEN, generator=cpu_gen) / HIDDEN ** 0.5).bfloat16()
    sums = kernel_sums(x, torch.cat([w_r, w_d]))
    want_logits, want_z = moe_front_ref(x, w_r, w_d)
    assert rel_err(sums[:, :EXPERTS], want_logits) < 1e-5
    close_bf16(sums[:, EXPERTS:].bfloat16(), want_z)


def test_kernel_sums_are_the_gemm(cpu_gen):
    x, w = torch.randn(3, 1032, generator=cpu_gen).bfloat16(), torch.randn(40, 1032).bfloat16()
    torch.testing.assert_close(kernel_sums(x, w), model(x, w, out_dtype=torch.float32),
                               **FP32_SUMS)


def test_variant_refusals():
    """Metadata only (meta tensors)."""
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    x, w, g = t(1, LATENT), t(HIDDEN, LATENT), t(LATENT)
    refuse = kernel.fused_refusal
    assert refuse(kernel.NORM, x, w, t(1, HIDDEN), norm_weight=g) is None
    assert "norm weight" in refuse(kernel.NORM, x, w)
    assert "norm weight" in refuse(kernel.NORM, x, w, norm_weight=t(LATENT, dtype=torch.float32))
    assert "norm weight" in refuse(kernel.NORM, x, w, norm_weight=t(2 * LATENT)[::2])
    assert "K 32768" in refuse(kernel.NORM, t(1, 32768), t(64, 32768), norm_weight=t(32768))
    assert "batch above 16" in refuse(kernel.NORM, t(17, LATENT), w, norm_weight=g)
    gu = t(2 * SHARED, HIDDEN)
    assert refuse(kernel.SITU, t(1, HIDDEN), gu) is None
    assert "SiTU" in refuse(kernel.SITU, t(1, HIDDEN), t(2 * SHARED + 1, HIDDEN))
    assert "SiTU" in refuse(kernel.SITU, t(1, HIDDEN), gu, t(1, 2 * SHARED))
    assert "SiTU" in refuse(kernel.SITU, t(1, HIDDEN), gu, out_dtype=torch.float32)
    front = t(EXPERTS + LATENT, HIDDEN)
    split = kernel.Fusion(split=EXPERTS)
    assert refuse(split, t(1, HIDDEN), front, out_dtype=torch.float32) is None
    assert "split at row" in refuse(kernel.Fusion(split=EXPERTS + LATENT), t(1, HIDDEN), front)
    assert "residual" in refuse(split, t(1, HIDDEN), front, t(1, EXPERTS + LATENT))
    assert "dtype" in refuse(split, t(1, HIDDEN, dtype=torch.float32), front)


def test_variant_configs():
    """The plain configs do not move; SiTU pairs rows (R even); the norm prologue's registers
    count; every variant's config fits it (tuned or not)."""
    for n, k in [*SHAPES, ODD]:
        for b in kernel.BUCKETS:
            assert kernel.config(n, k, b, kernel.PLAIN) == kernel.config(n, k, b)
            assert kernel.config(n, k, b, kernel.Fusion(split=1)) == kernel.config(n, k, b)
            assert kernel.config(n, k, b, kernel.SITU).rows_per_cta % 2 == 0
            norm = kernel.heuristic_config(n, k, b, kernel.NORM)
            assert norm.rows_per_cta <= kernel.heuristic_config(n, k, b).rows_per_cta
            for f in (kernel.PLAIN, kernel.NORM, kernel.SITU, kernel.Fusion(gate=64)):
                assert kernel.fits(kernel.config(n, k, b, f), k, b, f)


def test_tuned_table_picks_configs_that_fit(monkeypatch):
    """`config` takes the table's entry where it fits the variant and the heuristic's elsewhere;
    without a table (none shipped yet) every config is the heuristic's. The sweep's configs all
    fit."""
    if not kernel.TABLE.exists():
        assert kernel.tuned() == {}
        for n, k in [*SHAPES, ODD]:
            assert kernel.config(n, k, 1) == kernel.heuristic_config(n, k, 1)
    odd, paired = kernel.Config(1, 256, 2), kernel.Config(2, 512, 1)
    monkeypatch.setattr(kernel, "tuned", lambda: {(768, 7168, 1): odd, (3584, 7168, 1): paired,
                                                  (768, 7168, 16): kernel.Config(8, 128)})
    assert kernel.config(768, 7168, 1) == odd
    assert kernel.config(768, 7168, 1, kernel.SITU) == kernel.heuristic_config(768, 7168, 1,
                                                                               kernel.SITU)
    assert kernel.config(3584, 7168, 1, kernel.SITU) == paired
    assert kernel.config(3584, 7168, 2) == kernel.heuristic_config(3584, 7168, 2)  # no entry
    # R 8 x T 128 at K 7168: 56 W vectors per thread, no fit: the heuristic's
    assert kernel.config(768, 7168, 16) == kernel.heuristic_config(768, 7168, 16)
    for n, k in [*SHAPES, ODD]:
        for b in (1, 16):
            cfgs = kernel.configs(n, k, b)
            assert cfgs and all(kernel.fits(c, k, b) for c in cfgs)
            assert all(c.ctas_per_sm == 0 or kernel.grid_size(-(-n // c.rows_per_cta), c)
                       < -(-n // c.rows_per_cta) for c in cfgs), "a persistent grid that is not"


def test_sweep_table(tmp_path, monkeypatch):
    """`benchmarks/gemv.py --sweep` writes per (shape, bucket) the fastest config, or the
    heuristic's where that is within NOISE; merged into the entries of other shapes already
    there; `tuned()`'s loader reads it back."""
    from pathlib import Path

    from k3compile.kernels.common.gemm import load_tuned

    from tests.conftest import load_benchmark

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    bench = load_benchmark("gemv")
    h, p, q = (str(c) for c in (kernel.Config(1, 256), kernel.Config(2, 256, 1),
                                kernel.Config(4, 512)))
    rows = [{"N": 896, "K": 7168, "M": 1, "default": h, "best": p, "us": {p: 3.9, h: 5.2},
             "pct_copy": {p: 78.0, h: 58.5}},
            {"N": 2112, "K": 7168, "M": 1, "default": h, "best": q, "us": {q: 9.4, h: 9.5},
             "pct_copy": {q: 76.0, h: 75.2}},
            {"N": 2112, "K": 7168, "M": 8, "default": q, "best": p, "us": {q: 12.0, p: 11.0},
             "pct_copy": {q: 60.0, p: 65.5}, "router_us": 10.0}]
    path = tmp_path / "gemv_tuned.json"
    # the loader keeps only a table measured on this process's GPU (any, without one)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "GPU"
    bench.write_table(path, rows[:1], device, "test")
    bench.write_table(path, rows[1:], device, "test")
    table = load_tuned(path, "gemv", lambda c: kernel.Config(**c))
    assert table == {(896, 7168, 1): kernel.Config(2, 256, 1),
                     (2112, 7168, 1): kernel.Config(1, 256),  # 1% faster: noise
                     (2112, 7168, 8): kernel.Config(2, 256, 1)}
    entries = json.loads(path.read_text())["entries"]
    assert [e.get("router_us") for e in entries] == [None, None, 10.0]
    bench.write_table(path, rows[1:2], "another GPU", "test")  # other devices' entries go
    saved = json.loads(path.read_text())
    assert saved["device"] == "another GPU" and len(saved["entries"]) == 1


def test_fusion_is_in_the_compile_key(monkeypatch):
    builds = []
    monkeypatch.setattr(kernel, "KERNEL", Kernel(kernel.OP, lambda *_, pdl, fusion, **__:
                                                 builds.append((pdl, fusion)) or (pdl, fusion)))
    cfg = kernel.config(768, 7168, 1)
    fusions = [kernel.PLAIN, kernel.NORM, kernel.SITU, kernel.Fusion(split=256)]
    for pdl in (False, True, False):
        monkeypatch.setattr(settings.KERNELS, "pdl", pdl)
        for f in fusions:
            assert kernel.KERNEL.compiled(768, 7168, 1, False, False, cfg,
                                          fusion=f) == (pdl, f)
    assert builds == [(p, f) for p in (False, True) for f in fusions], "one build per key"


def test_switch_names_variants_and_is_read_at_call_time(monkeypatch):
    if "K3_GEMV_FUSED" not in os.environ:
        assert settings.KERNELS.gemv_fused == {"norm", "situ", "gate", "split"}
    assert settings.parse_gemv_fused(None) == settings.GEMV_DEFAULT
    assert settings.parse_gemv_fused("0") == settings.parse_gemv_fused("") == frozenset()
    assert settings.parse_gemv_fused("1") == settings.parse_gemv_fused("all") == set(settings.GEMV_VARIANTS)
    assert settings.parse_gemv_fused(" split,norm ") == {"split", "norm"}
    with pytest.raises(ValueError, match="unknown variants"):
        settings.parse_gemv_fused("norm,bias")
    for names in ({"split"}, set(), {"norm", "situ"}):
        monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset(names))
        assert [kernel.fused_enabled(v) for v in settings.GEMV_VARIANTS] == [v in names for v in settings.GEMV_VARIANTS]
    assert not kernel.fused_takes(torch.empty(1, 64), "norm")  # a CPU tensor: the reference runs


# GPU: each variant through its wrapper, poisoned outputs, fresh inputs, the TP16 shapes


@on_gpu
@pytest.mark.parametrize("m", kernel.BUCKETS)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n,k", [(HIDDEN, LATENT), ODD], ids=str)
def test_norm_variant(gen, n, k, m, residual):
    """Against norm_linear_ref, and against its own model (x̂ from torch's rsqrt: within one
    bf16 rounding of the output)."""
    u, g, w, r = norm_inputs(gen, m, n, k, residual)
    out = poisoned(m, n)
    assert kernel.gemv_norm_cuda(u, g, w, EPS, r, out=out) is out, "fell back"
    assert_written(out)
    close_bf16(out, norm_linear_ref(u, g, w, EPS, r))
    t = kernel.config(n, k, dsl.bucket(m), kernel.NORM).threads
    y = kernel_sums(norm_model(u, g, EPS, dsl.bucket(m), t)[0], w, t)
    close_bf16(out, y if r is None else y + r.float())


@on_gpu
@pytest.mark.parametrize("m", kernel.BUCKETS)
@pytest.mark.parametrize("width,k", [(SHARED, HIDDEN), (DENSE, HIDDEN), (1000, 1032)], ids=str)
def test_situ_variant(gen, width, k, m):
    """Against situ_gate_up_ref, and bitwise against the two launches it replaces (gemv, then
    the situ kernel): the same sums, rounded and activated alike."""
    from k3compile.kernels import situ_gate_up

    x, wg, wu = gate_up_inputs(gen, m, width, k)
    w = torch.cat([wg, wu])
    out = poisoned(m, width)
    assert kernel.gemv_situ_cuda(x, w, BETA, LINEAR_BETA, out=out) is out, "fell back"
    assert_written(out)
    close_bf16(out, situ_gate_up_ref(x, wg, wu, BETA, LINEAR_BETA))
    cfg = kernel.config(2 * width, k, dsl.bucket(m), kernel.SITU)  # its summation order
    gate_up = kernel.gemv_cuda(x, w, out=poisoned(m, 2 * width), cfg=cfg)
    assert torch.equal(out, situ_gate_up.situ_cuda(gate_up, BETA, LINEAR_BETA, out=poisoned(m, width)))


@on_gpu
@pytest.mark.parametrize("m", kernel.BUCKETS)
@pytest.mark.parametrize("split,n,k", [(EXPERTS, EXPERTS + LATENT, HIDDEN), (333, 1000, 1032)],
                         ids=str)
def test_split_variant(gen, split, n, k, m):
    """Router logits and latent z of one launch are bitwise the two gemv launches' (333: CTAs
    straddle the split), and moe_front_ref's within its tolerances."""
    x, w = make_inputs(gen, m, n, k)
    out, out2 = poisoned(m, split, dtype=torch.float32), poisoned(m, n - split)
    got = kernel.gemv_split_cuda(x, w, split, out=out, out2=out2)
    assert got[0] is out and got[1] is out2, "fell back"
    assert_written(out, out2)
    cfg = kernel.config(n, k, dsl.bucket(m), kernel.Fusion(split=split))  # its summation order
    assert torch.equal(out, kernel.gemv_cuda(x, w[:split], out_dtype=torch.float32, cfg=cfg))
    assert torch.equal(out2, kernel.gemv_cuda(x, w[split:], cfg=cfg))
    want_logits, want_z = moe_front_ref(x, w[:split], w[split:])
    assert rel_err(out, want_logits) < 1e-5
    close_bf16(out2, want_z)


@on_gpu
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(EXPERTS, HIDDEN), (HIDDEN, LATENT), ODD], ids=str)
def test_model_is_the_kernel_bit_for_bit(gen, n, k, m):
    """`kernel_sums` is what the kernel computes (fp32 output), so the CPU tests of the variants'
    math test the kernel's."""
    x, w = make_inputs(gen, m, n, k)
    t = kernel.config(n, k, dsl.bucket(m)).threads
    assert torch.equal(kernel.gemv_cuda(x, w, out_dtype=torch.float32), kernel_sums(x, w, t))


@on_gpu
def test_variants_fall_back_on_refused_inputs(gen, caplog):
    u, g, w, r = norm_inputs(gen, 2, 256, 1032)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        y = kernel.gemv_norm_cuda(u, g.float(), w, EPS, r)  # an fp32 norm weight
        a = kernel.gemv_situ_cuda(u.float(), w, BETA, LINEAR_BETA)  # fp32 activations
        logits, z = kernel.gemv_split_cuda(u, w, 256)  # nothing past the split
    assert "gemv_norm" in caplog.text and "gemv_situ" in caplog.text
    assert "gemv_split" in caplog.text
    assert torch.equal(y, kernel.gemm_ref(rms_norm_ref(u, g.float(), EPS), w, r, torch.bfloat16))
    gate, up = kernel.gemm_ref(u.float(), w).split(128, dim=-1)
    assert torch.equal(a, situ_ref(gate, up, BETA, LINEAR_BETA))
    assert torch.equal(logits, kernel.gemm_ref(u, w, out_dtype=torch.float32))
    assert z.shape == (2, 0)


# ---- the gate variant (mla_uv_gate: per-head W_UV + sigmoid output gate), opt-in ----------------

MLA_HEADS, MLA_V, MLA_NOPE, MLA_C = 6, 128, 128, 512  # one TP16 rank


def uv_inputs(gen, m, heads=MLA_HEADS, v=MLA_V, c=MLA_C, device="cuda"):
    """o_lat [m, 1, H, C], W_UV as the model has it (a view of kv_b's weight [H, N + V, C]) and
    the gate g [m, 1, H·V]."""
    kv_b = (torch.randn(heads * (MLA_NOPE + v), c, generator=gen, device=device)
            * c**-0.5).bfloat16()
    w_uv = kv_b.view(heads, MLA_NOPE + v, c)[:, MLA_NOPE:]
    o_lat = torch.randn(m, 1, heads, c, generator=gen, device=device).bfloat16()
    g = (2 * torch.randn(m, 1, heads * v, generator=gen, device=device)).bfloat16()
    return o_lat, w_uv, g


def test_gate_refusals_and_configs():
    def t(*shape, dtype=torch.bfloat16, stride=None):
        if stride:
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return torch.empty(*shape, dtype=dtype, device="meta")

    h, v, k = MLA_HEADS, MLA_V, MLA_C
    n = h * v
    x, g = t(1, h * k), t(1, n)
    w = t(h, v, k, stride=((MLA_NOPE + v) * k, k, 1))  # W_UV inside kv_b's weight
    assert kernel.gate_refusal(x, w, g) is None
    assert kernel.gate_refusal(x, t(h, v, k), g) is None
    assert "slices" in kernel.gate_refusal(t(1, k), w, g)
    assert "3-d" in kernel.gate_refusal(x, t(n, k), g)
    assert "gate" in kernel.gate_refusal(x, w, t(1, n, dtype=torch.float32))
    assert "gate" in kernel.gate_refusal(x, w, t(2, n))
    assert "dtype" in kernel.gate_refusal(t(1, h * k, dtype=torch.float32), w, g)
    # both strides keep rows 16-byte aligned, K contiguous
    assert "head stride" in kernel.gate_refusal(x, t(h, v, k, stride=(v * k + 4, k, 1)), g)
    assert "strides" in kernel.gate_refusal(x, t(h, v, k, stride=(v * (k + 4), k + 4, 1)), g)
    assert "strides" in kernel.gate_refusal(x, t(h, v, k, stride=(v * k * 2, k * 2, 2)), g)
    for b in kernel.BUCKETS:  # a CTA's rows never straddle two x slices
        assert MLA_V % kernel.config(n, k, b, kernel.Fusion(gate=MLA_V)).rows_per_cta == 0
        assert 48 % kernel.config(480, k, b, kernel.Fusion(gate=48)).rows_per_cta == 0


def test_gate_on_by_default_and_the_cpu_path_is_the_reference(cpu_gen, monkeypatch):
    from k3compile.kernels import mla_uv_gate

    from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

    if "K3_GEMV_FUSED" not in os.environ:
        assert kernel.fused_enabled("gate"), "on since its GPU tests passed (session 6)"
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset({"gate"}))
    o_lat, w_uv, g = uv_inputs(cpu_gen, 1, heads=2, v=16, c=32, device="cpu")
    want = mla_uv_gate_ref(o_lat, w_uv, g)
    assert torch.equal(mla_uv_gate.mla_uv_gate_cuda(o_lat, w_uv, g), want)  # CPU: the reference
    got = kernel.gemv_gate_cuda(o_lat.reshape(1, -1), w_uv, g.reshape(1, -1))  # refused: torch
    assert torch.equal(got, want.reshape(1, -1))


def test_uv_heads_in_place_or_a_fresh_copy(cpu_gen, caplog, monkeypatch):
    """W_UV reaches the kernel as kv_b's view (no copy); only strides the kernel cannot read
    make a copy, at every call (a write through .data is seen), the reason logged once."""
    from k3compile.kernels import mla_uv_gate

    monkeypatch.setattr(mla_uv_gate, "_COPIED", set())
    o_lat, w_uv, g = uv_inputs(cpu_gen, 1, device="cpu")
    x, gate = o_lat.reshape(1, -1), g.reshape(1, -1)
    assert mla_uv_gate.uv_heads(x, w_uv, gate) is w_uv, "kv_b's view, read in place"
    base = torch.randn(MLA_HEADS, MLA_V, MLA_C + 4).bfloat16()
    odd = base[..., :MLA_C]  # rows 8 bytes past 16-byte alignment
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        copy = mla_uv_gate.uv_heads(x, odd, gate)
        base.data.mul_(2)  # a write through .data bumps no version: nothing may be cached
        again = mla_uv_gate.uv_heads(x, odd, gate)
    assert copy.is_contiguous() and torch.equal(again, odd) and not torch.equal(copy, again)
    assert caplog.text.count("W_UV copied on every call") == 1, caplog.text
    assert kernel.gate_refusal(x, again, gate) is None
    refused = g.reshape(1, -1).float()  # refused whatever W_UV's layout: handed on as it is
    assert mla_uv_gate.uv_heads(x, odd, refused) is odd


@on_gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gate_variant(gen, m):
    """W_UV per head + sigmoid gate in one launch against mla_uv_gate_ref (the same roundings:
    within one bf16 rounding), through the op with the variant switched on."""
    from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

    o_lat, w_uv, g = uv_inputs(gen, m)
    n = MLA_HEADS * MLA_V
    out = poisoned(m, n)
    x = o_lat.reshape(m, -1)
    assert kernel.gemv_gate_cuda(x, w_uv, g.reshape(m, n), out=out) is out, "fell back"
    assert_written(out)
    want = mla_uv_gate_ref(o_lat, w_uv, g).reshape(m, n)
    close_bf16(out, want)
    # the sums are the plain kernel's, then the reference's two roundings
    cfg = kernel.config(n, MLA_C, dsl.bucket(m), kernel.Fusion(gate=MLA_V))
    o = kernel.gemv_cuda(x.view(m, MLA_HEADS, MLA_C)[:, 0].contiguous(), w_uv[0], cfg=cfg)
    torch.testing.assert_close(out[:, :MLA_V], o * torch.sigmoid(g.reshape(m, n)[:, :MLA_V]),
                               rtol=0, atol=0)


@on_gpu
@pytest.mark.parametrize("m", [1, 2, 8])
def test_gate_reads_w_uv_in_place(gen, m):
    """W_UV read through kv_b's head stride gives the concatenated heads' output bit for bit
    (the same sums in the same order: only addresses differ), at one TP16 rank's shapes."""
    from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

    o_lat, w_uv, g = uv_inputs(gen, m)
    n = MLA_HEADS * MLA_V
    assert w_uv.stride() == ((MLA_NOPE + MLA_V) * MLA_C, MLA_C, 1)
    x, gate = o_lat.reshape(m, -1), g.reshape(m, n)
    viewed = kernel.gemv_gate_cuda(x, w_uv, gate, out=poisoned(m, n))
    copied = kernel.gemv_gate_cuda(x, w_uv.contiguous(), gate, out=poisoned(m, n))
    assert_written(viewed, copied)
    assert torch.equal(viewed, copied)
    close_bf16(viewed, mla_uv_gate_ref(o_lat, w_uv, g).reshape(m, n))


@on_gpu
def test_gate_through_the_op(gen, monkeypatch):
    from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

    o_lat, w_uv, g = uv_inputs(gen, 1)
    calls, real = [], kernel.gemv_gate_cuda
    monkeypatch.setattr(kernel, "gemv_gate_cuda",
                        lambda x, w, *a, **kw: calls.append(w) or real(x, w, *a, **kw))
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset({"gate"}))
    got = torch.ops.k3.mla_uv_gate(o_lat, w_uv, g)
    assert len(calls) == 1, "the one-launch variant at one row"
    assert calls[0].data_ptr() == w_uv.data_ptr() and calls[0].stride() == w_uv.stride()
    close_bf16(got, mla_uv_gate_ref(o_lat, w_uv, g))


@on_gpu
def test_gate_op_is_one_kernel(gen, monkeypatch):
    """k3::mla_uv_gate at one row launches the gate variant and nothing else (no copy of
    W_UV's heads: issue 21)."""
    o_lat, w_uv, g = uv_inputs(gen, 1)
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset({"gate"}))
    torch.ops.k3.mla_uv_gate(o_lat, w_uv, g)  # compiled, and any first-call work done
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        torch.ops.k3.mla_uv_gate(o_lat, w_uv, g)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels


# ---- configs off the heuristic (what the tuned table may pick) -----------------------------------

# R > 1 at one row, T = 512 and persistent grids (C CTAs per SM looping over the row blocks: at
# N = 3206, R = 2 and C = 1 a CTA takes 12 or 13 blocks, so each half of the loop's two-block
# pipeline is some CTA's last); N = 1003 is a multiple of no R (a partial last block) and
# K = 1032 a predicated vector tail, where T = 256 leaves most threads without a vector
TUNED = [kernel.Config(2, 256), kernel.Config(4, 512), kernel.Config(8, 128),
         kernel.Config(1, 256, 2), kernel.Config(2, 256, 1), kernel.Config(1, 128, 4),
         kernel.Config(2, 512, 1)]
ODD_N = (1003, 1032)


def _cfg_id(cfg):
    return f"R{cfg.rows_per_cta}T{cfg.threads}C{cfg.ctas_per_sm}"


@on_gpu
@pytest.mark.parametrize("cfg", TUNED, ids=_cfg_id)
@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("n,k", [(896, 7168), (2112, 7168), (3206, 7168), ODD_N], ids=str)
def test_tuned_configs(gen, n, k, m, cfg):
    """Against the reference (bf16 output, poisoned), and the fp32 sums bit for bit the model's
    at the config's T: rows per block and the persistent grid leave the order as it was."""
    if not kernel.fits(cfg, k, dsl.bucket(m)):
        pytest.skip(f"{cfg} does not fit K {k} at {m} rows")
    x, w = make_inputs(gen, m, n, k)
    check(x, w, cfg=cfg)
    got = kernel.gemv_cuda(x, w, out_dtype=torch.float32, cfg=cfg)
    assert torch.equal(got, kernel_sums(x, w, cfg.threads))


# (variant, weight rows, K) and a config of each kind that fits it: SiTU pairs rows (R even),
# the gate's R divides V = 128
TUNED_VARIANTS = [
    ("norm", HIDDEN, LATENT, kernel.Config(2, 256, 1)), ("norm", *ODD, kernel.Config(1, 512)),
    ("situ", 2 * SHARED, HIDDEN, kernel.Config(2, 256, 1)),
    ("situ", 2 * DENSE, HIDDEN, kernel.Config(4, 512)),
    ("split", EXPERTS + LATENT, HIDDEN, kernel.Config(1, 256, 2)),
    ("split", *ODD, kernel.Config(4, 128, 1)),
    ("gate", MLA_HEADS * MLA_V, MLA_C, kernel.Config(2, 128, 1)),
]


@on_gpu
@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("variant,n,k,cfg", TUNED_VARIANTS,
                         ids=lambda v: _cfg_id(v) if isinstance(v, kernel.Config) else str(v))
def test_variants_take_tuned_configs(gen, monkeypatch, variant, n, k, cfg, m):
    """Each one-launch variant through its wrapper with a tuned-table entry for its weight
    shape (`config` takes it where it fits): against its op's reference, and its sums bit for bit
    the model's at the config's T."""
    b = dsl.bucket(m)
    monkeypatch.setattr(kernel, "tuned", lambda: {(n, k, b): cfg})
    fusion = {"norm": kernel.NORM, "situ": kernel.SITU, "split": kernel.Fusion(split=n // 4),
              "gate": kernel.Fusion(gate=MLA_V)}[variant]
    if not kernel.fits(cfg, k, b, fusion):
        pytest.skip(f"{cfg} does not fit the {variant} variant at {m} rows")
    assert kernel.config(n, k, b, fusion) == cfg
    t = cfg.threads
    if variant == "norm":
        u, g, w, r = norm_inputs(gen, m, n, k)
        out = kernel.gemv_norm_cuda(u, g, w, EPS, r, out=poisoned(m, n))
        assert_written(out)
        close_bf16(out, norm_linear_ref(u, g, w, EPS, r))
        close_bf16(out, kernel_sums(norm_model(u, g, EPS, b, t)[0], w, t) + r.float())
    elif variant == "situ":
        from k3compile.kernels import situ_gate_up

        x, wg, wu = gate_up_inputs(gen, m, n // 2, k)
        out = kernel.gemv_situ_cuda(x, torch.cat([wg, wu]), BETA, LINEAR_BETA,
                                    out=poisoned(m, n // 2))
        assert_written(out)
        close_bf16(out, situ_gate_up_ref(x, wg, wu, BETA, LINEAR_BETA))
        gate_up = kernel.gemv_cuda(x, torch.cat([wg, wu]), out=poisoned(m, n), cfg=cfg)
        assert torch.equal(gate_up, kernel_sums(x, torch.cat([wg, wu]), t).bfloat16())
        assert torch.equal(out, situ_gate_up.situ_cuda(gate_up, BETA, LINEAR_BETA,
                                                       out=poisoned(m, n // 2)))
    elif variant == "split":
        x, w = make_inputs(gen, m, n, k)
        split = fusion.split
        out, out2 = poisoned(m, split, dtype=torch.float32), poisoned(m, n - split)
        kernel.gemv_split_cuda(x, w, split, out=out, out2=out2)
        assert_written(out, out2)
        sums = kernel_sums(x, w, t)
        assert torch.equal(out, sums[:, :split]) and torch.equal(out2, sums[:, split:].bfloat16())
    else:
        from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

        o_lat, w_uv, g = uv_inputs(gen, m)
        out = kernel.gemv_gate_cuda(o_lat.reshape(m, -1), w_uv, g.reshape(m, n),
                                    out=poisoned(m, n))
        assert_written(out)
        close_bf16(out, mla_uv_gate_ref(o_lat, w_uv, g).reshape(m, n))
