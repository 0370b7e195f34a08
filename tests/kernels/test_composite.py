"""The kernel composites (cuBLAS GEMM + one CuTe kernel) against their ops' torch references, at
the TP16-rank shapes, through the ops' CUDA dispatch: o_proj + post-attention mix + norm, and the
routed-latent norm + up-projection (+ the shared experts' residual)."""

import pytest
import torch
from kernel_checks import BUCKETS, TOL, rel_err

from k3compile.ops.attn_res import attn_res_mix_norm_ref
from k3compile.ops.gemm import norm_linear_ref
from k3compile.ops.moe import moe_front_ref

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

HIDDEN, O_IN, LATENT, EXPERTS, EPS = 7168, 768, 3584, 896, 1e-5


def _bf16(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


def _oproj_ref(o, w, prefix, blocks, wn, wp, wnorm):
    a = torch.nn.functional.linear(o, w)
    if prefix is None:
        return attn_res_mix_norm_ref(a, None, blocks, wn, wp, wnorm, EPS, EPS)
    return attn_res_mix_norm_ref(prefix, a, blocks, wn, wp, wnorm, EPS, EPS)


@pytest.mark.parametrize("n", BUCKETS)
@pytest.mark.parametrize("n_blocks,with_prefix", [(8, True), (3, False), (0, True)])
def test_oproj_attn_res_mix_norm(gen, n, n_blocks, with_prefix):
    o = _bf16(gen, n, O_IN)
    w = _bf16(gen, HIDDEN, O_IN, scale=O_IN ** -0.5)
    prefix = _bf16(gen, n, HIDDEN) if with_prefix else None
    blocks = [_bf16(gen, n, HIDDEN) for _ in range(n_blocks)]
    wn, wp = _bf16(gen, HIDDEN), _bf16(gen, 1, HIDDEN, scale=HIDDEN ** -0.5)
    wnorm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")).bfloat16()
    got = torch.ops.k3.oproj_attn_res_mix_norm(o, w, prefix, blocks, wn, wp, wnorm, EPS, EPS)
    want = _oproj_ref(o, w, prefix, blocks, wn, wp, wnorm)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel_err(g, r) < TOL["vs_reference_rel_norm"]


@pytest.mark.parametrize("n", BUCKETS)
@pytest.mark.parametrize("residual", [False, True])
def test_norm_linear(gen, n, residual):
    u = _bf16(gen, n, LATENT, scale=3.0)
    wnorm = (1 + 0.1 * torch.randn(LATENT, generator=gen, device="cuda")).bfloat16()
    w = _bf16(gen, HIDDEN, LATENT, scale=LATENT ** -0.5)
    r = _bf16(gen, n, HIDDEN) if residual else None
    got = torch.ops.k3.norm_linear(u, wnorm, w, EPS, r)
    want = norm_linear_ref(u, wnorm, w, EPS, r)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL["bf16"])
    assert rel_err(got, want) < TOL["bf16_rel_norm"]


def test_three_dim_rows(gen):
    """[B, T, D] activations (verify rows) go through flat_rows and come back [B, T, O]."""
    u = _bf16(gen, 2, 8, LATENT)
    wnorm = torch.ones(LATENT, device="cuda", dtype=torch.bfloat16)
    w = _bf16(gen, HIDDEN, LATENT, scale=LATENT ** -0.5)
    got = torch.ops.k3.norm_linear(u, wnorm, w, EPS, None)
    assert got.shape == (2, 8, HIDDEN)
    assert rel_err(got, norm_linear_ref(u, wnorm, w, EPS)) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("n", BUCKETS)
def test_moe_front_router_in_fp32_from_bf16_weights(gen, n):
    """Router logits from a bf16 GEMM with fp32 output equal the reference's fp32 GEMM of the
    upcast weight up to summation order; the latent down-projection is the plain GEMM."""
    x = _bf16(gen, n, HIDDEN)
    router_w = _bf16(gen, EXPERTS, HIDDEN, scale=HIDDEN ** -0.5)
    down_w = _bf16(gen, LATENT, HIDDEN, scale=HIDDEN ** -0.5)
    logits, z = torch.ops.k3.moe_front(x, router_w, down_w)
    want_logits, want_z = moe_front_ref(x, router_w, down_w)
    assert logits.dtype == torch.float32 and z.dtype == torch.bfloat16
    assert rel_err(logits, want_logits) < 1e-5  # exact products, fp32 sums in another order
    torch.testing.assert_close(z, want_z, **TOL["bf16"])  # our skinny GEMM at one row
    assert rel_err(z, want_z) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("n", BUCKETS)
def test_linear_concat(gen, n):
    """KDA's fused in-projection (q|k|v|g|f_a|b, 3206 rows at TP16) over the cached
    concatenation: our skinny GEMM at one row, cuBLAS above, against the reference GEMM."""
    x = _bf16(gen, n, HIDDEN)
    weights = [_bf16(gen, rows, HIDDEN, scale=HIDDEN ** -0.5) for rows in (768, 768, 768, 768, 64, 70)]
    got = torch.ops.k3.linear_concat(x, weights)
    want = torch.nn.functional.linear(x.float(), torch.cat(weights).float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, **TOL["bf16"])
    assert rel_err(got, want) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("n", BUCKETS)
def test_linear(gen, n):
    """`k3.linear` (the plain GEMMs the patterns leave: shared-expert down, lm_head, ...) through
    `gemv.linear`, against the fp32 reference GEMM, [N, K] and [B, T, K] rows."""
    x = _bf16(gen, n, LATENT)
    w = _bf16(gen, HIDDEN, LATENT, scale=LATENT ** -0.5)
    got = torch.ops.k3.linear(x, w)
    want = torch.nn.functional.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, **TOL["bf16"])
    rows = torch.ops.k3.linear(x.view(n, 1, LATENT), w)
    assert rows.shape == (n, 1, HIDDEN) and torch.equal(rows.view(n, HIDDEN), got)
