"""gemv kernel (y = x · Wᵀ [+ r], M <= 16) at one K3 TP16 rank's weight shapes for every batch
bucket, rows between buckets, an odd aligned shape, the fp32 router output, the residual
epilogue, strided operands, and the torch fallback of refused inputs."""

import logging

import pytest
import torch
from k3compile.kernels import gemv as kernel
from kernel_checks import TOL, assert_written, poisoned, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

# [N, K] of one TP16 rank: KDA in-proj, MLA q_a|kv_a, latent down, latent up, router, gates /
# shared gate_up, o_proj, MLA q_b, shared down, KDA f_b
SHAPES = [(3206, 7168), (2112, 7168), (3584, 7168), (7168, 3584), (896, 7168), (7168, 768),
          (768, 7168), (1152, 1536), (7168, 384), (768, 128)]
ODD = (1000, 1032)  # N not a multiple of any R; K/8 = 129 vectors: a predicated tail
ROUTER = (896, 7168)
# fp32 sums of up to 7168 products of size ~1/sqrt(K): ~sqrt(K)·2^-24 absolute from fp64
FP32_SUMS = {"rtol": 1e-4, "atol": 1e-4}


def make_inputs(gen, m, n, k):
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
    return x, w


def model(x, w, residual=None, out_dtype=torch.bfloat16):
    y = x.double() @ w.double().t()
    if residual is not None:
        y = y + residual.double()
    return y.to(out_dtype)


def check(x, w, residual=None, out_dtype=torch.bfloat16):
    out = poisoned(x.shape[0], w.shape[0], dtype=out_dtype)
    y = kernel.gemv_cuda(x, w, residual, out=out)
    assert y is out, "the kernel did not run (fallback)"
    assert_written(out)
    ref = model(x, w, residual, out_dtype)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, ref, **FP32_SUMS)
    else:
        torch.testing.assert_close(out.float(), ref.float(), **TOL["bf16"])
        assert rel_err(out, ref) < TOL["bf16_rel_norm"]
    return out


@pytest.mark.parametrize("m", kernel.BUCKETS)
@pytest.mark.parametrize("n,k", [*SHAPES, ODD], ids=lambda v: str(v))
def test_shapes(gen, n, k, m):
    check(*make_inputs(gen, m, n, k))


@pytest.mark.parametrize("m", [3, 5, 7, 12])
@pytest.mark.parametrize("n,k", [(3206, 7168), (7168, 768), ODD], ids=lambda v: str(v))
def test_rows_between_buckets(gen, n, k, m):
    check(*make_inputs(gen, m, n, k))


@pytest.mark.parametrize("m", kernel.BUCKETS)
def test_router_fp32_logits(gen, m):
    check(*make_inputs(gen, m, *ROUTER), out_dtype=torch.float32)


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(7168, 768), (7168, 384), ODD], ids=lambda v: str(v))
def test_residual(gen, n, k, m):
    x, w = make_inputs(gen, m, n, k)
    r = (4 * torch.randn(m, n, generator=gen, device="cuda")).bfloat16()
    check(x, w, r)
    check(x, w, r, out_dtype=torch.float32)


def test_strided_operands_and_determinism(gen):
    x, w = make_inputs(gen, 8, 2112 + 16, 7168 + 64)
    x, w = x[:, 64:], w[16:, 64:]  # row strides K + 64, 16-byte aligned row starts
    r = torch.randn(8, 2 * 2112, generator=gen, device="cuda").bfloat16()[:, ::2]
    assert kernel.refusal(x, w, r) is not None  # residual with strided columns: refused
    r = r.contiguous()
    first = check(x, w, r)
    assert torch.equal(first, check(x, w, r)), "not deterministic"


def test_empty_batch(gen):
    x, w = make_inputs(gen, 0, 768, 128)
    assert kernel.gemv_cuda(x, w).shape == (0, 768)


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
    assert torch.equal(y, kernel.gemv_ref(x, w))
    assert torch.equal(y_res, kernel.gemv_ref(x, w, r))
    tol = TOL["bf16"] if y.dtype == torch.bfloat16 else FP32_SUMS
    torch.testing.assert_close(y.float(), model(x, w, None, y.dtype).float(), **tol)
    torch.testing.assert_close(y_res.float(), model(x, w, r, y.dtype).float(), **tol)
