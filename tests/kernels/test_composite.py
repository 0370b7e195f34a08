"""The kernel composites (cuBLAS GEMM + one CuTe kernel) against their ops' torch references, at
the TP16-rank shapes, through the ops' CUDA dispatch: o_proj + post-attention mix + norm, and the
routed-latent norm + up-projection (+ the shared experts' residual). With K3_GEMV_FUSED on
(`settings.KERNELS.gemv_fused`), norm_linear, moe_front and situ_gate_up at one row take gemv's one-launch
variants: equal to the switch-off composites within tolerance (moe_front bitwise), also captured
in a CUDA graph with PDL on and off. With K3_GEMM_TC_FUSED (`settings.KERNELS.gemm_tc_fused`)
moe_front, situ_gate_up and norm_linear at 2..64 rows take gemm_tc's one-launch variants: one
kernel each, equal to the references and to the two launches within tolerance, also in a CUDA
graph."""

import pytest
import torch
from k3compile.kernels.common import dsl, gemm_tc, gemv, router

from k3compile import settings
from k3compile.ops.attn_res_mix_norm import attn_res_mix_norm_ref
from k3compile.ops.moe_front import moe_front_ref
from k3compile.ops.norm_linear import norm_linear_ref
from k3compile.ops.situ_gate_up import situ_gate_up_ref
from tests.kernel_checks import BUCKETS, TOL, assert_written, no_fallback, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

HIDDEN, O_IN, LATENT, EXPERTS, EPS = 7168, 768, 3584, 896, 1e-5
SHARED, BETA, LINEAR_BETA = 384, 4.0, 25.0


