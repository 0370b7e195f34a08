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


# weight_fp32: both norms multiply their weight in fp32 before the one rounding to bf16
# (tests/models/spell9_k3.py's `rms_norm`, a JAX/Flax port), in two spellings


def flax_rms(x, w, eps):  # spell9's: x * rsqrt(mean(x²) + eps) * scale in fp32, one cast
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def f_rms_norm(x, w, eps):
    """`F.rms_norm(x.float(), (n,), w.float(), eps).to(x.dtype)` as the compiled graph has it
    (torch's decomposition, functionalised: a mean over the last dim, eps float32-rounded)."""
    h = x.float()
    eps32 = torch.tensor(eps, dtype=torch.float32).item()
    r = torch.rsqrt(torch.mean(h.pow(2), [h.dim() - 1], keepdim=True) + eps32)
    return (h * r * w.float()).to(x.dtype)


def _front_with(q_norm, kv_norm):
    def front(x, w_qa, w_kva, w_g, w_qn, w_kvn):
        cq = q_norm(F.linear(x, w_qa), w_qn, 1e-6)
        c_kv, k_pe = F.linear(x, w_kva).split([C, R], dim=-1)
        return cq, kv_norm(c_kv, w_kvn, 1e-6), k_pe, F.linear(x, w_g)
    return front


@pytest.mark.parametrize("norm", [flax_rms, f_rms_norm], ids=["flax", "F.rms_norm"])
@pytest.mark.parametrize("tokens", [1, 8, None])
def test_fp32_weight_norms_fuse_as_their_variant(tokens, norm):
    """Its own variant takes the site ([B, T, D] and [N, D] rows); the op runs with
    weight_fp32=True, bit-equal to the unfused graph, not to K3's rounding."""
    args, fn = _args(tokens=tokens), _front_with(norm, norm)
    gm, report = rewrite(fn, args, mla_lowrank_norm.patterns(), joint=True)
    assert [h.pattern for h in report.hits] == [
        f"mla_lowrank_norm[bfloat16{',rows' if tokens is None else ''},weight_fp32]"]
    assert_rewritten_equal(gm, report, fn, args, "k3.mla_lowrank_norm")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.mla_lowrank_norm.default")
    assert op.args[-1] is True
    assert not torch.equal(gm(*args)[0], mla_front(*args)[0])


def test_one_fp32_weight_norm_beside_a_k3_norm_is_left_alone():
    """Look-alike: q's weight multiplied after the cast (K3's order), c_kv's in fp32 before it:
    the op has one rounding for both, so neither variant takes the pair."""
    fn, args = _front_with(rms, flax_rms), _args()
    gm, report = rewrite(fn, args, mla_lowrank_norm.patterns(), joint=True)
    assert not report.hits
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fp32_weight_norms_fuse_on_gpu_graphs(monkeypatch):
    """mla_lowrank_norm's weight_fp32 build passed its GPU tests (H100, 2026-12-05,
    test_mla_lowrank_norm_kernel.py::test_weight_fp32), so a GPU graph fuses the Flax-order norms
    as it does the K3-order ones."""
    from .pattern_checks import with_kernel_limits

    with_kernel_limits(monkeypatch, "mla_lowrank_norm")
    args, fn = _args(), _front_with(flax_rms, flax_rms)
    gm, report = rewrite(fn, args, mla_lowrank_norm.patterns(), joint=True, kernels_only=True)
    assert [h.op for h in report.hits] == ["k3.mla_lowrank_norm"], report
    assert "mla_lowrank_norm" not in report.deferred
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want)
    _, report = rewrite(mla_front, args, mla_lowrank_norm.patterns(), joint=True,
                        kernels_only=True)
    assert [h.pattern for h in report.hits] == ["mla_lowrank_norm[bfloat16]"]