"""gemm_tc kernel (y = x · Wᵀ [+ r], M <= 64, tensor cores) at one K3 TP16 rank's weight shapes
for every batch bucket, rows between buckets (rows past M untouched), an odd aligned shape, every
split-K cluster size and tile height, the fp32 router output, the residual epilogue, strided
operands, determinism, the torch fallback of refused inputs, and the one-launch variants (split
output, SiTU epilogue) against the plain kernel and their references (GPU); refusals, configs,
the variants' references, the K3_GEMM_TC_FUSED switch and the composites' choice on any
machine."""

import dataclasses
import json
import logging
import os
import types
from pathlib import Path

import pytest
import torch
from k3compile.kernels.common import gemm_tc as kernel
from k3compile.kernels.common import gemv, router

from k3compile import settings
from k3compile.math import situ as situ_ref
from k3compile.ops.moe_front import moe_front_ref
from k3compile.ops.situ_gate_up import situ_gate_up_ref
from tests.kernel_checks import (
    TOL,
    assert_written,
    check_gemm,
    gemm_inputs,
    gemm_model,
    on_gpu,
    poisoned,
    rel_err,
)

# [N, K] of one TP16 rank: KDA in-proj, MLA q_a|kv_a, latent down, latent up, router, o_proj,
# gates / shared gate_up, MLA q_b, shared down, KDA f_b
SHAPES = [(3206, 7168), (2112, 7168), (3584, 7168), (7168, 3584), (896, 7168), (7168, 768),
          (768, 7168), (1152, 1536), (7168, 384), (768, 128)]
ODD = (1000, 1032)  # N not a multiple of 64; K/64 = 16.1: a zero-filled last K slice
ROUTER = (896, 7168)
# fp32 sums of up to 7168 products of size ~1/sqrt(K); the tensor cores' fp32 accumulation may
# truncate rather than round its additions (~2^-23 of the running sum each): ~1e-5 typical
TC_FP32_SUMS = {"rtol": 1e-4, "atol": 3e-4}


make_inputs, model = gemm_inputs, gemm_model


def check(x, w, residual=None, out_dtype=torch.bfloat16, out=None, cfg=None):
    return check_gemm(kernel.gemm_tc_cuda, x, w, residual, out_dtype, fp32_tol=TC_FP32_SUMS,
                      out=out, cfg=cfg)


@on_gpu
@pytest.mark.parametrize("m", kernel.BUCKETS)
@pytest.mark.parametrize("n,k", [*SHAPES, ODD], ids=lambda v: str(v))
def test_shapes(gen, n, k, m):
    check(*make_inputs(gen, m, n, k))


@on_gpu
@pytest.mark.parametrize("m", [1, 3, 7, 12, 24, 40, 63])
@pytest.mark.parametrize("n,k", [(3206, 7168), (7168, 768), ODD], ids=lambda v: str(v))
def test_rows_between_buckets(gen, n, k, m):
    """M rows of a [bucket, N] buffer: the rows past M (zero-filled x rows in the MMA) stay
    untouched."""
    x, w = make_inputs(gen, m, n, k)
    buf = poisoned(kernel.bucket(m) + 1, n)
    check(x, w, out=buf[:m])
    assert buf[m:].isnan().all(), "rows past M were written"


@on_gpu
@pytest.mark.parametrize("m", kernel.BUCKETS)
def test_router_fp32_logits(gen, m):
    check(*make_inputs(gen, m, *ROUTER), out_dtype=torch.float32)


@on_gpu
@pytest.mark.parametrize("m", [2, 5, 16, 64])
@pytest.mark.parametrize("n,k", [(7168, 768), (7168, 384), ODD], ids=lambda v: str(v))
def test_residual(gen, n, k, m):
    x, w = make_inputs(gen, m, n, k)
    r = (4 * torch.randn(m, n, generator=gen, device="cuda")).bfloat16()
    check(x, w, r)
    check(x, w, r, out_dtype=torch.float32)


def _config_variants(n, k, m_bucket):
    """One config per (tile height, split), the one with the fewest stages (the most refills of
    the pipeline): every cluster size and both MMA tilings."""
    by_shape = {}
    for cfg in kernel.configs(n, k, m_bucket):
        key = (cfg.tile_rows, cfg.splits)
        if key not in by_shape or cfg.stages < by_shape[key].stages:
            by_shape[key] = cfg
    return list(by_shape.values())


@on_gpu
@pytest.mark.parametrize("n,k,m", [(*ODD, 13), (896, 7168, 8), (7168, 768, 64)],
                         ids=lambda v: str(v))
def test_every_tiling_and_split(gen, n, k, m):
    x, w = make_inputs(gen, m, n, k)
    r = torch.randn(m, n, generator=gen, device="cuda").bfloat16()
    for cfg in _config_variants(n, k, kernel.bucket(m)):
        check(x, w, r, cfg=cfg)


@on_gpu
def test_strided_operands_and_determinism(gen):
    x, w = make_inputs(gen, 24, 2112 + 16, 7168 + 64)
    x, w = x[:, 64:], w[16:, 64:]  # row strides K + 64, 16-byte aligned row starts
    r = torch.randn(24, 2 * 2112, generator=gen, device="cuda").bfloat16()[:, ::2]
    assert kernel.refusal(x, w, r) is not None  # residual with strided columns: refused
    r = r.contiguous()
    wide = poisoned(24, 2112 + 40)
    first = check(x, w, r, out=wide[:, :2112]).clone()  # output row stride N + 40
    assert torch.equal(first, check(x, w, r)), "not deterministic"