def _bf16(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


def _oproj_ref(o, w, prefix, blocks, wn, wp, wnorm, scores_fp32=False):
    a = torch.nn.functional.linear(o, w)
    first, second = (a, None) if prefix is None else (prefix, a)
    return attn_res_mix_norm_ref(first, second, blocks, wn, wp, wnorm, EPS, EPS, scores_fp32)


def _oproj_inputs(gen, n, n_blocks, with_prefix):
    o = _bf16(gen, n, O_IN)
    w = _bf16(gen, HIDDEN, O_IN, scale=O_IN ** -0.5)
    prefix = _bf16(gen, n, HIDDEN) if with_prefix else None
    blocks = [_bf16(gen, n, HIDDEN) for _ in range(n_blocks)]
    wn, wp = _bf16(gen, HIDDEN), _bf16(gen, 1, HIDDEN, scale=HIDDEN ** -0.5)
    wnorm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")).bfloat16()
    return o, w, prefix, blocks, wn, wp, wnorm


@pytest.mark.parametrize("n", BUCKETS)
@pytest.mark.parametrize("n_blocks,with_prefix", [(8, True), (3, False), (0, True)])
def test_oproj_attn_res_mix_norm(gen, n, n_blocks, with_prefix):
    args = _oproj_inputs(gen, n, n_blocks, with_prefix)
    got = torch.ops.k3.oproj_attn_res_mix_norm(*args, EPS, EPS)
    want = _oproj_ref(*args)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel_err(g, r) < TOL["vs_reference_rel_norm"]


@pytest.mark.parametrize("n", [1, 8, 64])
@pytest.mark.parametrize("n_blocks,with_prefix", [(8, True), (3, False)])
def test_oproj_attn_res_mix_norm_scores_fp32(gen, n, n_blocks, with_prefix):
    """Moonshot's fp32 scores: the mix kernel runs (no fallback) and is as close to the
    reference variant as a GEMM's bf16 roundings allow."""
    args = _oproj_inputs(gen, n, n_blocks, with_prefix)
    with no_fallback():
        got = torch.ops.k3.oproj_attn_res_mix_norm(*args, EPS, EPS, True)
    for g, r in zip(got, _oproj_ref(*args, scores_fp32=True)):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert rel_err(g, r) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("n", BUCKETS)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_norm_linear(gen, n, residual, weight_fp32):
    """weight_fp32: u the experts' fp32 sum, the norm weight multiplied in fp32 before the one
    rounding (the norm in torch, then router.linear: kernels/norm_linear.py)."""
    u = _bf16(gen, n, LATENT, scale=3.0)
    if weight_fp32:
        u = torch.randn(n, LATENT, generator=gen, device="cuda") * 3.0
    wnorm = (1 + 0.1 * torch.randn(LATENT, generator=gen, device="cuda")).bfloat16()
    w = _bf16(gen, HIDDEN, LATENT, scale=LATENT ** -0.5)
    r = _bf16(gen, n, HIDDEN) if residual else None
    got = torch.ops.k3.norm_linear(u, wnorm, w, EPS, r, weight_fp32)
    want = norm_linear_ref(u, wnorm, w, EPS, r, weight_fp32)
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
def test_moe_front_with_an_fp32_router(gen, n):
    """An fp32 router beside bf16 x (fp32 master weights under autocast: pattern variant
    moe_front[bfloat16,router_fp32], GPU graphs fuse it): the CUDA route's two GEMMs, the logits
    an fp32 GEMM of the upcast x equal to the reference's up to summation order, z the plain
    bf16 GEMM (session 35; not yet run on a GPU)."""
    x = _bf16(gen, n, HIDDEN)
    router_w = torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * HIDDEN ** -0.5
    down_w = _bf16(gen, LATENT, HIDDEN, scale=HIDDEN ** -0.5)
    logits, z = torch.ops.k3.moe_front(x, router_w, down_w)
    want_logits, want_z = moe_front_ref(x.cpu(), router_w.cpu(), down_w.cpu())
    assert logits.dtype == torch.float32 and z.dtype == torch.bfloat16
    assert rel_err(logits.cpu(), want_logits) < 1e-5
    torch.testing.assert_close(z.cpu(), want_z, **TOL["bf16"])
    assert rel_err(z.cpu(), want_z) < TOL["bf16_rel_norm"]


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
    `router.linear`, against the fp32 reference GEMM, [N, K] and [B, T, K] rows."""
    x = _bf16(gen, n, LATENT)
    w = _bf16(gen, HIDDEN, LATENT, scale=LATENT ** -0.5)
    got = torch.ops.k3.linear(x, w)
    want = torch.nn.functional.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, **TOL["bf16"])
    rows = torch.ops.k3.linear(x.view(n, 1, LATENT), w)
    assert rows.shape == (n, 1, HIDDEN) and torch.equal(rows.view(n, HIDDEN), got)


# ---- K3_GEMV_FUSED: one launch at gemv's rows ----------------------------------------------------


def spy(monkeypatch, name):
    """Count the calls of gemv.<name> (the composites look it up at call time)."""
    calls, real = [], getattr(gemv, name)
    monkeypatch.setattr(gemv, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def both_ways(monkeypatch, op, *args):
    """op(*args) with the switch off, then on."""
    got = []
    for flag in (False, True):
        monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset(settings.GEMV_VARIANTS) if flag else frozenset())
        got.append(op(*args))
    return got


def _norm_linear_inputs(gen, n, residual):
    u = _bf16(gen, n, LATENT, scale=3.0)
    wnorm = (1 + 0.1 * torch.randn(LATENT, generator=gen, device="cuda")).bfloat16()
    w = _bf16(gen, HIDDEN, LATENT, scale=LATENT ** -0.5)
    return u, wnorm, w, EPS, _bf16(gen, n, HIDDEN) if residual else None


@pytest.mark.parametrize("n", BUCKETS)
@pytest.mark.parametrize("residual", [False, True])
def test_norm_linear_fused(gen, monkeypatch, n, residual):
    calls = spy(monkeypatch, "gemv_norm_cuda")
    args = _norm_linear_inputs(gen, n, residual)
    off, on = both_ways(monkeypatch, torch.ops.k3.norm_linear, *args)
    assert len(calls) == (n <= gemv.GEMV_MAX_M), "the one-launch variant at gemv's rows only"
    assert on.dtype == off.dtype and on.shape == off.shape
    for want in (off, norm_linear_ref(*args)):
        torch.testing.assert_close(on.float(), want.float(), **TOL["bf16"])
        assert rel_err(on, want) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("n", BUCKETS)
def test_moe_front_fused(gen, monkeypatch, n):
    """One pass over [W_r; W_d] packed in one buffer (as stage `pack` stores them) gives the two
    GEMMs' logits and z: bit for bit where its config sums in their order (the same threads per
    row, with K), else to the rounding of another summation order (the tuned table can pick
    other threads for the split's N than for the router's: seen on the H200, session 20)."""
    calls = spy(monkeypatch, "gemv_split_cuda")
    x = _bf16(gen, n, HIDDEN)
    packed = _bf16(gen, EXPERTS + LATENT, HIDDEN, scale=HIDDEN ** -0.5)
    router_w, down_w = packed[:EXPERTS], packed[EXPERTS:]
    off, on = both_ways(monkeypatch, torch.ops.k3.moe_front, x, router_w, down_w)
    assert len(calls) == (n <= gemv.GEMV_MAX_M)
    m = dsl.bucket(n)
    threads = {gemv.config(EXPERTS + LATENT, HIDDEN, m, gemv.Fusion(split=EXPERTS)).threads,
               gemv.config(EXPERTS, HIDDEN, m).threads, gemv.config(LATENT, HIDDEN, m).threads}
    if len(calls) == 0 or len(threads) == 1:
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    else:
        assert rel_err(on[0], off[0]) < 1e-6
        assert rel_err(on[1], off[1]) < TOL["bf16_rel_norm"]
    want_logits, want_z = moe_front_ref(x, router_w, down_w)
    assert rel_err(on[0], want_logits) < 1e-5
    assert rel_err(on[1], want_z) < TOL["bf16_rel_norm"]


def test_fused_composites_refuse_to_two_launches(gen, monkeypatch, caplog):
    """A call the variant refuses (a norm weight in fp32, router weights with strided rows) runs
    the two launches, with the reason logged."""
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset(settings.GEMV_VARIANTS))
    u, wnorm, w, eps, r = _norm_linear_inputs(gen, 1, True)
    with caplog.at_level("DEBUG", logger="k3compile.kernels"):
        torch.ops.k3.norm_linear(u, wnorm.float(), w, eps, r)
        x = _bf16(gen, 1, HIDDEN)
        router_w = _bf16(gen, EXPERTS, HIDDEN + 4)[:, :HIDDEN]
        logits, _ = torch.ops.k3.moe_front(x, router_w, _bf16(gen, LATENT, HIDDEN))
    assert "gemv_norm" in caplog.text and "two launches" in caplog.text
    assert "gemv_split" in caplog.text
    assert rel_err(logits, x.float() @ router_w.float().t()) < 1e-5


class FusedOps:
    """norm_linear (+ residual), situ_gate_up, moe_front at one row, through the ops."""

    def __init__(self, gen):
        self.gen = gen
        self.norm = _norm_linear_inputs(gen, 1, True)
        self.x = _bf16(gen, 1, HIDDEN)
        self.wg, self.wu = (_bf16(gen, SHARED, HIDDEN, scale=HIDDEN ** -0.5) for _ in range(2))
        # [W_r; W_d] in one buffer, as stage `pack` stores them: the split refuses weights apart
        self.router_w, self.down_w = _packed(gen, EXPERTS, LATENT)

    def run(self):
        return (torch.ops.k3.norm_linear(*self.norm),
                torch.ops.k3.situ_gate_up(self.x, self.wg, self.wu, BETA, LINEAR_BETA),
                *torch.ops.k3.moe_front(self.x, self.router_w, self.down_w))

    def refresh(self):
        self.norm[0].copy_(_bf16(self.gen, 1, LATENT, scale=3.0))
        self.norm[4].copy_(_bf16(self.gen, 1, HIDDEN))
        self.x.copy_(_bf16(self.gen, 1, HIDDEN))

    def check(self, outs):
        y, a, logits, z = outs
        assert_written(*outs)
        want_logits, want_z = moe_front_ref(self.x, self.router_w, self.down_w)
        for got, want in ((y, norm_linear_ref(*self.norm)), (z, want_z),
                          (a, situ_gate_up_ref(self.x, self.wg, self.wu, BETA, LINEAR_BETA))):
            torch.testing.assert_close(got.float(), want.float(), **TOL["bf16"])
            assert rel_err(got, want) < TOL["bf16_rel_norm"]
        assert rel_err(logits, want_logits) < 1e-5


def _capture(ops, pdl, monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "pdl", pdl)
    monkeypatch.setattr(settings.KERNELS, "pdl_max_rows", 64)  # PDL at every bucket
    ops.run()  # compiles and builds the concatenations outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = ops.run()
    return graph, outs


def _replay(graph, outs):
    for t in outs:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return [t.clone() for t in outs]


def test_fused_composites_under_cuda_graphs_with_and_without_pdl(gen, monkeypatch):
    """Each one-launch variant captured with PDL on and off, replayed on fresh inputs (outputs
    poisoned first) against the references; both captures give bitwise the same outputs."""
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset(settings.GEMV_VARIANTS))
    calls = [spy(monkeypatch, f"gemv_{v}_cuda") for v in ("norm", "situ", "split")]
    ops = FusedOps(gen)
    graphs = {pdl: _capture(ops, pdl, monkeypatch) for pdl in (True, False)}
    assert all(len(c) == 4 for c in calls), "a composite took its two launches"
    for _ in range(3):
        ops.refresh()
        results = {pdl: _replay(*graphs[pdl]) for pdl in (True, False)}
        ops.check(results[True])
        for on, off in zip(results[True], results[False], strict=True):
            assert torch.equal(on, off), "PDL changed a result"


def test_split_front_takes_packed_weights_only():
    """The split variant reads [W_r; W_d] in place or not at all: weights apart (stage `pack`
    off or refused) would be copied on every call, so the front takes its two launches."""
    from k3compile.kernels.moe_front import _split_refusal

    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)
    apart = [torch.zeros(n, HIDDEN, dtype=torch.bfloat16) for n in (EXPERTS, LATENT)]
    assert "not packed" in _split_refusal(x, *apart)
    packed = torch.zeros(EXPERTS + LATENT, HIDDEN, dtype=torch.bfloat16)
    why = _split_refusal(x, packed[:EXPERTS], packed[EXPERTS:])
    assert why is None or "not packed" not in why


# ---- K3_GEMM_TC_FUSED: one launch at gemm_tc's rows ----------------------------------------------


def tc_spy(monkeypatch, name):
    """Count the calls of gemm_tc.<name> (the composites look it up at call time)."""
    calls, real = [], getattr(gemm_tc, name)
    monkeypatch.setattr(gemm_tc, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def tc_both_ways(monkeypatch, op, *args):
    """op(*args) with gemm_tc's variants off, then on."""
    got = []
    for flag in (False, True):
        monkeypatch.setattr(settings.KERNELS, "gemm_tc_fused",
                            frozenset(settings.GEMM_TC_VARIANTS) if flag else frozenset())
        got.append(op(*args))
    return got


