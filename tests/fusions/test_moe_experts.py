"""moe_experts: MXFP4 dequant, FC1, SiTU, FC2 and the weighted finalize of the routed experts, one
row (decode at batch 1) and several rows (a lowering of its einsums that differs)."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import moe_experts

from k3compile.math import e2m1_table, mxfp4_dequant, situ
from k3compile.models import mxfp4
from k3compile.rewrite import apply_patterns

from .pattern_checks import (
    assert_near_miss,
    assert_rewritten_equal,
    graph,
    rewrite,
    with_kernel_limits,
)


def _inputs(rows, top_k=2, experts=6, inter=64, latent=96, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(rows)
    w1 = mxfp4.random_mxfp4((experts, inter, latent), latent**-0.5, g)
    w3 = mxfp4.random_mxfp4((experts, inter, latent), latent**-0.5, g)
    w2 = mxfp4.random_mxfp4((experts, latent, inter), inter**-0.5, g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])
    weights = torch.rand(rows, top_k, generator=g)
    z = torch.randn(rows, latent, generator=g).to(dtype)
    return [z, ids, weights / weights.sum(-1, keepdim=True), e2m1_table(dtype=dtype),
            *w1, *w3, *w2]


def experts(z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s):
    """MXFP4Experts.forward."""
    return _experts(z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s, False)


def _experts(z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s, hidden):
    lut = e2m1.to(z.dtype)
    w1 = mxfp4_dequant(w1p[ids], w1s[ids], lut)
    w3 = mxfp4_dequant(w3p[ids], w3s[ids], lut)
    w2 = mxfp4_dequant(w2p[ids], w2s[ids], lut)
    hg = torch.einsum("nl,nkil->nki", z, w1)
    hu = torch.einsum("nl,nkil->nki", z, w3)
    act = situ(hg, hu, 4.0, 25.0)
    y = torch.einsum("nki,nkli->nkl", act, w2)
    out = (weights.unsqueeze(-1) * y.float()).sum(1).to(z.dtype)
    return (out, hg * 2) if hidden else out


@pytest.mark.parametrize("rows,dtype", [(1, torch.bfloat16), (3, torch.bfloat16),
                                        (8, torch.bfloat16), (3, torch.float32)])
def test_rewrites(rows, dtype):
    args = _inputs(rows, dtype=dtype)
    gm, report = rewrite(experts, args, moe_experts.patterns(), joint=True)
    assert_rewritten_equal(gm, report, experts, args, "k3.moe_experts")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.moe_experts.default")
    assert op.args[-2:] == (4.0, 25.0)


def test_escaping_fc1_output_is_a_near_miss():
    def escaped(z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s):  # FC1's gate escapes
        return _experts(z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s, True)

    _, report = rewrite(escaped, _inputs(3), moe_experts.patterns(), joint=True)
    assert_near_miss(report, "moe_experts")


def test_check_refuses_more_choices_than_experts():
    args = _inputs(3, top_k=8, experts=6)
    args[1] = torch.randint(0, 6, (3, 8))
    _, report = rewrite(experts, args, moe_experts.patterns(), joint=True)
    assert_near_miss(report, "moe_experts", "check refused", "top_k 8 > 6 experts")


def test_site_the_kernel_refuses_stays_unfused_on_gpu_graphs(monkeypatch):
    """Where only sites with a CUDA kernel fuse (GPU graphs), top_k 17 (past the kernel's 16)
    stays for Inductor: deferred, with the kernel's reason; elsewhere it fuses (the reference)."""
    with_kernel_limits(monkeypatch, "moe_experts")
    args = _inputs(3, top_k=17, experts=20)
    gm, report = rewrite(experts, args, moe_experts.patterns(), joint=True, kernels_only=True)
    assert not report.hits and "k3.moe_experts.default" not in [str(n.target) for n in gm.graph.nodes]
    assert "top_k 17" in report.deferred["moe_experts"]
    assert_near_miss(report, "moe_experts", "kernel refused", "top_k 17")
    torch.testing.assert_close(gm(*args), experts(*args), rtol=0, atol=0)
    gm, report = rewrite(experts, args, moe_experts.patterns(), joint=True)
    assert_rewritten_equal(gm, report, experts, args, "k3.moe_experts")
    # the kernel's shapes fuse on GPU graphs too
    args = _inputs(3)
    gm, report = rewrite(experts, args, moe_experts.patterns(), joint=True, kernels_only=True)
    assert_rewritten_equal(gm, report, experts, args, "k3.moe_experts")


def fused_w13(z, ids, weights, e2m1, w13p, w13s, w2p, w2s):
    """W1 | W3 stored as one [E, 2I, ·] (vLLM's w13), each half sliced before the gather
    (spell10's and the red-team spelling's `w13_split`)."""
    i = w13p.shape[1] // 2
    return experts(z, ids, weights, e2m1, w13p[:, :i], w13s[:, :i], w13p[:, i:], w13s[:, i:],
                   w2p, w2s)


def test_fused_w13_halves_fuse_on_gpu_graphs(monkeypatch):
    """The halves of a fused w13 reach the op as strided views; the kernels read them in place
    (expert stride 2I), so the site fuses on GPU graphs too, where session 38 found it deferred
    (the kernel wanted contiguous experts)."""
    with_kernel_limits(monkeypatch, "moe_experts")
    z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s = _inputs(3)
    args = [z, ids, weights, e2m1, torch.cat([w1p, w3p], 1), torch.cat([w1s, w3s], 1), w2p, w2s]
    gm, report = rewrite(fused_w13, args, moe_experts.patterns(), joint=True, kernels_only=True)
    assert_rewritten_equal(gm, report, fused_w13, args, "k3.moe_experts")


@pytest.mark.parametrize("table", ["scaled", "reordered", "unknown"])
def test_table_that_is_not_e2m1_is_a_near_miss(table):
    """The fused op builds the E2M1 table itself: another table (or one of unknown value) would
    fuse into wrong values, so the check reads the real table and refuses."""
    args = _inputs(3)
    if table == "scaled":
        args[3] = args[3] * 1.25
    elif table == "reordered":  # sign-magnitude halves swapped
        args[3] = torch.cat([args[3][8:], args[3][:8]])
    gm = graph(experts, *args, joint=True)
    if table == "unknown":
        gm.meta.pop("real_inputs")
    report = apply_patterns(gm.graph, moe_experts.patterns())
    assert_near_miss(report, "moe_experts", "check refused", "nibble table")
    gm.recompile()
    torch.testing.assert_close(gm(*args), experts(*args), rtol=0, atol=0)  # left as it was


# fp32_out: the finalize's fp32 sum left unrounded (bf16 z), as two foreign spellings feed it to the
# latent norm (tests/models/redteam_k3.py, spell5_k3.py); spelled as the model's finalize without
# the cast, and as spell5's batched form (its own dequant order and `unflatten`)
def experts_fp32_out(z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s):
    lut = e2m1.to(z.dtype)
    w1, w3, w2 = (mxfp4_dequant(p[ids], s[ids], lut) for p, s in ((w1p, w1s), (w3p, w3s),
                                                                 (w2p, w2s)))
    act = situ(torch.einsum("nl,nkil->nki", z, w1), torch.einsum("nl,nkil->nki", z, w3), 4.0,
               25.0)
    return (weights.unsqueeze(-1) * torch.einsum("nki,nkli->nkl", act, w2).float()).sum(1)


def experts_fp32_out_tail(z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s, norm_w, up_w):
    """The LatentMoE tail of tests/models/spell5_k3.py: the fp32 sum through an RMSNorm module
    (weight by type promotion), one rounding, the up-projection."""
    acc = experts_fp32_out(z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s)
    xf = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + 1e-5)
    return torch.nn.functional.linear((xf * norm_w).to(z.dtype), up_w)


