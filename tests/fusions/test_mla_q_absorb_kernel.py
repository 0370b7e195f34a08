"""k3::mla_q_absorb's CUDA path (kernels/mla_q_absorb.py: the GEMM router's q_b GEMM, then the
CuTe absorption kernel) against `mla_q_absorb_ref`.

GPU (marked `gpu`): one K3 TP16 rank (6 heads, D 128, R 64, C 512, Q 1536) at N = B·T rows
1-64 ([N, 1] and [B, 8] leads), W_UK a view of kv_b's weight as in the model, with PDL on and
off; other sizes (the one-slice config, odd heads); inputs the kernel refuses (strided or
unaligned W_UK, fp32, 65 rows) run the reference, a strided cq is taken.
CPU: the kernel builds for sm_90a at the TP16 rank for N in {1, 8, 64}, with PDL where the
weight loads come before the wait; every bucket's config covers each product once; refusals;
the reference off the GPU; the opt-in switch.
"""

import itertools
import logging

import pytest
import torch
from k3compile.kernels import mla_q_absorb as kernel

from k3compile import kernels, settings
from k3compile.ops.mla_q_absorb import mla_q_absorb_ref
from tests.kernel_checks import TOL, assert_refused, no_fallback, on_gpu, rel_err

H, D, R, V, C, Q = 96 // 16, 128, 64, 128, 512, 1536  # k3_tp16: heads per rank, nope, rope, ...
ARCH = "sm_90a"


def make_inputs(gen, lead, heads=H, nope=D, rope=R, latent=C, q_dim=Q, device="cuda"):
    """cq [*lead, Q], W_qb [H·(D + R), Q] and W_UK [H, D, C] cut from kv_b [H·(D + V), C]."""
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).bfloat16()

    kv_b = randn(heads * (nope + V), latent, scale=latent ** -0.5)
    return (randn(*lead, q_dim), randn(heads * (nope + rope), q_dim, scale=q_dim ** -0.5),
            kv_b.view(heads, nope + V, latent)[:, :nope])


def model(q, w_uk):
    """q_lat and q_pe from the GEMM's rows q [N, H·(D + R)]: the absorption in float64, one
    rounding."""
    heads, nope, _ = w_uk.shape
    q = q.view(q.shape[0], heads, -1)
    lat = torch.einsum("nhd,hdc->nhc", q[..., :nope].double(), w_uk.double())
    return lat.bfloat16(), q[..., nope:]


