"""mla_q_absorb: Gated MLA's q_b GEMM, the q_nope | q_pe split and the W_UK absorption as one op."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import mla_q_absorb

from .pattern_checks import (
    assert_near_miss,
    assert_rewritten_equal,
    rewrite,
    with_kernel_limits,
)

H, N, R, V, Q, C = 4, 32, 16, 32, 48, 64


def absorb(cq, w_qb, w_kvb):
    """GatedMLA.forward: q_b_proj, split, W_UK cut from kv_b_proj.weight, einsum."""
    B, T, _ = cq.shape
    q = F.linear(cq, w_qb).view(B, T, H, N + R)
    q_nope, q_pe = q.split([N, R], dim=-1)
    w_uk, _ = w_kvb.view(H, N + V, C).split([N, V], dim=1)
    return torch.einsum("bthd,hdc->bthc", q_nope, w_uk), q_pe


def _args(batch, tokens, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(batch * 10 + tokens)
    return [torch.randn(batch, tokens, Q, generator=gen).to(dtype),
            (torch.randn(H * (N + R), Q, generator=gen) * Q**-0.5).to(dtype),
            (torch.randn(H * (N + V), C, generator=gen) * C**-0.5).to(dtype)]


@pytest.mark.parametrize("batch,tokens,dtype", [(1, 1, torch.bfloat16), (1, 8, torch.bfloat16),
                                                (3, 1, torch.bfloat16), (3, 8, torch.bfloat16),
                                                (3, 8, torch.float32)])
def test_rewrites(batch, tokens, dtype):
    args = _args(batch, tokens, dtype)
    gm, report = rewrite(absorb, args, mla_q_absorb.patterns(), joint=True)
    assert_rewritten_equal(gm, report, absorb, args, "k3.mla_q_absorb")


def test_two_variants_cover_every_batch_tokens_and_dtype():
    shipped = mla_q_absorb.patterns()
    for (b, t), dtype in itertools.product([(1, 1), (1, 3), (2, 1), (2, 3)],
                                           [torch.bfloat16, torch.float32]):
        probe = mla_q_absorb._variant(b, t, dtype)
        assert any(p.expr.pattern_eq(probe.expr) for p in shipped), (b, t, dtype)


def test_escaping_q_nope_is_a_near_miss():
    def leaky(cq, w_qb, w_kvb):
        B, T, _ = cq.shape
        q_nope, q_pe = F.linear(cq, w_qb).view(B, T, H, N + R).split([N, R], dim=-1)
        w_uk, _ = w_kvb.view(H, N + V, C).split([N, V], dim=1)
        return torch.einsum("bthd,hdc->bthc", q_nope, w_uk), q_pe, q_nope * 2

    _, report = rewrite(leaky, _args(3, 8), mla_q_absorb.patterns(), joint=True)
    assert_near_miss(report, "mla_q_absorb", "users")


def test_check_refuses_float64():
    _, report = rewrite(absorb, _args(3, 8, torch.float64), mla_q_absorb.patterns(), joint=True)
    assert_near_miss(report, "mla_q_absorb", "check refused", "float64")


@pytest.mark.parametrize("batch,tokens,dtype,words", [(3, 8, torch.bfloat16, None),
                                                      (9, 8, torch.bfloat16, "72 rows"),
                                                      (1, 1, torch.float32, "dtypes")])
def test_gpu_graphs_fuse_only_what_the_kernel_takes(monkeypatch, batch, tokens, dtype, words):
    """Where only sites with a CUDA kernel fuse (GPU graphs, the kernel opted in): at most 64
    bf16 rows; otherwise Inductor keeps the site, with the kernel's reason."""
    with_kernel_limits(monkeypatch, "mla_q_absorb")
    args = _args(batch, tokens, dtype)
    gm, report = rewrite(absorb, args, mla_q_absorb.patterns(), joint=True, kernels_only=True)
    if words is None:
        assert_rewritten_equal(gm, report, absorb, args, "k3.mla_q_absorb")
    else:
        assert not report.hits
        assert words in report.deferred["mla_q_absorb"], report.deferred
        for got, want in zip(gm(*args), absorb(*args)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gpu_graphs_without_the_kernel_fuse_as_before(monkeypatch):
    """The kernel not opted in: GPU graphs fuse every site as before (the op runs its reference;
    mla_decode's pattern reads its outputs), even one the kernel would refuse."""
    from k3compile.ops import registry

    monkeypatch.setattr(registry, "_entries", {k: v for k, v in registry._entries.items()
                                               if k != "mla_q_absorb"})
    args = _args(9, 8)  # 72 rows: more than the kernel takes
    gm, report = rewrite(absorb, args, mla_q_absorb.patterns(), joint=True, kernels_only=True)
    assert_rewritten_equal(gm, report, absorb, args, "k3.mla_q_absorb")