def _packed(gen, *rows):
    """Weights [rows_i, HIDDEN] back to back in one buffer, as stage `pack` stores them."""
    buf = _bf16(gen, sum(rows), HIDDEN, scale=HIDDEN ** -0.5)
    return list(buf.split(list(rows)))


@pytest.mark.parametrize("n", [4, 8, 64])  # gemm_tc's rows start above gemv.GEMV_MAX_M (2)
def test_moe_front_tc_fused(gen, monkeypatch, n):
    """[W_r; W_d] packed: one launch at 2..64 rows where `router.linear` would take gemm_tc,
    close to the two launches (other configs: other summation orders) and the reference."""
    calls = tc_spy(monkeypatch, "gemm_tc_split_cuda")
    x = _bf16(gen, n, HIDDEN)
    router_w, down_w = _packed(gen, EXPERTS, LATENT)
    off, on = tc_both_ways(monkeypatch, torch.ops.k3.moe_front, x, router_w, down_w)
    # one launch up to FUSED_MAX_M rows ([4480, 7168] is in no tuned table: gemm_tc assumed)
    takes = router.tc_fused_takes(x, "split", EXPERTS + LATENT)
    assert len(calls) == takes == (n <= gemm_tc.FUSED_MAX_M)
    assert on[0].dtype == off[0].dtype == torch.float32 and on[0].shape == off[0].shape
    assert on[1].dtype == off[1].dtype and on[1].shape == off[1].shape
    assert rel_err(on[0], off[0]) < 1e-5
    assert rel_err(on[1], off[1]) < TOL["bf16_rel_norm"]
    want_logits, want_z = moe_front_ref(x, router_w, down_w)
    assert rel_err(on[0], want_logits) < 1e-5
    torch.testing.assert_close(on[1].float(), want_z.float(), **TOL["bf16"])
    assert rel_err(on[1], want_z) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("n", [4, 8, 64])