@pytest.mark.parametrize("rows", [1, 3])
def test_fp32_out_rewrites_bit_for_bit(rows):
    args = _inputs(rows)
    gm, report = rewrite(experts_fp32_out, args, moe_experts.patterns(), joint=True)
    assert_rewritten_equal(gm, report, experts_fp32_out, args, "k3.moe_experts")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.moe_experts.default")
    assert op.args[-1] is True and op.meta["val"].dtype == torch.float32
    assert "fp32_out" in report.hits[0].pattern
    # the plain op rounds the sum to bf16: not these values
    assert not torch.equal(experts(*args).float(), experts_fp32_out(*args))


def test_fp32_out_and_weight_fp32_norm_fuse_the_latent_tail():
    from k3compile.patterns import norm_linear

    g = torch.Generator().manual_seed(5)
    args = [*_inputs(3), (1 + 0.1 * torch.randn(96, generator=g)).bfloat16(),
            (torch.randn(128, 96, generator=g) / 10).bfloat16()]
    gm, report = rewrite(experts_fp32_out_tail, args,
                         [*moe_experts.patterns(), *norm_linear.patterns()], joint=True)
    assert sorted(h.pattern.split("[")[0] for h in report.hits) == ["moe_experts", "norm_linear"]
    nl = next(n for n in gm.graph.nodes if str(n.target) == "k3.norm_linear.default")
    assert nl.args[-1] is True
    torch.testing.assert_close(gm(*args), experts_fp32_out_tail(*args), rtol=0, atol=0)