@on_gpu
def test_empty_batch(gen):
    x, w = make_inputs(gen, 0, 768, 128)
    assert kernel.gemm_tc_cuda(x, w).shape == (0, 768)


@on_gpu
def test_linear_tc(gen):
    x, w = make_inputs(gen, 8, 2112, 7168)
    torch.testing.assert_close(kernel.linear_tc(x, w).float(), model(x, w).float(), **TOL["bf16"])
    x65 = torch.randn(65, 7168, generator=gen, device="cuda").bfloat16()
    assert torch.equal(kernel.linear_tc(x65, w), kernel.gemm_ref(x65, w))


@on_gpu
def test_the_router_takes_it_above_one_row(gen, monkeypatch):
    """`router.linear` (every fused op's GEMM) runs this kernel at 2..64 rows where the tuned
    table has it faster than cuBLAS, cuBLAS where not or where K3_KERNELS_SKIP names gemm_tc,
    and still the CUDA-core GEMV at one row."""
    from k3compile.kernels.common import router

    from k3compile import settings

    monkeypatch.setattr(settings.KERNELS, "skip", ())
    calls = []
    real = kernel.gemm_tc_cuda
    monkeypatch.setattr(kernel, "gemm_tc_cuda", lambda *a, **kw: calls.append(a[0].shape[0])
                        or real(*a, **kw))
    x, w = make_inputs(gen, 8, 3206, 7168)
    torch.testing.assert_close(router.linear(x, w).float(), model(x, w).float(), **TOL["bf16"])
    router.linear(x[:1], w)
    assert calls == [8]
    # cuBLAS where the table measured it faster (the H200's table does at this shape; on another
    # GPU no table loads, so the entry is set here)
    table = {**kernel.tuned(), (7168, 3584, 64): None}
    monkeypatch.setattr(kernel, "tuned", lambda: table)
    x, w = make_inputs(gen, 64, 7168, 3584)
    assert not kernel.prefers(7168, 3584, 64)
    assert torch.equal(router.linear(x, w), kernel.gemm_ref(x, w))
    assert calls == [8]
    monkeypatch.setattr(settings.KERNELS, "skip", ("gemm_tc",))
    x, w = make_inputs(gen, 8, 3206, 7168)
    assert torch.equal(router.linear(x, w), kernel.gemm_ref(x, w))
    assert calls == [8]


@on_gpu
@pytest.mark.parametrize("case", ["k_not_multiple_of_8", "fp32_x", "batch_65"])
def test_refused_inputs_fall_back_to_torch(gen, caplog, case):
    m, n, k = {"k_not_multiple_of_8": (4, 256, 1001), "fp32_x": (4, 768, 128),
               "batch_65": (65, 768, 7168)}[case]
    x, w = make_inputs(gen, m, n, k)
    if case == "fp32_x":
        x = x.float()
    assert not kernel.can_implement(x, w)
    r = torch.randn(m, n, generator=gen, device="cuda").to(x.dtype)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        y = kernel.gemm_tc_cuda(x, w)
        y_res = kernel.gemm_tc_cuda(x, w, r)
    assert "gemm_tc" in caplog.text
    if case == "batch_65":
        assert "batch above 64: cuBLAS" in caplog.text
    assert torch.equal(y, kernel.gemm_ref(x, w))
    assert torch.equal(y_res, kernel.gemm_ref(x, w, r))


def test_refusals_on_any_machine():
    """Metadata only: meta tensors stand in for the GPU's."""
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    w = t(768, 7168)
    assert kernel.refusal(t(64, 7168), w) is None
    assert kernel.refusal(t(1, 7168), w, t(1, 768), out_dtype=torch.float32) is None
    assert "batch above 64" in kernel.refusal(t(65, 7168), w)
    assert "dtype" in kernel.refusal(t(8, 7168, dtype=torch.float16), w)
    assert "K 7001" in kernel.refusal(t(8, 7001), t(768, 7001))
    assert "K 32" in kernel.refusal(t(8, 32), t(768, 32))
    assert "strides" in kernel.refusal(t(8, 7168 * 2)[:, ::2], w)
    assert "strides" in kernel.refusal(t(8, 7172)[:, :7168], w)  # rows 8 bytes off alignment
    assert "residual" in kernel.refusal(t(8, 7168), w, t(8, 767))
    assert "residual" in kernel.refusal(t(8, 7168), w, t(8, 768, dtype=torch.float32))
    assert "output dtype" in kernel.refusal(t(8, 7168), w, out_dtype=torch.float16)
    assert kernel.can_implement(t(8, 7168), w)