@pytest.mark.parametrize("width", [SHARED, 2112])  # shared experts, dense layer 0 (per rank)
def test_situ_gate_up_tc_fused(gen, monkeypatch, n, width):
    calls = tc_spy(monkeypatch, "gemm_tc_situ_cuda")
    x = _bf16(gen, n, HIDDEN)
    wg, wu = _packed(gen, width, width)
    off, on = tc_both_ways(monkeypatch, torch.ops.k3.situ_gate_up, x, wg, wu, BETA, LINEAR_BETA)
    assert len(calls) == router.tc_fused_takes(x, "situ", 2 * width)
    if width == SHARED:  # the H200's table has gemm_tc at every bucket for [768, 7168]
        assert len(calls) == (n <= gemm_tc.FUSED_MAX_M)
    assert on.dtype == off.dtype and on.shape == off.shape
    for want in (off, situ_gate_up_ref(x, wg, wu, BETA, LINEAR_BETA)):
        torch.testing.assert_close(on.float(), want.float(), **TOL["bf16"])
        assert rel_err(on, want) < TOL["bf16_rel_norm"]


class TCFusedOps:
    """situ_gate_up and moe_front at 8 rows over packed weights, through the ops."""

    def __init__(self, gen, n=8):
        self.gen, self.n = gen, n
        self.x = _bf16(gen, n, HIDDEN)
        self.wg, self.wu = _packed(gen, SHARED, SHARED)
        self.router_w, self.down_w = _packed(gen, EXPERTS, LATENT)

    def run(self):
        return (torch.ops.k3.situ_gate_up(self.x, self.wg, self.wu, BETA, LINEAR_BETA),
                *torch.ops.k3.moe_front(self.x, self.router_w, self.down_w))

    def check(self, outs):
        a, logits, z = outs
        assert_written(*outs)
        want_logits, want_z = moe_front_ref(self.x, self.router_w, self.down_w)
        for got, want in ((z, want_z),
                          (a, situ_gate_up_ref(self.x, self.wg, self.wu, BETA, LINEAR_BETA))):
            torch.testing.assert_close(got.float(), want.float(), **TOL["bf16"])
            assert rel_err(got, want) < TOL["bf16_rel_norm"]
        assert rel_err(logits, want_logits) < 1e-5


