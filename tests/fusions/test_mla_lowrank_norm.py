"""mla_lowrank_norm: Gated MLA's q_a and kv_a RMSNorms (and the c_kv | k_pe split) as one op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import mla_lowrank_norm

from .pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite

D, Q, C, R, V = 64, 48, 32, 16, 32


def rms(x, w, eps):  # K3's RMSNorm
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def mla_front(x, w_qa, w_kva, w_g, w_qn, w_kvn):
    """GatedMLA.forward up to the norms (g_proj reads the same x)."""
    return _front(x, w_qa, w_kva, w_g, w_qn, w_kvn, 1e-6, 1e-6, False)


def _front(x, w_qa, w_kva, w_g, w_qn, w_kvn, q_eps, kv_eps, leak):
    cq = rms(F.linear(x, w_qa), w_qn, q_eps)
    ckv = F.linear(x, w_kva)
    c_kv, k_pe = ckv.split([C, R], dim=-1)
    out = (cq, rms(c_kv, w_kvn, kv_eps), k_pe, F.linear(x, w_g))
    return (*out, c_kv * 2) if leak else out


def _args(dtype=torch.bfloat16, tokens=1):
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, tokens, D) if tokens else (3, D), (Q, D), (C + R, D), (V, D)]
    ws = [torch.randn(s, generator=gen) * s[-1] ** -0.5 for s in shapes]
    norms = [1 + 0.1 * torch.randn(n, generator=gen) for n in (Q, C)]
    return [t.to(dtype) for t in (*ws, *norms)]


@pytest.mark.parametrize("dtype,tokens", [(torch.bfloat16, 1), (torch.bfloat16, 8),
                                          (torch.float32, 1)])
def test_rewrites(dtype, tokens):
    args = _args(dtype, tokens)
    gm, report = rewrite(mla_front, args, mla_lowrank_norm.patterns(), joint=True)
    assert_rewritten_equal(gm, report, mla_front, args, "k3.mla_lowrank_norm")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.mla_lowrank_norm.default")
    assert op.args[-1] == 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_rewrite(dtype):
    """[N, D] rows (vLLM's flattened tokens, tests/models/redteam_k3.py): plain mm GEMMs."""
    args = _args(dtype, tokens=None)
    gm, report = rewrite(mla_front, args, mla_lowrank_norm.patterns(), joint=True)
    assert [h.pattern for h in report.hits] == [
        f"mla_lowrank_norm[{str(dtype).removeprefix('torch.')},rows]"]
    assert_rewritten_equal(gm, report, mla_front, args, "k3.mla_lowrank_norm")


def _viewed_front(lead):
    """x.unsqueeze(1) before the linears, as rule `gemm` leaves it: [N, D] GEMMs viewed after."""
    def fn(x, w_qa, w_kva, w_g, w_qn, w_kvn):
        cq = rms(F.linear(x, w_qa).view(*lead, Q), w_qn, 1e-6)
        c_kv, k_pe = F.linear(x, w_kva).view(*lead, C + R).split([C, R], dim=-1)
        return cq, rms(c_kv, w_kvn, 1e-6), k_pe, F.linear(x, w_g).view(*lead, V)
    return fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_viewed_to_one_token_rewrite(dtype):
    args, fn = _args(dtype, tokens=None), _viewed_front((3, 1))
    gm, report = rewrite(fn, args, mla_lowrank_norm.patterns(), joint=True)
    assert [h.pattern for h in report.hits] == [
        f"mla_lowrank_norm[{str(dtype).removeprefix('torch.')},rows_viewed]"]
    assert_rewritten_equal(gm, report, fn, args, "k3.mla_lowrank_norm")


def test_rows_viewed_to_other_shapes_are_refused():
    _, report = rewrite(_viewed_front((1, 3)), _args(tokens=None), mla_lowrank_norm.patterns(),
                        joint=True)
    assert_near_miss(report, "mla_lowrank_norm", "check refused", "is not a [3, 1, .] view")


def test_check_takes_eps_rounded_to_float32():
    """F.rms_norm(x, eps=1e-5) hands the fused ops 9.99999975e-06 (float32), a spelled-out
    norm 1e-05: the same eps as the op computes with."""
    eps32 = torch.tensor(1e-5, dtype=torch.float32).item()
    assert eps32 != 1e-5

    def mixed(x, w_qa, w_kva, w_g, w_qn, w_kvn):
        return _front(x, w_qa, w_kva, w_g, w_qn, w_kvn, 1e-5, eps32, False)

    args = _args()
    gm, report = rewrite(mixed, args, mla_lowrank_norm.patterns(), joint=True)
    assert_rewritten_equal(gm, report, mixed, args, "k3.mla_lowrank_norm")


def test_escaping_unnormalised_c_kv_is_a_near_miss():
    def leaky(x, w_qa, w_kva, w_g, w_qn, w_kvn):
        return _front(x, w_qa, w_kva, w_g, w_qn, w_kvn, 1e-6, 1e-6, True)

    _, report = rewrite(leaky, _args(), mla_lowrank_norm.patterns(), joint=True)
    assert_near_miss(report, "mla_lowrank_norm", "users")


def test_check_refuses_different_eps():
    def vllm_eps(x, w_qa, w_kva, w_g, w_qn, w_kvn):  # 1e-6 (Moonshot) vs 1e-5 (vLLM) mixed
        return _front(x, w_qa, w_kva, w_g, w_qn, w_kvn, 1e-6, 1e-5, False)

    _, report = rewrite(vllm_eps, _args(), mla_lowrank_norm.patterns(), joint=True)
    assert_near_miss(report, "mla_lowrank_norm", "check refused", "eps differ")