def test_linear_tc_on_cpu_is_the_reference():
    x, w = torch.randn(8, 256).bfloat16(), torch.randn(512, 256).bfloat16()
    r = torch.randn(8, 512).bfloat16()
    assert torch.equal(kernel.linear_tc(x, w, r), kernel.gemm_ref(x, w, r))
    assert kernel.linear_tc(x, w, out_dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("n,k", [*SHAPES, ODD], ids=lambda v: str(v))
def test_configs_fit(n, k):
    """Every config the heuristic or a sweep picks fits the kernel's constraints."""
    k_tiles = -(-k // kernel.TILE_K)
    for b in kernel.BUCKETS:
        chosen = kernel.config(n, k, b)
        sweep = kernel.configs(n, k, b)
        assert chosen in sweep or kernel.smem_bytes(chosen) <= kernel.SMEM_BYTES
        for cfg in [chosen, *sweep]:
            assert cfg.tile_rows in (64, 128) and cfg.splits in (1, 2, 4, 8)
            assert cfg.tile_tokens % 8 == 0 and b <= cfg.tile_tokens <= 64
            assert cfg.splits <= k_tiles, "an empty K share"
            assert cfg.stages >= 2 and kernel.smem_bytes(cfg) <= kernel.SMEM_BYTES


def test_tuned_table():
    """The shipped table: one entry per (shape, bucket), each a config that fits, where the kernel
    measured faster than cuBLAS, and None (cuBLAS) where not; `config` and `prefers` follow it."""
    table = kernel.tuned()
    assert table, "no tuned entries"
    for (n, k, b), cfg in table.items():
        assert b in kernel.BUCKETS
        assert kernel.prefers(n, k, b) == (cfg is not None)
        if cfg is not None:
            assert kernel.config(n, k, b) == cfg
            assert b <= cfg.tile_tokens and kernel.smem_bytes(cfg) <= kernel.SMEM_BYTES
            assert cfg.splits <= -(-k // kernel.TILE_K)
    assert kernel.prefers(1000, 1032, 8)  # not in the table: the heuristic's kernel
    assert kernel.config(1000, 1032, 8) == kernel.heuristic_config(1000, 1032, 8)


def test_table_writer_keeps_the_winner(tmp_path, monkeypatch):
    """`benchmarks/gemm_tc.py --table`: per (shape, bucket) the faster of the best config and
    cuBLAS, merged into the entries of other shapes already there."""
    from tests.conftest import load_benchmark

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    bench = load_benchmark("gemm_tc")
    cfg = "Config(tile_rows=64, tile_tokens=8, stages=4, splits=2)"
    rows = [{"N": 768, "K": 7168, "M": 8, "config": cfg, "tc_us": 6.5, "mm_us": 8.3},
            {"N": 7168, "K": 768, "M": 64, "best": cfg, "us": {cfg: 8.8}, "mm_us": 6.0}]
    path = tmp_path / "table.json"
    bench.write_table(path, rows[:1], "GPU", "test")
    bench.write_table(path, rows[1:], "GPU", "test")
    entries = {(e["N"], e["K"], e["bucket"]): e["config"]
               for e in json.loads(path.read_text())["entries"]}
    assert entries == {(768, 7168, 8): bench.parse_config(cfg), (7168, 768, 64): None}
    assert kernel.Config(**entries[768, 7168, 8]) == kernel.Config(64, 8, 4, 2)


def test_each_gpu_reads_its_own_table(tmp_path, monkeypatch):
    """`load_tuned`: the table beside `path` measured on this process's GPU (`<stem>_*.json`
    siblings included); none for a GPU without one (heuristic configs); `path` itself without
    a GPU."""
    from k3compile.kernels.common.gemm import load_tuned

    def table(name, device, tile_rows):
        entry = {"N": 768, "K": 7168, "bucket": 8,
                 "config": {"tile_rows": tile_rows, "tile_tokens": 8, "stages": 4, "splits": 1}}
        (tmp_path / name).write_text(json.dumps({"device": device, "entries": [entry]}))

    table("t.json", "NVIDIA H200", 64)
    table("t_h100.json", "NVIDIA H100 80GB HBM3", 128)
    table("other.json", "NVIDIA B200", 32)  # not a sibling of t.json: never read
    path = tmp_path / "t.json"

    def load(gpu):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: gpu)
        got = load_tuned(path, "gemm_tc", lambda c: kernel.Config(**c))
        return {key: cfg.tile_rows for key, cfg in got.items()}

    assert load(None) == {(768, 7168, 8): 64}
    assert load("NVIDIA H200") == {(768, 7168, 8): 64}
    assert load("NVIDIA H100 80GB HBM3") == {(768, 7168, 8): 128}
    assert load("NVIDIA B200") == {}



# ---- the one-launch variants (K3_GEMM_TC_FUSED) ------------------------------------------------

EXPERTS, LATENT, HIDDEN, SHARED, DENSE = 896, 3584, 7168, 384, 2112
EPS = 1e-5
BETA, LINEAR_BETA = 4.0, 25.0
# (split, N, K): the front [W_r; W_d] of one TP16 rank; a split inside a partial row tile with a
# partial K slice
SPLITS = [(EXPERTS, EXPERTS + LATENT, HIDDEN), (333, 1000, 1032)]
# (I, K): the shared experts' [W_g; W_u], dense layer 0's, 17 half tiles with a partial K slice
SITUS = [(SHARED, HIDDEN), (DENSE, HIDDEN), (544, 1032)]


def close_bf16(out, want):
    torch.testing.assert_close(out.float(), want.float(), **TOL["bf16"])
    assert rel_err(out, want) < TOL["bf16_rel_norm"]


def test_fused_refusals_on_any_machine():
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    x, front, gate_up = t(8, 7168), t(EXPERTS + LATENT, 7168), t(2 * SHARED, 7168)
    assert kernel.fused_refusal(kernel.Fusion(split=EXPERTS), x, front) is None
    assert kernel.fused_refusal(kernel.SITU, x, gate_up) is None
    assert "split at row 4480" in kernel.fused_refusal(kernel.Fusion(split=4480), x, front)
    assert "batch above 64" in kernel.fused_refusal(kernel.SITU, t(65, 7168), gate_up)
    assert "even row count" in kernel.fused_refusal(kernel.SITU, x, t(769, 7168))
    assert "even row count" in kernel.fused_refusal(kernel.SITU, x, gate_up,
                                                    out_dtype=torch.float32)
    why = kernel.fused_refusal(kernel.SITU, t(8, 1032), t(1000, 1032))  # I = 500
    assert "I = 500" in why and "multiple of 32" in why
    assert "dtype" in kernel.fused_refusal(kernel.SITU, t(8, 7168, dtype=torch.float32), gate_up)
    assert kernel.fused_launch_refusal(  # no runtime here, or CPU tensors
        kernel.SITU, torch.zeros(8, 7168).bfloat16(), torch.zeros(768, 7168).bfloat16())


def test_situ_config_halves_fit_i(monkeypatch):
    """A tile holds R/2 rows of W_g and the same of W_u: where a tuned R = 128 leaves I not a
    multiple of 64, the SiTU variant takes R = 64 (the rest of the config as tuned)."""
    wide = kernel.Config(128, 8, 4, 2)
    monkeypatch.setattr(kernel, "tuned", lambda: {(2 * 416, 7168, 8): wide,
                                                  (2 * 384, 7168, 8): wide})
    assert kernel.config(2 * 416, 7168, 8) == wide  # the plain kernel keeps it
    assert kernel.config(2 * 416, 7168, 8, kernel.SITU) == kernel.Config(64, 8, 4, 2)
    assert kernel.config(2 * 384, 7168, 8, kernel.SITU) == wide  # 384 = 6 x 64
    assert kernel.config(4480, 7168, 8, kernel.Fusion(split=896)) == kernel.config(4480, 7168, 8)


def test_variants_on_cpu_are_the_two_launches_references():
    """Refused (no GPU): the torch references, in the two-launch path's dtypes and shapes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=gen).bfloat16()
    w = (torch.randn(96, 256, generator=gen) / 16).bfloat16()
    logits, z = kernel.gemm_tc_split_cuda(x, w, 32)
    assert logits.dtype == torch.float32 and logits.shape == (8, 32)
    assert z.dtype == torch.bfloat16 and z.shape == (8, 64)
    assert torch.equal(logits, kernel.gemm_ref(x, w[:32], out_dtype=torch.float32))
    assert torch.equal(z, kernel.gemm_ref(x, w[32:]))
    a = kernel.gemm_tc_situ_cuda(x, w, BETA, LINEAR_BETA)
    assert a.dtype == torch.bfloat16 and a.shape == (8, 48)
    assert torch.equal(a, situ_gate_up_ref(x, w[:48], w[48:], BETA, LINEAR_BETA))


def test_switch_names_variants():
    if "K3_GEMM_TC_FUSED" not in os.environ:
        # split and SiTU paid at B8 on the H200; norm lost (0.43-0.52x its two launches)
        assert settings.KERNELS.gemm_tc_fused == {"split", "situ"}
    parse = settings.parse_gemm_tc_fused
    assert parse(None) == settings.GEMM_TC_DEFAULT == {"split", "situ"}
    assert parse("0") == parse("") == frozenset()
    assert parse("all") == parse("1") == {"split", "situ", "norm"}
    assert parse(" situ ") == {"situ"}
    assert parse("norm") == {"norm"} and parse("situ, norm") == {"situ", "norm"}
    with pytest.raises(ValueError, match="K3_GEMM_TC_FUSED: unknown variants"):
        parse("situ,gate")


def _rows(m, k):
    """Stands in for CUDA rows x [m, k] where only the routing rule reads them."""
    return types.SimpleNamespace(shape=(m, k), is_cuda=True, dim=lambda: 2)


def test_router_rule_for_the_variants(monkeypatch):
    """`tc_fused_takes`: the switch names the variant and `linear` would run gemm_tc on the
    whole weight at this M (2..FUSED_MAX_M rows, not skipped, the tuned table prefers the shape)."""
    monkeypatch.setattr(router, "have_dsl", lambda: True)
    monkeypatch.setattr(settings.KERNELS, "skip", ())
    monkeypatch.setattr(settings.KERNELS, "gemm_tc_fused", frozenset({"split", "situ"}))
    assert all(router.tc_fused_takes(_rows(m, 7168), "situ", 768) for m in (3, 5, 8, 16, 32))
    assert not any(router.tc_fused_takes(_rows(m, 7168), "situ", 768)
                   for m in range(1, gemv.GEMV_MAX_M + 1)), "gemv's rows"
    assert not any(router.tc_fused_takes(_rows(m, 7168), "situ", 768) for m in (33, 64)), \
        "above FUSED_MAX_M: the two launches (lost at B64 on the H200)"
    assert not kernel.prefers(7168, 3584, 64)  # the table: cuBLAS there
    assert not router.tc_fused_takes(_rows(64, 3584), "split", 7168)
    assert not router.tc_fused_takes(torch.empty(8, 7168), "situ", 768), "a CPU tensor"
    monkeypatch.setattr(settings.KERNELS, "gemm_tc_fused", frozenset({"split"}))
    assert not router.tc_fused_takes(_rows(8, 7168), "situ", 768)
    assert router.tc_fused_takes(_rows(8, 7168), "split", 4480)
    monkeypatch.setattr(settings.KERNELS, "skip", ("gemm_tc",))
    assert not router.tc_fused_takes(_rows(8, 7168), "split", 4480)


@pytest.mark.parametrize("taken", [True, False])
def test_composites_choose_the_variant(monkeypatch, taken):
    """moe_front and situ_gate_up take the one-launch variant where `tc_fused_takes` says so
    and the variant takes the call (the front's weights packed back to back, read in place),
    else their two launches. CPU tensors, the rule and the launches stood in for."""
    from k3compile.kernels import moe_front, situ_gate_up

    calls = []
    monkeypatch.setattr(router, "tc_fused_takes", lambda x, variant, n: taken)
    monkeypatch.setattr(kernel, "fused_launch_refusal", lambda *a, **kw: None)
    monkeypatch.setattr(kernel, "gemm_tc_split_cuda",
                        lambda x, w, split: calls.append(("split", w, split)) or "one")
    monkeypatch.setattr(kernel, "gemm_tc_situ_cuda",
                        lambda x, w, beta, lb: calls.append(("situ", w, beta)) or "one")
    x = torch.randn(8, 256).bfloat16()
    packed = torch.randn(96, 256).bfloat16()
    front = moe_front.moe_front_cuda(x, packed[:32], packed[32:])
    a = situ_gate_up.situ_gate_up_cuda(x, packed[:48], packed[48:], BETA, LINEAR_BETA)
    if not taken:
        assert calls == []
        for got, want in zip(front, moe_front_ref(x, packed[:32], packed[32:]), strict=True):
            torch.testing.assert_close(got, want)
        close_bf16(a, situ_gate_up_ref(x, packed[:48], packed[48:], BETA, LINEAR_BETA))
        return
    assert front == "one" and a == "one"
    (v1, w1, split), (v2, w2, beta) = calls
    assert (v1, split, v2, beta) == ("split", 32, "situ", BETA)
    for w in (w1, w2):  # [W_r; W_d] and [W_g; W_u] in place: views of the packed buffer
        assert w.data_ptr() == packed.data_ptr() and w.shape == packed.shape
    calls.clear()  # weights apart: the front's variant refuses (no copy per call)
    apart = moe_front.moe_front_cuda(x, packed[:32].clone(), packed[32:].clone())
    assert calls == [] and apart[0].dtype == torch.float32


def test_norm_refusals_on_any_machine():
    """The norm prologue: a contiguous bf16 norm weight [K], a residual allowed (refused with
    the other variants), and the L2 re-read of x: S·M <= R/2 at the config."""
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    w, g, r = t(HIDDEN, LATENT), t(LATENT), t(8, HIDDEN)
    x = t(8, LATENT)
    # tuned (R 64, S 2, 8 stages), with the W stages that still keep two CTAs per SM beside x̂
    assert kernel.config(HIDDEN, LATENT, 8) == kernel.Config(64, 8, 8, 2)
    norm = kernel.config(HIDDEN, LATENT, 8, kernel.NORM)
    assert norm == kernel.Config(64, 8, 9, 2)
    per_cta = kernel.smem_bytes(norm) + kernel.norm_smem_bytes(norm, LATENT)
    more = dataclasses.replace(norm, stages=10)
    assert per_cta <= kernel.SMEM_BYTES // 2 - 1024 < (
        kernel.smem_bytes(more) + kernel.norm_smem_bytes(more, LATENT))
    assert kernel.fused_refusal(kernel.NORM, x, w, norm_weight=g) is None  # S·M/R = 1/4
    assert kernel.fused_refusal(kernel.NORM, x, w, r, norm_weight=g) is None
    assert "residual" in kernel.fused_refusal(kernel.SITU, x, t(2 * SHARED, LATENT), r)
    assert "norm weight: none" in kernel.fused_refusal(kernel.NORM, x, w)
    for bad in (t(LATENT, dtype=torch.float32), t(LATENT + 8), t(2 * LATENT)[::2]):
        assert "norm weight" in kernel.fused_refusal(kernel.NORM, x, w, norm_weight=bad)
    assert "residual: torch.float32" in kernel.fused_refusal(
        kernel.NORM, x, w, t(8, HIDDEN, dtype=torch.float32), norm_weight=g)
    # 64 rows at the heuristic config (R = 64, S = 2): S·M/R = 2
    why = kernel.fused_refusal(kernel.NORM, t(64, LATENT), w, norm_weight=g)
    assert "norm prologue" in why and "S·M/R above 0.5" in why
    # one CTA per 128-row tile: S·M/R = 1/2, but x̂ of 64 tokens x 3584 columns (448 KB) is
    # more shared memory than a CTA has; 32 tokens over two CTAs fit (112 KB of x̂ each)
    wide = kernel.Config(128, 64, 4, 1)
    why = kernel.fused_refusal(kernel.NORM, t(64, LATENT), w, norm_weight=g, cfg=wide)
    assert "norm prologue" in why and "shared memory" in why and "3584 columns" in why
    half = kernel.Config(128, 32, 4, 2)
    assert kernel.fused_refusal(kernel.NORM, t(32, LATENT), w, norm_weight=g, cfg=half) is None
    assert kernel.fused_refusal(kernel.NORM, t(16, LATENT), w, norm_weight=g) is None
    assert kernel.fused_launch_refusal(  # no runtime here, or CPU tensors
        kernel.NORM, torch.zeros(8, LATENT).bfloat16(), torch.zeros(HIDDEN, LATENT).bfloat16(),
        norm_weight=torch.ones(LATENT).bfloat16())


def test_norm_variant_on_cpu_is_the_two_launches_reference():
    """Refused (no GPU): rms_norm_ref then the GEMM reference, with and without a residual."""
    from k3compile.ops.rms_norm import rms_norm_ref

    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(8, 256, generator=gen)).bfloat16()
    g = (1 + 0.1 * torch.randn(256, generator=gen)).bfloat16()
    w = (torch.randn(96, 256, generator=gen) / 16).bfloat16()
    r = torch.randn(8, 96, generator=gen).bfloat16()
    for res in (None, r):
        y = kernel.gemm_tc_norm_cuda(x, g, w, 1e-5, res)
        assert y.dtype == torch.bfloat16 and y.shape == (8, 96)
        assert torch.equal(y, kernel.gemm_ref(rms_norm_ref(x, g, 1e-5), w, res))


@pytest.mark.parametrize("case", ["off", "taken", "refused"])
def test_norm_linear_chooses_the_variant(monkeypatch, caplog, case):
    """norm_linear above gemv's rows: gemm_tc's norm variant where `tc_fused_takes` says so and
    the variant takes the call; else (the refusal logged) the rms_norm kernel and
    `router.linear`. CPU tensors, the rule and the launch stood in for."""
    from k3compile.kernels import norm_linear

    from k3compile.ops.norm_linear import norm_linear_ref

    calls = []
    monkeypatch.setattr(router, "tc_fused_takes",
                        lambda x, variant, n: case != "off" and variant == "norm" and n == 96)
    monkeypatch.setattr(kernel, "fused_launch_refusal", lambda fusion, *a, **kw: (
        "S·M/R above 0.5" if case == "refused" else None) if fusion == kernel.NORM else "no")
    monkeypatch.setattr(kernel, "gemm_tc_norm_cuda", lambda u, g, w, eps, r: calls.append(
        (u, g, w, eps, r)) or "one")
    gen = torch.Generator().manual_seed(0)
    u = (3 * torch.randn(8, 256, generator=gen)).bfloat16()
    g = (1 + 0.1 * torch.randn(256, generator=gen)).bfloat16()
    w = (torch.randn(96, 256, generator=gen) / 16).bfloat16()
    r = torch.randn(8, 96, generator=gen).bfloat16()
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        y = norm_linear.norm_linear_cuda(u, g, w, 1e-5, r)
    if case == "taken":
        assert y == "one" and len(calls) == 1
        got = calls[0]
        assert got[0] is u and got[1] is g and got[2] is w and got[3] == 1e-5 and got[4] is r
        return
    assert calls == []
    close_bf16(y, norm_linear_ref(u, g, w, 1e-5, r))
    if case == "refused":
        assert "gemm_tc_norm" in caplog.text and "two launches" in caplog.text


def test_tc_split_takes_packed_weights_only():
    from k3compile.kernels.moe_front import _tc_split_refusal

    x = torch.zeros(8, HIDDEN, dtype=torch.bfloat16)
    apart = [torch.zeros(n, HIDDEN, dtype=torch.bfloat16) for n in (EXPERTS, LATENT)]
    assert "not packed" in _tc_split_refusal(x, *apart)
    packed = torch.zeros(EXPERTS + LATENT, HIDDEN, dtype=torch.bfloat16)
    why = _tc_split_refusal(x, packed[:EXPERTS], packed[EXPERTS:])
    assert why is None or "not packed" not in why


def test_variant_key_holds_the_fusion_and_the_plain_key_is_unchanged(monkeypatch):
    from k3compile.kernels.common.launch import Kernel

    builds = []
    monkeypatch.setattr(kernel, "KERNEL", Kernel(kernel.OP, lambda *a, **kw: builds.append(
        kw.get("fusion")) or len(builds)))
    cfg = kernel.config(768, 7168, 8)
    kernel.prepare(768, 7168, (8,))
    kernel.prepare(768, 7168, (8,), fusion=kernel.SITU)
    kernel.prepare(4480, 7168, (8,), fusion=kernel.Fusion(split=896))
    kernel.prepare(768, 7168, (8,), fusion=kernel.SITU)  # cached
    kernel.prepare(7168, 3584, (8,), residual=True, fusion=kernel.NORM)
    assert builds == [None, kernel.SITU, kernel.Fusion(split=896), kernel.NORM]
    # a launch asks for the key prepare() built: the late-trigger option as launches add it
    # (K3_GEMM_TC_LATE_TRIGGER: weights of >= 20 MB where the rows have PDL)
    norm_cfg = kernel.config(7168, 3584, 8, kernel.NORM)
    assert kernel.KERNEL.compiled(7168, 3584, False, True, norm_cfg, rows=8, fusion=kernel.NORM,
                                  **kernel.trigger_option(7168, 3584, 8)) == 4
    assert kernel.KERNEL.compiled(768, 7168, False, False, cfg, rows=8,
                                  **kernel.trigger_option(768, 7168, 8)) == 1
    split_cfg = kernel.config(4480, 7168, 8)  # the split's first output is fp32
    assert kernel.KERNEL.compiled(4480, 7168, True, False, split_cfg, rows=8,
                                  fusion=kernel.Fusion(split=896),
                                  **kernel.trigger_option(4480, 7168, 8)) == 3


# GPU: each variant against the plain kernel at the same config and against its reference


@on_gpu
@pytest.mark.parametrize("m", [2, 8, 64])
@pytest.mark.parametrize("split,n,k", SPLITS, ids=str)
def test_split_variant(gen, split, n, k, m):
    """Logits and z of one launch are bitwise the plain kernel's over [W_r; W_d] at the same
    config (the same sums), and moe_front_ref's within its tolerances."""
    x, w = make_inputs(gen, m, n, k)
    out, out2 = poisoned(m, split, dtype=torch.float32), poisoned(m, n - split)
    got = kernel.gemm_tc_split_cuda(x, w, split, out=out, out2=out2)
    assert got[0] is out and got[1] is out2, "fell back"
    assert_written(out, out2)
    cfg = kernel.config(n, k, kernel.bucket(m), kernel.Fusion(split=split))
    plain = kernel.gemm_tc_cuda(x, w, out=poisoned(m, n, dtype=torch.float32), cfg=cfg)
    assert torch.equal(out, plain[:, :split])
    assert torch.equal(out2, kernel.gemm_tc_cuda(x, w, out=poisoned(m, n), cfg=cfg)[:, split:])
    want_logits, want_z = moe_front_ref(x, w[:split], w[split:])
    torch.testing.assert_close(out, gemm_model(x, w[:split], out_dtype=torch.float32),
                               **TC_FP32_SUMS)
    assert rel_err(out, want_logits) < 1e-5
    close_bf16(out2, want_z)


@on_gpu
@pytest.mark.parametrize("m", [2, 8, 64])
@pytest.mark.parametrize("width,k", SITUS, ids=str)
def test_situ_variant(gen, width, k, m):
    """Against situ on the plain kernel's bf16 GEMM output at the same config (the two launches'
    inputs to the situ kernel), bitwise against the two launches, and situ_gate_up_ref."""
    from k3compile.kernels import situ_gate_up

    x, w = make_inputs(gen, m, 2 * width, k)
    out = poisoned(m, width)
    assert kernel.gemm_tc_situ_cuda(x, w, BETA, LINEAR_BETA, out=out) is out, "fell back"
    assert_written(out)
    cfg = kernel.config(2 * width, k, kernel.bucket(m), kernel.SITU)
    gate_up = kernel.gemm_tc_cuda(x, w, out=poisoned(m, 2 * width), cfg=cfg)
    close_bf16(out, situ_ref(gate_up[:, :width], gate_up[:, width:], BETA, LINEAR_BETA))
    assert torch.equal(out, situ_gate_up.situ_cuda(gate_up, BETA, LINEAR_BETA,
                                                   out=poisoned(m, width)))
    close_bf16(out, situ_gate_up_ref(x, w[:width], w[width:], BETA, LINEAR_BETA))


@on_gpu
@pytest.mark.parametrize("variant", ["split", "situ"])
def test_variants_at_every_tiling_and_split(gen, variant):
    """Every tile height (R = 128: half tiles of 64 rows) and cluster size: bitwise the plain
    kernel at that config."""
    from k3compile.kernels import situ_gate_up

    m, n, k = 13, 1088, 1032  # I = 544: 17 half tiles of 32 rows (R = 128 refused: 544 % 64)
    x, w = make_inputs(gen, m, n, k)
    tried = 0
    for cfg in _config_variants(n, k, kernel.bucket(m)):
        plain = kernel.gemm_tc_cuda(x, w, out=poisoned(m, n, dtype=torch.float32), cfg=cfg)
        if variant == "split":
            got = kernel.gemm_tc_split_cuda(x, w, 333, out=poisoned(m, 333, dtype=torch.float32),
                                            out2=poisoned(m, n - 333), cfg=cfg)
            assert torch.equal(got[0], plain[:, :333]), cfg
            assert torch.equal(got[1], plain[:, 333:].bfloat16()), cfg
        elif (n // 2) % (cfg.tile_rows // 2) == 0:
            got = kernel.gemm_tc_situ_cuda(x, w, BETA, LINEAR_BETA, out=poisoned(m, n // 2),
                                           cfg=cfg)
            want = situ_gate_up.situ_cuda(plain.bfloat16(), BETA, LINEAR_BETA)
            assert torch.equal(got, want), cfg
        else:
            continue
        tried += 1
    assert tried >= 4
    if variant == "situ":  # R = 128 at I = 384 (6 half tiles of 64)
        x, w = make_inputs(gen, m, 2 * SHARED, HIDDEN)
        for splits in (1, 2, 4, 8):
            cfg = kernel.Config(128, 16, 4, splits)
            plain = kernel.gemm_tc_cuda(x, w, out=poisoned(m, 2 * SHARED), cfg=cfg)
            got = kernel.gemm_tc_situ_cuda(x, w, BETA, LINEAR_BETA, out=poisoned(m, SHARED),
                                           cfg=cfg)
            assert torch.equal(got, situ_gate_up.situ_cuda(plain, BETA, LINEAR_BETA)), cfg


@on_gpu
def test_variants_fall_back_on_refused_inputs(gen, caplog):
    x, w = make_inputs(gen, 8, 1000, 1032)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        a = kernel.gemm_tc_situ_cuda(x, w, BETA, LINEAR_BETA)  # I = 500: no whole half tiles
        logits, z = kernel.gemm_tc_split_cuda(x, w, 1000)  # nothing past the split
    assert "gemm_tc_situ" in caplog.text and "gemm_tc_split" in caplog.text
    gate, up = kernel.gemm_ref(x, w).split(500, dim=-1)
    assert torch.equal(a, situ_ref(gate, up, BETA, LINEAR_BETA))
    assert torch.equal(logits, kernel.gemm_ref(x, w, out_dtype=torch.float32))
    assert z.shape == (8, 0)


# GPU: the norm variant against the two launches at the same config and the reference

# the latent up-projection at 2-32 rows (64 rows of x̂ do not fit in shared memory); a partial
# tile and K slice up to 64 rows
NORMS = [(HIDDEN, LATENT, m) for m in (2, 8, 16, 32)] + [(1000, 1032, m) for m in (2, 8, 64)]


def _norm_config(x, w, g, m):
    """`config()` where the norm prologue takes it, else the first of `configs()` that it takes
    (at 32 rows of [7168, 3584]: R = 128, S = 2)."""
    n, k = w.shape
    cfg = kernel.config(n, k, kernel.bucket(m), kernel.NORM)
    if kernel.norm_refusal(x, w, g, cfg):
        cfg = next(c for c in kernel.configs(n, k, kernel.bucket(m))
                   if kernel.norm_refusal(x, w, g, c) is None)
    return cfg


@on_gpu
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n,k,m", NORMS, ids=str)
def test_norm_variant(gen, n, k, m, residual):
    """One launch against the rms_norm kernel + the plain kernel at the same config (the two
    launches): bitwise (rstd summed in the rms_norm kernel's order at these rows, x̂ rounded as
    it rounds it, then the same sums); and against rms_norm_ref + an fp32 GEMM."""
    from k3compile.kernels.rms_norm import rms_norm_cuda

    from k3compile.ops.rms_norm import rms_norm_ref

    x, w = make_inputs(gen, m, n, k)
    x = (3 * x.float()).bfloat16()
    g = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).bfloat16()
    r = torch.randn(m, n, generator=gen, device="cuda").bfloat16() if residual else None
    cfg = _norm_config(x, w, g, m)
    out = poisoned(m, n)
    assert kernel.gemm_tc_norm_cuda(x, g, w, EPS, r, out=out, cfg=cfg) is out, "fell back"
    assert_written(out)
    two = kernel.gemm_tc_cuda(rms_norm_cuda(x, g, EPS), w, r, out=poisoned(m, n), cfg=cfg)
    assert torch.equal(out, two)
    close_bf16(out, gemm_model(rms_norm_ref(x, g, EPS), w, r))
    again = kernel.gemm_tc_norm_cuda(x, g, w, EPS, r, out=poisoned(m, n), cfg=cfg)
    assert torch.equal(again, out), "not deterministic"


@on_gpu
def test_norm_variant_fp32_output_and_every_tiling(gen):
    """fp32 output, and every tile height and cluster size within the re-read limit: bitwise
    the two launches at that config."""
    from k3compile.kernels.rms_norm import rms_norm_cuda

    m, n, k = 5, 1000, 1032
    x, w = make_inputs(gen, m, n, k)
    g = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).bfloat16()
    xn = rms_norm_cuda(x, g, EPS)
    tried = 0
    for cfg in _config_variants(n, k, kernel.bucket(m)):
        if kernel.norm_refusal(x, w, g, cfg):
            continue
        got = kernel.gemm_tc_norm_cuda(x, g, w, EPS, out=poisoned(m, n, dtype=torch.float32),
                                       cfg=cfg)
        want = kernel.gemm_tc_cuda(xn, w, out=poisoned(m, n, dtype=torch.float32), cfg=cfg)
        assert torch.equal(got, want), cfg
        tried += 1
    assert tried >= 3


@on_gpu
def test_norm_variant_falls_back_above_the_reread_limit(gen, caplog):
    """64 rows of [7168, 3584] at the heuristic config (S·M/R = 2): refused, logged, torch."""
    from k3compile.ops.rms_norm import rms_norm_ref

    x, w = make_inputs(gen, 64, HIDDEN, LATENT)
    g = (1 + 0.1 * torch.randn(LATENT, generator=gen, device="cuda")).bfloat16()
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        y = kernel.gemm_tc_norm_cuda(x, g, w, EPS)
    assert "gemm_tc_norm" in caplog.text and "norm prologue" in caplog.text
    assert torch.equal(y, kernel.gemm_ref(rms_norm_ref(x, g, EPS), w))