def check(cq, w_qb, w_uk):
    from k3compile.kernels.common.router import linear

    with no_fallback():
        q_lat, q_pe = kernel.mla_q_absorb_cuda(cq, w_qb, w_uk)
    heads, nope, latent = w_uk.shape
    lead = cq.shape[:-1]
    assert q_lat.shape == (*lead, heads, latent) and q_lat.is_contiguous()
    assert q_pe.shape == (*lead, heads, w_qb.shape[0] // heads - nope) and q_pe.is_contiguous()
    want_lat, want_pe = model(linear(cq.reshape(-1, cq.shape[-1]), w_qb), w_uk)
    n = want_lat.shape[0]
    torch.testing.assert_close(q_lat.view(n, heads, latent).float(), want_lat.float(),
                               **TOL["bf16"])
    assert rel_err(q_lat.view(n, heads, latent), want_lat) < TOL["bf16_rel_norm"]
    assert torch.equal(q_pe.view(want_pe.shape), want_pe)
    ref_lat, ref_pe = mla_q_absorb_ref(cq, w_qb, w_uk)  # cuBLAS: its q may round differently
    assert rel_err(q_lat, ref_lat) < TOL["bf16_rel_norm"]
    assert rel_err(q_pe, ref_pe) < TOL["bf16_rel_norm"]


@on_gpu
@pytest.mark.parametrize("lead", [(1, 1), (2, 1), (3, 1), (8, 1), (37, 1), (64, 1), (1, 8),
                                  (8, 8)], ids=str)
@pytest.mark.parametrize("pdl", [True, False])
def test_tp16_rank(gen, lead, pdl, monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "pdl", pdl)
    monkeypatch.setattr(settings.KERNELS, "pdl_max_rows", 64)
    check(*make_inputs(gen, lead))


@on_gpu
@pytest.mark.parametrize("heads,nope,rope,latent,q_dim", [
    (2, 64, 32, 256, 256), (1, 24, 16, 96, 64), (3, 128, 64, 512, 1536), (16, 8, 8, 32, 40)])
def test_other_sizes(gen, heads, nope, rope, latent, q_dim):
    for n in (1, 5, 64):
        check(*make_inputs(gen, (n, 1), heads, nope, rope, latent, q_dim))


@on_gpu
def test_strided_cq_is_taken(gen):
    cq, w_qb, w_uk = make_inputs(gen, (4, 1), q_dim=2 * Q)
    check(cq[..., ::2], w_qb[:, ::2].contiguous(), w_uk)


@on_gpu
def test_refused_inputs_run_the_reference(gen, caplog):
    cq, w_qb, w_uk = make_inputs(gen, (4, 1))
    wide = torch.zeros(H, D, C + 4, dtype=torch.bfloat16, device="cuda")
    wide[..., :C] = w_uk
    strided_uk = wide[..., :C]  # row stride 516: rows not 16-byte aligned
    flat = torch.empty(w_uk.numel() + 4, dtype=torch.bfloat16, device="cuda")
    unaligned_uk = flat[4:].view(H, D, C)  # 8 bytes past 16
    unaligned_uk.copy_(w_uk)
    cases = [((cq, w_qb, strided_uk), "strides"), ((cq, w_qb, unaligned_uk), "aligned"),
             ((cq.float(), w_qb.float(), w_uk.float()), "dtypes"),
             ((torch.cat([cq] * 17)[:65], w_qb, w_uk), "65 rows")]
    for args, words in cases:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
            got = kernel.mla_q_absorb_cuda(*args)
        assert "mla_q_absorb" in caplog.text and words in caplog.text, caplog.text
        for g, r in zip(got, mla_q_absorb_ref(*args)):
            assert g.is_contiguous() and torch.equal(g, r)


# ---------------------------------------------------------------------------------------------
# CPU


def _build(monkeypatch, tmp_path, n, pdl, sizes=(H, D, R, C)):
    from k3compile.kernels.common.dsl import bucket, cubin_of, cubin_resources

    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)  # a machine without a GPU would target sm_100a
    b = bucket(n)
    compiled = kernel.build(*sizes, b, kernel.config(sizes[1], b), arch=ARCH,
                            dump_dir=str(tmp_path), pdl=pdl)
    resources = cubin_resources(cubin_of(compiled))
    assert resources["frame"] == 0 and 0 < resources["regs"] <= 128, resources
    return compiled


@pytest.mark.dsl
@pytest.mark.parametrize("n", [1, 8, 64])
def test_builds_for_sm90a_with_pdl(n, monkeypatch, tmp_path):
    """The TP16 rank's build: W_UK's tile loads (16-byte) come before the PDL wait, nothing is
    stored to global memory before it (the text order of the straight-line preamble)."""
    from k3compile.kernels.common.dsl import ptx_of

    ptx = ptx_of(_build(monkeypatch, tmp_path, n, True))
    wait = "griddepcontrol.wait;"
    assert "griddepcontrol.launch_dependents;" in ptx and wait in ptx
    before = ptx[:ptx.index(wait)]
    assert "ld.global.v4" in before, "W_UK does not load before the wait"
    assert not [op for op in ("st.global", "red.global", "atom.global") if op in before]


@pytest.mark.dsl
@pytest.mark.slow
@pytest.mark.parametrize("n,sizes", [(1, (H, D, R, C)), (8, (1, 24, 16, 96)),
                                     (64, (16, 8, 8, 32))])
