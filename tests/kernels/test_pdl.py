"""Programmatic dependent launch (`common.settings.KERNELS.pdl`) across chains of our kernels.

CPU: the flag is in every PDL kernel's compile key, so both builds coexist in its cache.
GPU (marked `gpu`): two chains at one K3 TP16 rank's shapes, at 1 row (gemv) and 8 (gemm_tc),
captured in a CUDA graph with PDL on and replayed on fresh inputs (outputs poisoned before each
replay), every stage checked against its test's model from the stage's actual inputs; then the
same graph captured with PDL off gives bitwise the same outputs (the math does not change).
  * the shared expert into the next mix: rms_norm -> GEMM (gate|up) -> situ -> GEMM (down,
    + residual) -> attn_res_mix_norm;
  * the layer fronts: router GEMM (fp32) -> moe_route, q_a|kv_a GEMM -> mla_lowrank_norm, KDA
    in-projection GEMM -> fb_kda_decode (one launch: the f_b sums inside it read fa, the GEMM's
    column slice, after the wait) on carried states.
"""

import pytest
import torch
from k3compile.kernels import (
    attn_res_mix_norm,
    fb_kda_decode,
    kda_decode,
    mla_lowrank_norm,
    moe_route,
    rms_norm,
    situ_gate_up,
)
from k3compile.kernels.common import dsl, gemm_tc, gemv
from k3compile.kernels.common.launch import Kernel

from k3compile import settings
from k3compile.ops.kda_decode import kda_decode_ref
from tests.fusions.test_attn_res_mix_norm_kernel import make_inputs as mix_inputs
from tests.fusions.test_attn_res_mix_norm_kernel import model as mix_model
from tests.fusions.test_kda_decode_kernel import Inputs as KDAInputs
from tests.fusions.test_kda_decode_kernel import compare as kda_compare
from tests.fusions.test_kda_decode_kernel import fb_graw_model
from tests.fusions.test_mla_lowrank_norm_kernel import model as norm_model
from tests.fusions.test_moe_route_kernel import by_id
from tests.fusions.test_moe_route_kernel import expected as route_expected
from tests.fusions.test_situ_gate_up_kernel import model as situ_model
from tests.kernel_checks import TOL, assert_written, poisoned, rel_err
from tests.kernels.test_gemm_tc import TC_FP32_SUMS
from tests.kernels.test_gemv import model as gemm_model

HIDDEN, SHARED, EPS, BETA, LINEAR_BETA = 7168, 384, 1e-5, 4.0, 25.0
EXPERTS, TOP_K, SCALING = 896, 16, 2.5
Q, C, R = 1536, 512, 64  # MLA q_a | kv_a (+ k_pe) widths
KDA_HEADS, KDA_K = 6, 128  # KDA heads per rank at TP16, head dim
REPLAYS = 3

# KERNEL.compiled(*scalars, cfg) of each kernel with PDL (any valid scalars: no compile happens)
COMPILE_ARGS = {
    gemv: (768, 7168, 1, False, False, gemv.config(768, 7168, 1)),
    gemm_tc: (768, 7168, False, False, gemm_tc.config(768, 7168, 8)),
    rms_norm: (3584, rms_norm.config(3584, 1)),
    situ_gate_up: (384, situ_gate_up.config(384, 1)),
    attn_res_mix_norm: (7168, 8, True, attn_res_mix_norm.config(7168, 8, True, 1)),
    mla_lowrank_norm: (Q, C, R, mla_lowrank_norm.config(Q, C, R, 1)),
    moe_route: (EXPERTS, TOP_K, moe_route.config(EXPERTS, TOP_K, 1)),
    kda_decode: (1, KDA_HEADS, 4, kda_decode.config(1, KDA_HEADS, 4, 1)),
}


@pytest.mark.parametrize("module", COMPILE_ARGS, ids=lambda m: m.__name__.rsplit(".")[-1])
def test_pdl_is_in_the_compile_key(module, monkeypatch):
    builds = []
    monkeypatch.setattr(module, "KERNEL",
                        Kernel(module.OP, lambda *_, pdl=False, **__: builds.append(pdl) or pdl))
    got = []
    for flag in (False, True, False, True):
        monkeypatch.setattr(settings.KERNELS, "pdl", flag)
        got.append(module.KERNEL.compiled(*COMPILE_ARGS[module]))
    assert builds == [False, True], "one build per setting, each cached"
    assert got == [False, True, False, True], "a call gets the build of the setting now"