def test_tc_fused_composites_are_one_kernel_each(gen, monkeypatch):
    """At 8 rows each composite launches its gemm_tc variant and nothing else (issue 21)."""
    monkeypatch.setattr(settings.KERNELS, "gemm_tc_fused", frozenset(settings.GEMM_TC_VARIANTS))
    ops = TCFusedOps(gen)
    with no_fallback():
        ops.check(ops.run())  # compiled, and any first-call work done
    torch.cuda.synchronize()
    situ = lambda: torch.ops.k3.situ_gate_up(ops.x, ops.wg, ops.wu, BETA, LINEAR_BETA)
    front = lambda: torch.ops.k3.moe_front(ops.x, ops.router_w, ops.down_w)
    for op in (situ, front):
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            op()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1 and "GemmTC" in kernels[0], kernels


def test_tc_fused_composites_under_cuda_graphs_with_and_without_pdl(gen, monkeypatch):
    """Captured after one warm call (nothing compiles in the capture), replayed on fresh inputs
    (outputs poisoned first) against the references; PDL leaves every result bitwise equal."""
    monkeypatch.setattr(settings.KERNELS, "gemm_tc_fused", frozenset(settings.GEMM_TC_VARIANTS))
    calls = [tc_spy(monkeypatch, f"gemm_tc_{v}_cuda") for v in ("situ", "split")]
    ops = TCFusedOps(gen)
    graphs = {pdl: _capture(ops, pdl, monkeypatch) for pdl in (True, False)}
    assert all(len(c) == 4 for c in calls), "a composite took its two launches"
    for _ in range(3):
        ops.x.copy_(_bf16(gen, ops.n, HIDDEN))
        results = {pdl: _replay(*graphs[pdl]) for pdl in (True, False)}
        ops.check(results[True])
        for on, off in zip(results[True], results[False], strict=True):
            assert torch.equal(on, off), "PDL changed a result"


