"""CuTe DSL tensor-core skinny GEMM for decode batches (sm_90a): y = x · Wᵀ [+ r] at M = 2..64.

    y[m, n] = out(Σ_k x[m, k] · W[n, k] + r[m, n])      (bf16 products, fp32 sums, one rounding)

TMA + wgmma "swap AB" (W's rows on the MMA's M side), split-K over a cluster summed through
distributed shared memory in a fixed order (deterministic). The router (`router.linear`) takes it
at GEMV_MAX_M < M <= 64 where the tuned table (gemm_tc_tuned.json, `benchmarks/gemm_tc.py
--table`) has it faster than cuBLAS and K3_KERNELS_SKIP does not name gemm_tc; shapes not in the
table take `heuristic_config`. Design and measurements: docs/kernels.md, gemm_tc.

Constraints:
    * x bf16 [M, K], 1 <= M <= 64 (buckets 2, 4, 8, 16, 32, 64; more rows go to cuBLAS), last dim
      contiguous, row stride a multiple of 8 elements, 16-byte-aligned data; W bf16 [N, K] likewise;
      K % 8 == 0 (a partial last K slice is zero-filled), 64 <= K <= 65536; N >= 1.
    * Output bf16 (default) or fp32 [M, N], last dim contiguous; optional residual r bf16 [M, N],
      last dim contiguous, added in fp32 before the rounding.
    * With PDL (settings.KERNELS.pdl): the first stages' W slices are fetched before
      `griddepcontrol.wait`; x, the residual and every store after it.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .dsl import (
    compile_kernel,
    fake_rows,
    fake_stream,
)
from .gemm import gemm_ref, gemm_refusal, load_tuned, run_gemm
from .launch import Kernel

OP = "gemm_tc"
BUCKETS = (2, 4, 8, 16, 32, 64)
MAX_M = BUCKETS[-1]
SMS = 132  # H200
SMEM_BYTES = 227 * 1024  # per CTA on sm_90
TILE_K = 64  # one 128-byte swizzle row of bf16
THREADS = 128  # one warpgroup


@dataclass(frozen=True)
class Config:
    tile_rows: int  # R: rows of W per CTA (the MMA's M): 64 or 128
    tile_tokens: int  # the MMA's N: the bucket rounded up to 8
    stages: int  # K slices in flight per CTA
    splits: int  # S: CTAs (one cluster) sharing a row tile's K range: 1, 2, 4 or 8

    threads = THREADS


def bucket(m: int) -> int:
    return next((b for b in BUCKETS if m <= b), BUCKETS[-1])


TABLE = Path(__file__).with_name("gemm_tc_tuned.json")


@functools.cache
def tuned() -> dict[tuple[int, int, int], Config | None]:
    """The measured winners, {(N, K, bucket): the fastest config, or None where cuBLAS was
    faster}, from `TABLE` (written by `benchmarks/gemm_tc.py --table`; `load_tuned`)."""
    return load_tuned(TABLE, OP, lambda c: Config(**c))


def prefers(n: int, k: int, m: int) -> bool:
    """Whether this kernel beats cuBLAS at [m, k] x [n, k]: as measured where the table has the
    shape, else assumed (the heuristic config)."""
    return tuned().get((n, k, bucket(m)), True) is not None


def config(n: int, k: int, m_bucket: int) -> Config:
    """The tuned config (`tuned()`) where measured, else `heuristic_config`."""
    return tuned().get((n, k, m_bucket)) or heuristic_config(n, k, m_bucket)


def heuristic_config(n: int, k: int, m_bucket: int) -> Config:
    """What the sweeps at the TP16 shapes (M = 8 and 64, 2026-11-29) found best: R = 64 rows at
    every bucket (R = 128 halves x's L2 re-reads but lost everywhere); S from `_splits`; 4
    stages once there is more than one CTA per SM (deeper pipelines lost there), else all of a
    CTA's K slices up to 16 within ~200 KB of shared memory (more bytes in flight per SM)."""
    rows, tokens, kt = 64, _tile_tokens(m_bucket), -(-k // TILE_K)
    tiles = -(-n // rows)
    splits = _splits(tiles, kt)
    deep = 200 * 1024 // ((rows + tokens) * TILE_K * 2)
    stages = 4 if tiles * splits > SMS else min(deep, 16)
    return Config(rows, tokens, max(2, min(stages, -(-kt // splits))), splits)


def _splits(tiles: int, k_tiles: int) -> int:
    """The smallest K split (1, 2, 4, 8: a portable cluster) giving >= 1.5 CTAs per SM (the
    sweeps: 2 per SM was one split too many), keeping >= 2 K slices per CTA (a pipeline at all)."""
    fits = [s for s in (1, 2, 4, 8) if s == 1 or 2 * s <= k_tiles]
    return next((s for s in fits if 2 * tiles * s >= 3 * SMS), fits[-1])


def configs(n: int, k: int, m_bucket: int) -> list[Config]:
    """Every config worth timing at these sizes (for sweeps)."""
    tokens, kt = _tile_tokens(m_bucket), -(-k // TILE_K)
    out = []
    for rows in (64, 128):
        for splits in (1, 2, 4, 8):
            if splits > kt:
                continue
            for stages in (2, 4, 8, 16):
                cfg = Config(rows, tokens, min(stages, max(2, -(-kt // splits))), splits)
                if cfg not in out and smem_bytes(cfg) <= SMEM_BYTES:
                    out.append(cfg)
    return out


def _tile_tokens(m_bucket: int) -> int:
    return max(8, -(-m_bucket // 8) * 8)


def _partial_stride(cfg: Config) -> int:
    # fp32 partial tile [R, tokens] with columns R + 4 apart: the MMA fragments' stores (8 rows x
    # 4 column pairs per warp) then fall in 32 distinct banks
    return cfg.tile_rows + 4


def _w_buffer_elems(cfg: Config) -> int:
    """bf16 elements of the W stages, large enough to hold the fp32 partial tile afterwards."""
    return max(cfg.stages * cfg.tile_rows * TILE_K, 2 * cfg.tile_tokens * _partial_stride(cfg))


def smem_bytes(cfg: Config) -> int:
    return 2 * (_w_buffer_elems(cfg) + cfg.stages * cfg.tile_tokens * TILE_K) + 2048 + \
        16 * cfg.stages


def can_implement(x, w, residual=None, *, out_dtype=None) -> bool:
    return refusal(x, w, residual, out_dtype=out_dtype) is None


def refusal(x, w, residual=None, *, out_dtype=None) -> str | None:
    """Why the kernel cannot take these inputs, or None. Metadata only (fake tensors work); data
    alignment is checked at launch."""
    return gemm_refusal(x, w, residual, out_dtype, max_m=MAX_M, min_k=TILE_K)


def prepare(n: int, k: int, buckets=BUCKETS, *, out_dtype=torch.bfloat16,
            residual: bool = False) -> None:
    """Compile the kernel of every batch bucket for this weight (call before graph capture)."""
    for b in buckets:
        KERNEL.compiled(n, k, out_dtype == torch.float32, residual, config(n, k, b), rows=b)


def build(n, k, out_fp32, residual, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from ..device.gemm_tc import GemmTC

    bf16, m = cutlass.BFloat16, cute.sym_int()

    def out_rows(dtype):  # [M, N] rows with any row stride
        return make_fake_tensor(dtype, (m, n), stride=(cute.sym_int64(), 1),
                                assumed_align=dtype.width // 8)

    return compile_kernel(
        GemmTC(n, k, cfg, out_fp32, residual, pdl),
        fake_rows(bf16, m, k), fake_rows(bf16, n, k),
        out_rows(bf16) if residual else None,
        out_rows(cutlass.Float32 if out_fp32 else bf16), fake_stream(), arch=arch,
        dump_dir=dump_dir)


# Buckets with one config share a build (the bucket is not in the key)
KERNEL = Kernel(OP, build)


def linear_tc(x, w, residual=None, out_dtype=None):
    """y = x · wᵀ [+ residual] for x [M, K]: the kernel where it takes the inputs (M <= 64 on a
    GPU), torch (`gemm_ref`: cuBLAS) otherwise."""
    if x.dim() == 2 and x.is_cuda and can_implement(x, w, residual, out_dtype=out_dtype):
        return gemm_tc_cuda(x, w, residual, out_dtype=out_dtype)
    return gemm_ref(x, w, residual, out_dtype)


def gemm_tc_cuda(x, w, residual=None, *, out=None, out_dtype=None, cfg: Config | None = None):
    """y = x · wᵀ [+ residual] with the kernel, or with torch when it refuses the inputs
    (`gemm.run_gemm`). `cfg` overrides `config()` (sweeps)."""
    def launch(y, dtype):
        (m, k), n = x.shape, w.shape[0]
        b = bucket(m)
        chosen = cfg or config(n, k, b)
        if chosen.tile_tokens < m:
            raise ValueError(f"{chosen} holds {chosen.tile_tokens} tokens, not {m}")
        KERNEL.compiled(n, k, dtype == torch.float32, residual is not None, chosen, rows=b)(
            x, w, residual, y)

    return run_gemm(KERNEL, refusal, launch, x, w, residual, out, out_dtype)