def test_pdl_only_up_to_its_row_limit(monkeypatch):
    """PDL at launches of at most PDL_MAX_ROWS rows (their bucket); above it the plain build, in
    every kernel's compile key (gemv's rows are its m_bucket)."""
    monkeypatch.setattr(settings.KERNELS, "pdl", True)
    monkeypatch.setattr(settings.KERNELS, "pdl_max_rows", 4)
    assert dsl.pdl_enabled() and dsl.pdl_enabled(4) and not dsl.pdl_enabled(8)
    monkeypatch.setattr(settings.KERNELS, "pdl", False)
    assert not dsl.pdl_enabled(1)
    monkeypatch.setattr(settings.KERNELS, "pdl", True)
    for module, args in COMPILE_ARGS.items():
        monkeypatch.setattr(module, "KERNEL", Kernel(module.OP, lambda *_, pdl=False, **__: pdl))
        small, big = (module.KERNEL.compiled(*args, rows=m) for m in (2, 64))
        assert (small, big) == (True, False), module.__name__


def gemm(x, w, residual=None, *, out):
    """The weight-streaming GEMM of this row count: gemv at one row, gemm_tc above."""
    run = gemv.gemv_cuda if x.shape[0] == 1 else gemm_tc.gemm_tc_cuda
    assert run(x, w, residual, out=out) is out, "the GEMM did not run (fallback)"


class SharedExpertChain:
    """rms_norm -> gate|up GEMM -> situ -> down GEMM (+ x) -> attn_res_mix_norm (9 sources)."""

    def __init__(self, gen, m):
        self.gen, self.m = gen, m
        self.norm_w = (1 + 0.2 * self.randn(HIDDEN)).bfloat16()
        self.w_gu = (self.randn(2 * SHARED, HIDDEN) / HIDDEN ** 0.5).bfloat16()
        self.w_down = (self.randn(HIDDEN, SHARED) / SHARED ** 0.5).bfloat16()
        self.x = (4 * self.randn(m, HIDDEN)).bfloat16()
        self.mix = mix_inputs(gen, m, HIDDEN, 8, True)
        self.h, self.d, self.p, self.y = (poisoned(m, HIDDEN) for _ in range(4))
        self.gu, self.a = poisoned(m, 2 * SHARED), poisoned(m, SHARED)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device="cuda")

    def outputs(self):
        return self.h, self.gu, self.a, self.d, self.p, self.y

    def state(self):
        return ()

    def refresh(self):
        self.x.copy_((4 * self.randn(self.m, HIDDEN)).bfloat16())
        fresh = mix_inputs(self.gen, self.m, HIDDEN, 8, True)
        self.mix["prefix"].copy_(fresh["prefix"])
        for b, fb in zip(self.mix["blocks"], fresh["blocks"], strict=True):
            b.copy_(fb)

    def run(self):
        mix = self.mix
        assert rms_norm.rms_norm_cuda(self.x, self.norm_w, EPS, out=self.h) is self.h
        gemm(self.h, self.w_gu, out=self.gu)
        assert situ_gate_up.situ_cuda(self.gu, BETA, LINEAR_BETA, out=self.a) is self.a
        gemm(self.a, self.w_down, self.x, out=self.d)
        got = attn_res_mix_norm.attn_res_mix_norm_cuda(
            mix["prefix"], self.d, mix["blocks"], mix["mix_norm_weight"], mix["mix_proj_weight"],
            mix["norm_weight"], EPS, EPS, out=(self.p, self.y))
        assert got[0] is self.p and got[1] is self.y, "attn_res_mix_norm fell back"

    def check(self, _state):
        """Every stage against its model, from the stage's actual inputs."""
        close(self.h, norm_model(self.x, self.norm_w, EPS))
        close(self.gu, gemm_model(self.h, self.w_gu))
        close(self.a, situ_model(self.gu, BETA, LINEAR_BETA))
        close(self.d, gemm_model(self.a, self.w_down, self.x))
        want_p, want_y = mix_model(**{**self.mix, "delta": self.d})
        assert torch.equal(self.p, want_p), "prefix_out is not the bf16 sum"
        close(self.y, want_y)


