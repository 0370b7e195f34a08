"""k3::mla_lowrank_norm kernel at K3's MLA shapes (q 1536, kv 512 + k_pe 64) for every batch
bucket, reading cq and ckv as column slices of the fused q_a|kv_a GEMM output."""

import logging

import pytest
import torch
from k3compile.kernels import mla_lowrank_norm as kernel

from k3compile.ops.rms_norm import rms_norm_ref
from tests.kernel_checks import BUCKETS, TOL, assert_written, poisoned, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

Q, C, R, EPS = 1536, 512, 64, 1e-6


def make_inputs(gen, n, q=Q, c=C, r=R, fused=True):
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    if fused:
        out = (randn(n, q + c + r) * 3).bfloat16()
        cq, ckv = out[:, :q], out[:, q:]
    else:
        cq, ckv = (randn(n, q) * 3).bfloat16(), (randn(n, c + r) * 3).bfloat16()
    return cq, ckv, (1 + randn(q, scale=0.2)).bfloat16(), (1 + randn(c, scale=0.2)).bfloat16()


def model(x, w, eps):
    xd = x.double()
    xn = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()
    return (xn.double() * w.double()).bfloat16()


def check(cq, ckv, wq, wkv):
    n, (q, c) = cq.shape[0], (cq.shape[1], wkv.shape[0])
    r = ckv.shape[1] - c
    out = (poisoned(n, q), poisoned(n, c), poisoned(n, r))
    got = kernel.mla_lowrank_norm_cuda(cq, ckv, wq, wkv, EPS, out=out)
    assert got[0] is out[0], "the kernel did not run (fallback)"
    assert_written(*out)
    for o, x, w in [(out[0], cq, wq), (out[1], ckv[:, :c], wkv)]:
        torch.testing.assert_close(o.float(), model(x, w, EPS).float(), **TOL["bf16"])
        assert rel_err(o, rms_norm_ref(x, w, EPS)) < TOL["bf16_rel_norm"]
    assert torch.equal(out[2], ckv[:, c:])


@pytest.mark.parametrize("n", BUCKETS)
def test_k3_mla_shapes(gen, n):
    check(*make_inputs(gen, n))


@pytest.mark.parametrize("q,c,r", [(256, 64, 16), (1536, 512, 0), (200, 72, 8)])
def test_small_and_odd_widths(gen, q, c, r):
    for n in (1, 8, 37):
        check(*make_inputs(gen, n, q, c, r, fused=False))


def test_op_dispatch(gen):
    cq, ckv, wq, wkv = make_inputs(gen, 8)
    q, kv, pe = torch.ops.k3.mla_lowrank_norm(cq, ckv, wq, wkv, EPS)
    torch.testing.assert_close(q.float(), model(cq, wq, EPS).float(), **TOL["bf16"])
    torch.testing.assert_close(kv.float(), model(ckv[:, :C], wkv, EPS).float(), **TOL["bf16"])
    assert torch.equal(pe, ckv[:, C:])


def test_refused_inputs_fall_back_to_the_reference(gen, caplog):
    cq, ckv, wq, wkv = make_inputs(gen, 4, q=100, fused=False)  # q width not a multiple of 8
    assert not kernel.can_implement(cq, ckv, wq, wkv)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        q, kv, pe = torch.ops.k3.mla_lowrank_norm(cq, ckv, wq, wkv, EPS)
    assert torch.equal(q, rms_norm_ref(cq, wq, EPS))
    assert torch.equal(kv, rms_norm_ref(ckv[:, :C], wkv, EPS)) and torch.equal(pe, ckv[:, C:])
    assert "mla_lowrank_norm" in caplog.text


def model_fp32_weight(x, w, eps):  # weight_fp32: x·rstd·w rounded once
    xd = x.double()
    return (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()).bfloat16()


@pytest.mark.parametrize("n", [1, 8, 64])
@pytest.mark.parametrize("q,c,r", [(Q, C, R), (200, 72, 8)])
def test_weight_fp32(gen, n, q, c, r):
    """Both norms' weights multiplied in fp32 before the one rounding (spell9's norm; its own
    build): one rounding from the float64 model, nearer the op's reference variant than the
    default rounding; through the op's dispatch too."""
    from k3compile.ops.mla_lowrank_norm import mla_lowrank_norm_ref

    cq, ckv, wq, wkv = make_inputs(gen, n, q, c, r, fused=(q, c, r) == (Q, C, R))
    out = (poisoned(n, q), poisoned(n, c), poisoned(n, r))
    got = kernel.mla_lowrank_norm_cuda(cq, ckv, wq, wkv, EPS, True, out=out)
    assert got[0] is out[0], "the kernel did not run (fallback)"
    assert_written(*out)
    want = mla_lowrank_norm_ref(cq, ckv, wq, wkv, EPS, True)
    plain = mla_lowrank_norm_ref(cq, ckv, wq, wkv, EPS)
    for o, x, w, ref, k3 in [(out[0], cq, wq, want[0], plain[0]),
                             (out[1], ckv[:, :c], wkv, want[1], plain[1])]:
        torch.testing.assert_close(o.float(), model_fp32_weight(x, w, EPS).float(),
                                   **TOL["bf16"])
        off_flagged, off_plain = (o != ref).float().mean(), (o != k3).float().mean()
        assert off_flagged < 0.5 * off_plain, (off_flagged, off_plain)
    assert torch.equal(out[2], ckv[:, c:])
    q2, kv2, pe2 = torch.ops.k3.mla_lowrank_norm(cq, ckv, wq, wkv, EPS, True)
    assert torch.equal(q2, out[0]) and torch.equal(kv2, out[1]) and torch.equal(pe2, out[2])