# ---- K3_GEMM_TC_FUSED=norm: norm_linear in one launch at gemm_tc's rows ---------------------------


@pytest.mark.parametrize("n", [4, 8, 16, 64])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_linear_tc_fused(gen, monkeypatch, n, residual):
    """The latent up-projection W [7168, 3584]: one launch where `tc_fused_takes` says so and
    the prologue's re-read limit allows it (the tuned table: gemm_tc at 2..8 rows; cuBLAS, so
    two launches, above), bitwise the two launches (the rms_norm kernel's x̂, then gemm_tc at the
    same config) and close to the reference."""
    calls = tc_spy(monkeypatch, "gemm_tc_norm_cuda")
    args = _norm_linear_inputs(gen, n, residual)
    off, on = tc_both_ways(monkeypatch, torch.ops.k3.norm_linear, *args)
    u, wnorm, w = args[:3]
    takes = router.tc_fused_takes(u, "norm", HIDDEN) and gemm_tc.norm_refusal(u, w, wnorm) is None
    assert len(calls) == takes
    if n <= 8:
        assert takes, "the tuned table has gemm_tc at 2..8 rows for [7168, 3584]"
    assert on.dtype == off.dtype and on.shape == off.shape
    assert torch.equal(on, off)
    want = norm_linear_ref(*args)
    torch.testing.assert_close(on.float(), want.float(), **TOL["bf16"])
    assert rel_err(on, want) < TOL["bf16_rel_norm"]


class TCNormOps:
    """norm_linear with the shared experts' residual at 8 rows, through the op."""

    def __init__(self, gen, n=8):
        self.gen, self.n = gen, n
        self.args = list(_norm_linear_inputs(gen, n, True))

    def refresh(self):
        self.args[0].copy_(_bf16(self.gen, self.n, LATENT, scale=3.0))
        self.args[4].copy_(_bf16(self.gen, self.n, HIDDEN))

    def run(self):
        return (torch.ops.k3.norm_linear(*self.args),)

    def check(self, outs):
        (y,) = outs
        assert_written(y)
        want = norm_linear_ref(*self.args)
        torch.testing.assert_close(y.float(), want.float(), **TOL["bf16"])
        assert rel_err(y, want) < TOL["bf16_rel_norm"]


def test_norm_linear_tc_fused_is_one_kernel(gen, monkeypatch):
    """At 8 rows norm_linear launches gemm_tc's norm variant and nothing else (issue 21: the
    rms_norm kernel before the latent up-projection is gone)."""
    monkeypatch.setattr(settings.KERNELS, "gemm_tc_fused", frozenset({"norm"}))
    ops = TCNormOps(gen)
    with no_fallback():
        ops.check(ops.run())
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.run()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "GemmTC" in kernels[0], kernels


def test_norm_linear_tc_fused_under_cuda_graphs_with_and_without_pdl(gen, monkeypatch):
    """Captured after one warm call, replayed on fresh inputs (output poisoned first) against
    the reference; PDL leaves the result bitwise equal."""
    monkeypatch.setattr(settings.KERNELS, "gemm_tc_fused", frozenset({"norm"}))
    calls = tc_spy(monkeypatch, "gemm_tc_norm_cuda")
    ops = TCNormOps(gen)
    graphs = {pdl: _capture(ops, pdl, monkeypatch) for pdl in (True, False)}
    assert len(calls) == 4, "norm_linear took its two launches"
    for _ in range(3):
        ops.refresh()
        results = {pdl: _replay(*graphs[pdl]) for pdl in (True, False)}
        ops.check(results[True])
        assert torch.equal(results[True][0], results[False][0]), "PDL changed a result"