class FrontChain:
    """Router GEMM -> moe_route; q_a|kv_a GEMM -> mla_lowrank_norm; KDA in-projection GEMM ->
    fb_kda_decode (T = 1, one request per row) on states carried from replay to replay."""

    def __init__(self, gen, m):
        self.gen, self.m = gen, m
        randn = self.randn
        self.x = randn(m, HIDDEN).bfloat16()
        self.w_router = (randn(EXPERTS, HIDDEN) / HIDDEN ** 0.5).bfloat16()
        self.bias = 0.1 * randn(EXPERTS)
        self.w_qa = (randn(Q + C + R, HIDDEN) * 3 / HIDDEN ** 0.5).bfloat16()
        self.wq, self.wkv = (1 + 0.2 * randn(Q)).bfloat16(), (1 + 0.2 * randn(C)).bfloat16()
        self.kda = KDAInputs(gen, m, 1, KDA_HEADS)
        width = self.kda.q.shape[-1] * 4 + KDA_K + KDA_HEADS  # q|k|v|g|f_a|b: 3206
        self.w_in = (randn(width, HIDDEN) / HIDDEN ** 0.5).bfloat16()
        self.logits = poisoned(m, EXPERTS, dtype=torch.float32)
        self.ids = poisoned(m, TOP_K, dtype=torch.int64)
        self.weights = poisoned(m, TOP_K, dtype=torch.float32)
        self.cqkv = poisoned(m, Q + C + R)
        self.q, self.kv, self.pe = poisoned(m, Q), poisoned(m, C), poisoned(m, R)
        self.inproj = poisoned(m, width)
        self.o = poisoned(m, 1, KDA_HEADS, KDA_K)
        # the kernel reads the in-projection's column slices, as in the model
        row, W = self.inproj.view(m, 1, width), KDA_HEADS * KDA_K
        k = self.kda
        k.q, k.k, k.v, k.g = (row[..., i * W:(i + 1) * W] for i in range(4))
        k.fa, k.b = row[..., 4 * W:4 * W + KDA_K], row[..., 4 * W + KDA_K:]

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device="cuda")

    def outputs(self):
        return (self.logits, self.ids, self.weights, self.cqkv, self.q, self.kv, self.pe,
                self.inproj, self.o)

    def state(self):
        return self.kda.conv_state, self.kda.state

    def refresh(self):
        self.x.copy_(self.randn(self.m, HIDDEN).bfloat16())

    def run(self):
        gemm(self.x, self.w_router, out=self.logits)
        got = moe_route.moe_route_cuda(self.logits, self.bias, TOP_K, SCALING,
                                       out=(self.ids, self.weights))
        assert got[0] is self.ids, "moe_route fell back"
        gemm(self.x, self.w_qa, out=self.cqkv)
        got = mla_lowrank_norm.mla_lowrank_norm_cuda(self.cqkv[:, :Q], self.cqkv[:, Q:], self.wq,
                                                     self.wkv, EPS, out=(self.q, self.kv, self.pe))
        assert got[0] is self.q, "mla_lowrank_norm fell back"
        gemm(self.x, self.w_in, out=self.inproj)
        k = self.kda
        assert fb_kda_decode.fb_kda_decode_cuda(*k.args(k.conv_state, k.state, fb=True),
                                             out=self.o) is self.o, "kda_decode fell back"

    def check(self, state0):
        close(self.logits, gemm_model(self.x, self.w_router, out_dtype=torch.float32),
              TC_FP32_SUMS)
        want_ids, want_w, keys = route_expected(self.logits, self.bias, TOP_K, SCALING)
        clear = keys[:, TOP_K - 1] - keys[:, TOP_K] > 1e-6  # rows without a tie at the cut
        ids, weights = by_id(self.ids[clear], self.weights[clear])
        want_ids, want_w = by_id(want_ids[clear], want_w[clear])
        assert torch.equal(ids, want_ids), "selected experts differ"
        torch.testing.assert_close(weights, want_w, **TOL["fp32"])
        close(self.cqkv, gemm_model(self.x, self.w_qa))
        close(self.q, norm_model(self.cqkv[:, :Q], self.wq, EPS))
        close(self.kv, norm_model(self.cqkv[:, Q:Q + C], self.wkv, EPS))
        assert torch.equal(self.pe, self.cqkv[:, Q + C:])
        close(self.inproj, gemm_model(self.x, self.w_in))
        k = self.kda
        conv0, s0 = state0
        # graw as fb_kda_decode's one launch sums it (fa is a GEMM's output, off the grid)
        k.graw = fb_graw_model(k.fa, k.fb_weight)
        ref_conv, ref_state = conv0.clone(), s0.clone()
        ref = kda_decode_ref(*k.args(ref_conv, ref_state))
        kda_compare(self.o, ref, k.conv_state, ref_conv, k.state, ref_state, k, conv0, s0)