def test_fp32_out_leaves_the_rounded_finalize_to_the_plain_variant():
    """bf16 z with the sum rounded: the plain op (no fp32_out hit); fp32 z: the cast is no-op,
    the plain fp32 variant takes it and the fp32_out check would refuse (z's dtype)."""
    for dtype in (torch.bfloat16, torch.float32):
        args = _inputs(3, dtype=dtype)
        gm, report = rewrite(experts, args, moe_experts.patterns(), joint=True)
        assert_rewritten_equal(gm, report, experts, args, "k3.moe_experts")
        assert "fp32_out" not in report.hits[0].pattern
        op = next(n for n in gm.graph.nodes if str(n.target) == "k3.moe_experts.default")
        assert op.meta["val"].dtype == dtype


def test_fp32_out_escaping_fc1_output_is_a_near_miss():
    def escaped(z, ids, weights, e2m1, w1p, w1s, w3p, w3s, w2p, w2s):  # FC1's gate escapes
        lut = e2m1.to(z.dtype)
        w1, w3, w2 = (mxfp4_dequant(p[ids], s[ids], lut) for p, s in ((w1p, w1s), (w3p, w3s),
                                                                     (w2p, w2s)))
        hg = torch.einsum("nl,nkil->nki", z, w1)
        act = situ(hg, torch.einsum("nl,nkil->nki", z, w3), 4.0, 25.0)
        y = torch.einsum("nki,nkli->nkl", act, w2)
        return (weights.unsqueeze(-1) * y.float()).sum(1), hg * 2

    _, report = rewrite(escaped, _inputs(3), moe_experts.patterns(), joint=True)
    assert_near_miss(report, "moe_experts")


def test_e2m1_table_is_real_when_first_built_under_a_fake_mode(monkeypatch):
    """The engine runs an op's reference on fakes (`engine._reference_outputs`): a table the
    reference caches must not be cached fake, or every later real step reads a FakeTensor."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from k3compile.ops import moe_experts as op

    monkeypatch.setattr(op, "_E2M1", {})
    with FakeTensorMode():
        op.e2m1_table(torch.device("cpu"), torch.bfloat16)
    table = op.e2m1_table(torch.device("cpu"), torch.bfloat16)
    assert not isinstance(table, FakeTensor)
    assert table.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