def test_builds_without_pdl(n, sizes, monkeypatch, tmp_path):
    """Without PDL, and the one-slice config (D / 8 not a multiple of 2: no partials)."""
    from k3compile.kernels.common.dsl import ptx_of

    assert "griddepcontrol" not in ptx_of(_build(monkeypatch, tmp_path, n, False, sizes))


@pytest.mark.parametrize("nope", [D, 64, 24, 8])
def test_every_config_covers_each_product_once(nope):
    """Thread (v, g, r) of a CTA adds q[r + i·RG, d]·W[d, v·8 + e] for d in slice g: every
    (row, d, column) of the CTA's tile once, within the thread count and shared memory."""
    from k3compile.kernels.common.dsl import BUCKETS

    for b in BUCKETS:
        cfg = kernel.config(nope, b)
        cv, dg, rg = cfg.col_vectors, cfg.d_groups, cfg.row_groups
        s, rpt = nope // dg, b // rg
        assert b % rg == 0 and nope % (8 * dg) == 0 and cv * dg * rg <= 1024 and rpt <= 2
        assert cfg.smem_bytes(nope, b) <= kernel.SMEM_BYTES
        seen = torch.zeros(b, nope, 8 * cv, dtype=torch.int32)
        for t in range(cv * dg * rg):
            v, g, r0 = t % cv, (t // cv) % dg, t // (cv * dg)
            for i, d in itertools.product(range(rpt), range(g * s, (g + 1) * s)):
                seen[r0 + i * rg, d, 8 * v:8 * v + 8] += 1
        assert torch.equal(seen, torch.ones_like(seen)), (b, cfg)


def test_refusals():
    gen = torch.Generator().manual_seed(0)
    args = make_inputs(gen, (8, 1), device="cpu")
    assert kernel.refusal(*args) is None
    cq, w_qb, w_uk = args

    def refused(i, value, words):
        assert_refused(kernel.refusal, args, i, value, words)

    refused(0, cq.float(), "dtypes")
    refused(2, w_uk.half(), "dtypes")
    refused(0, torch.cat([cq] * 9), "72 rows")
    refused(2, torch.zeros(H, D, C + 4, dtype=torch.bfloat16)[..., :C], "strides")
    refused(2, torch.zeros(H, D, C - 8, dtype=torch.bfloat16), "sizes")  # C 504: not 32·k
    refused(1, w_qb[:-4], "sizes")  # R not a whole number of heads' rows
    big = make_inputs(gen, (64, 1), nope=512, device="cpu")
    why = kernel.refusal(*big)
    assert why and "shared memory" in why, why


def test_the_fusion_takes_at_most_taken_rows():
    """The kernel takes 64 rows; the fusion only up to TAKEN_ROWS (slower above on the H200)."""
    gen = torch.Generator().manual_seed(0)
    assert kernel.taken_refusal(*make_inputs(gen, (kernel.TAKEN_ROWS, 1), device="cpu")) is None
    more = make_inputs(gen, (2 * kernel.TAKEN_ROWS, 1), device="cpu")
    assert kernel.refusal(*more) is None
    assert f"{2 * kernel.TAKEN_ROWS} rows (taken at most" in kernel.taken_refusal(*more)


def test_off_gpu_runs_the_reference(caplog):
    args = make_inputs(torch.Generator().manual_seed(1), (2, 3), device="cpu")
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        got = kernel.mla_q_absorb_cuda(*args)
    assert "mla_q_absorb" in caplog.text
    for g, r in zip(got, mla_q_absorb_ref(*args)):
        assert g.is_contiguous() and torch.equal(g, r)


def test_opt_in(monkeypatch):
    """Off by default: registered only where K3_KERNELS_EXTRA names it (whatever this run's
    environment sets: the H200 run of 2026-12-04 set it for the GPU tests)."""
    monkeypatch.setattr(settings.KERNELS, "extra", ())
    assert "mla_q_absorb" not in kernels.selected_kernels()
    monkeypatch.setattr(settings.KERNELS, "extra", ("mla_q_absorb",))
    assert "mla_q_absorb" in kernels.selected_kernels()