def close(out, want, tol=None):
    assert_written(out)
    if tol is not None:
        torch.testing.assert_close(out, want, **tol)
        return
    torch.testing.assert_close(out.float(), want.float(), **TOL["bf16"])
    assert rel_err(out, want) < TOL["bf16_rel_norm"]


def capture(chain, pdl, monkeypatch):
    """The chain in a CUDA graph, its kernels built with PDL on or off (compiled first, outside
    the capture)."""
    monkeypatch.setattr(settings.KERNELS, "pdl", pdl)
    monkeypatch.setattr(settings.KERNELS, "pdl_max_rows", 64)  # PDL at every bucket
    saved = [t.clone() for t in chain.state()]
    chain.run()
    for t, s in zip(chain.state(), saved, strict=True):
        t.copy_(s)  # the warm-up run advanced the states
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.run()
    return graph


def replay(chain, graph):
    """Poison the outputs, replay; returns the states as they were before."""
    for t in chain.outputs():
        t.fill_(-1 if t.dtype == torch.int64 else float("nan"))
    before = tuple(t.clone() for t in chain.state())
    graph.replay()
    torch.cuda.synchronize()
    return before


CHAINS = {"shared_expert": SharedExpertChain, "front": FrontChain}


@pytest.fixture
def one_launch_fb(monkeypatch):
    """FrontChain's fb_kda_decode as one launch (opt-in, K3_KDA_FB): its graw model is that
    build's summation order."""
    monkeypatch.setattr(settings.KERNELS, "kda_fb", True)


def on_every_chain(test):
    """Every chain at M = 1 (gemv) and 8 (gemm_tc), on a GPU with the kernels registered."""
    for mark in (pytest.mark.parametrize("name", CHAINS), pytest.mark.parametrize("m", [1, 8]),
                 pytest.mark.usefixtures("cuda_kernels", "one_launch_fb"), pytest.mark.gpu):
        test = mark(test)
    return test


@on_every_chain
def test_chain_with_pdl_under_graph_replay(gen, monkeypatch, name, m):
    chain = CHAINS[name](gen, m)
    graph = capture(chain, True, monkeypatch)
    for _ in range(REPLAYS):
        chain.refresh()
        chain.check(replay(chain, graph))


@on_every_chain
def test_pdl_on_and_off_agree_bitwise(gen, monkeypatch, name, m):
    chain = CHAINS[name](gen, m)
    graphs = {pdl: capture(chain, pdl, monkeypatch) for pdl in (True, False)}
    start = tuple(t.clone() for t in chain.state())
    results = {}
    for pdl, graph in graphs.items():
        for t, s in zip(chain.state(), start, strict=True):
            t.copy_(s)
        replay(chain, graph)
        results[pdl] = [t.clone() for t in (*chain.outputs(), *chain.state())]
    for on, off in zip(results[True], results[False], strict=True):
        assert_written(on)
        assert torch.equal(on, off), "PDL changed a result"


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels", "one_launch_fb")
@pytest.mark.parametrize("name", CHAINS)
def test_late_trigger_agrees_bitwise_with_pdl_off(gen, monkeypatch, name):
    """K3_GEMM_TC_LATE_TRIGGER (gemm_tc's dependents launch after its K loops) changes when the
    next kernel starts, never a result: the 8-row chain bit for bit as without PDL."""
    chain = CHAINS[name](gen, 8)
    off = capture(chain, False, monkeypatch)
    monkeypatch.setattr(settings.KERNELS, "gemm_tc_late_trigger_mb", 0.0)
    late = capture(chain, True, monkeypatch)
    start = tuple(t.clone() for t in chain.state())
    results = []
    for graph in (off, late):
        for t, s in zip(chain.state(), start, strict=True):
            t.copy_(s)
        replay(chain, graph)
        results.append([t.clone() for t in (*chain.outputs(), *chain.state())])
    for a, b in zip(*results, strict=True):
        assert_written(b)
        assert torch.equal(a, b), "the late trigger changed a result"

