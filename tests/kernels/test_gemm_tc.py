"""gemm_tc kernel (y = x · Wᵀ [+ r], M <= 64, tensor cores) at one K3 TP16 rank's weight shapes
for every batch bucket, rows between buckets (rows past M untouched), an odd aligned shape, every
split-K cluster size and tile height, the fp32 router output, the residual epilogue, strided
operands, determinism, and the torch fallback of refused inputs (GPU); refusals and configs on
any machine."""

import json
import logging
from pathlib import Path

import pytest
import torch
from k3compile.kernels.common import gemm_tc as kernel

from tests.kernel_checks import (
    TOL,
    check_gemm,
    gemm_inputs,
    gemm_model,
    on_gpu,
    poisoned,
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
    x, w = make_inputs(gen, 64, 7168, 3584)  # cuBLAS measured faster: the table says so
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
