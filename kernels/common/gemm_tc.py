"""CuTe DSL tensor-core skinny GEMM for decode batches (sm_90a): y = x · Wᵀ [+ r] at M = 2..64.

    y[m, n] = out(Σ_k x[m, k] · W[n, k] + r[m, n])      (bf16 products, fp32 sums, one rounding)

TMA + wgmma "swap AB" (W's rows on the MMA's M side), split-K over a cluster summed through
distributed shared memory in a fixed order (deterministic). The router (`router.linear`) takes it
at GEMV_MAX_M < M <= 64 where the tuned table (gemm_tc_tuned.json, `benchmarks/gemm_tc.py
--table`) has it faster than cuBLAS and K3_KERNELS_SKIP does not name gemm_tc; shapes not in the
table take `heuristic_config`. One-launch variants (`Fusion`, compile-time, from a second entry
`GemmTC.fused` so the plain build is unchanged), taken by the composites where
settings.KERNELS.gemm_tc_fused names them (opt-in) and `router.linear` would run this kernel:
    split (moe_front):     W = [W_r; W_d]; rows < split to y (fp32), the others to y2 (bf16)
    situ  (situ_gate_up):  W = [W_g; W_u]; y[m, n] = bf16(SiTU(bf16(g), bf16(u)))
    norm  (norm_linear):   y = Σ_k W[n, k] · x̂[m, k] [+ r],  x̂ = bf16(g_k · bf16(x · rstd_m)),
                           rstd_m = rsqrt(Σ_k x[m, k]² / K + eps) (x̂ of the CTA's K range
                           written once into shared memory; the pipeline streams W alone)
Each sum is the plain kernel's over the same W at the same config, bit for bit (norm: over x̂,
the rms_norm kernel's bit for bit: rstd sums x² in its order at those rows, K <= 32768).
Design and measurements: docs/kernels.md, gemm_tc.

Constraints:
    * x bf16 [M, K], 1 <= M <= 64 (buckets 2, 4, 8, 16, 32, 64; more rows go to cuBLAS), last dim
      contiguous, row stride a multiple of 8 elements, 16-byte-aligned data; W bf16 [N, K] likewise;
      K % 8 == 0 (a partial last K slice is zero-filled), 64 <= K <= 65536; N >= 1.
    * Output bf16 (default) or fp32 [M, N], last dim contiguous; optional residual r bf16 [M, N],
      last dim contiguous, added in fp32 before the rounding.
    * Variants: no residual; split: 0 < split < N, y fp32 [M, split], y2 bf16 [M, N - split];
      SiTU: N = 2I, I a multiple of R/2 (a tile's R rows are R/2 of W_g and the same R/2 of W_u:
      32 rows, or 64 where the config has R = 128 and I allows it), bf16 output [M, I], β and
      β₂ runtime scalars; norm: norm weight bf16 [K] contiguous, eps a runtime scalar, residual
      allowed, S·M <= NORM_MAX_REREAD·R (each CTA re-reads all of x from L2 for rstd), x̂ of
      the CTA's K range resident (tile tokens x ceil(K/64/S)·64 bf16) within SMEM_BYTES.
    * With PDL (settings.KERNELS.pdl): the first stages' W slices are fetched before
      `griddepcontrol.wait`; x, the residual, the norm weight and every store after it.
"""

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from k3compile.math import situ as situ_ref
from k3compile.ops.rms_norm import rms_norm_ref
from k3compile.settings import KERNELS

from .dsl import (
    compile_kernel,
    fake_rows,
    fake_stream,
    fake_vector,
    fallback,
    pdl_enabled,
    runtime_refusal,
    unaligned16,
)
from .gemm import gemm_ref, gemm_refusal, load_tuned, outs_refusal, run_gemm, run_split
from .launch import Kernel

OP = "gemm_tc"
BUCKETS = (2, 4, 8, 16, 32, 64)
MAX_M = BUCKETS[-1]
# The composites take the one-launch variants at most at these rows. On the H200 (session 22,
# one machine start, k3 yardstick, split + SiTU against the two launches each): B8 153.3 against
# 171.2 µs per layer, B64 559.3 against 552.2. At 16 and 32 rows (H100, session 24,
# `benchmarks/gemm_tc.py --fused`): split x1.15 / x1.14, SiTU x1.63 / x1.62 the two launches.
FUSED_MAX_M = 32
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


@dataclass(frozen=True)
class Fusion:
    """What one launch does in the epilogue (compile-time; at most one of them)."""
    situ: bool = False  # SiTU-GLU of rows n and I + n of W = [W_g; W_u] (situ_gate_up)
    split: int = 0  # rows < split to the first output (fp32), the others to a second (moe_front)
    norm: bool = False  # RMSNorm of x, x̂ resident in shared memory before the MMAs (norm_linear)


PLAIN, SITU, NORM = Fusion(), Fusion(situ=True), Fusion(norm=True)
# The norm prologue: every CTA reads all M rows of x (M·K·2 bytes, from L2) for rstd, so a
# launch re-reads tiles·S·M·K·2 bytes against W's N·K·2 = tiles·R·K·2 from HBM: a ratio S·M/R.
# Refused above 1/2 (docs/kernels.md, gemm_tc, session 21: norm prologue).
NORM_MAX_REREAD = 0.5


def norm_rms_config(k: int, tokens: int):
    """The rms_norm kernel's config (threads, vectors per thread: its summation order) at the
    rows a tile of `tokens` serves: its batch buckets <= 8 share one, larger ones another; the
    norm prologue sums x² as it does, so x̂ is the rms_norm kernel's bit for bit."""
    from ..rms_norm import config as rms_config

    return rms_config(k, max(8, tokens))


def norm_weight_vectors(cfg: Config, k: int) -> int:
    """16-byte vectors of the norm weight that one CTA's K slices span (the most any split
    gets: an even share of the K tiles, rounded up)."""
    k_tiles = -(-k // TILE_K)
    return -(-k_tiles // cfg.splits) * (TILE_K // 8)


def norm_smem_bytes(cfg: Config, k: int) -> int:
    """Shared memory of the norm prologue besides `smem_bytes`: x̂ of all the CTA's K slices
    resident in place of the x stages, rstd and the rms_norm kernel's warp totals of each token
    (fp32), the norm weight of the CTA's K slices (bf16), three 16-byte alignments."""
    resident = norm_weight_vectors(cfg, k) // (TILE_K // 8) - cfg.stages
    return (2 * resident * cfg.tile_tokens * TILE_K +
            4 * cfg.tile_tokens * (1 + norm_rms_config(k, cfg.tile_tokens).threads // 32) +
            16 * norm_weight_vectors(cfg, k) + 48)


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


def config(n: int, k: int, m_bucket: int, fusion: Fusion = PLAIN) -> Config:
    """The tuned config (`tuned()`) where measured, else `heuristic_config`; with SiTU R = 64
    where I = N/2 is not a multiple of R/2 = 64 (a tile holds R/2 gate and R/2 up rows)."""
    cfg = tuned().get((n, k, m_bucket)) or heuristic_config(n, k, m_bucket)
    if fusion.situ and cfg.tile_rows > 64 and (n // 2) % (cfg.tile_rows // 2):
        return dataclasses.replace(cfg, tile_rows=64)  # fewer bytes of shared memory
    if fusion.norm:
        return norm_stages(cfg, k)
    return cfg


@functools.cache  # config() runs at every launch: the search once per (config, K)
def norm_stages(cfg: Config, k: int) -> Config:
    """The norm prologue's config: `cfg` with as many W stages as keep two CTAs per SM beside
    x̂ (the x stages' bytes are free there), at most the CTA's K slices. The W slices in flight
    before the PDL wait stream while the prologue runs (it waits on x's loads twice: rstd, then
    x̂). The stage count changes no sum: the results stay the plain kernel's at `cfg`."""
    slices = norm_weight_vectors(cfg, k) // (TILE_K // 8)
    budget = SMEM_BYTES // 2 - 1024  # two CTAs per SM, each with the 1 KB the runtime reserves

    def total(stages):
        c = dataclasses.replace(cfg, stages=stages)
        return smem_bytes(c) + norm_smem_bytes(c, k)

    best = cfg.stages
    for stages in range(cfg.stages + 1, slices + 1):
        if total(stages) <= budget:
            best = stages
    return dataclasses.replace(cfg, stages=best)


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


def fused_refusal(fusion: Fusion, x, w, residual=None, *, norm_weight=None, out_dtype=None,
                  cfg: Config | None = None) -> str | None:
    """Why the one-launch variant `fusion` cannot take these inputs, or None (metadata only; a
    residual with the norm prologue only; `cfg` overrides `config()`)."""
    if residual is not None and not fusion.norm:
        return "a residual with the split or SiTU epilogue"
    if reason := refusal(x, w, residual, out_dtype=out_dtype):
        return reason
    (m, k), n = x.shape, w.shape[0]
    if fusion.norm:
        return norm_refusal(x, w, norm_weight, cfg)
    if fusion.split and not 0 < fusion.split < n:
        return f"split at row {fusion.split} of {n} (want 0 < split < N)"
    if fusion.situ:
        if n % 2 or out_dtype not in (None, torch.bfloat16):
            return (f"SiTU epilogue: w [{n}, {k}], output {out_dtype} (want [W_g; W_u] with an "
                    "even row count, bf16)")
        half = config(n, k, bucket(m), fusion).tile_rows // 2
        if (n // 2) % half:
            return (f"SiTU epilogue: I = {n // 2} rows of W_g, not a multiple of {half} (half a "
                    "row tile: a tile holds the same rows of W_g and W_u)")
    return None


def norm_refusal(x, w, g, cfg: Config | None = None) -> str | None:
    """The norm prologue's own limits: the norm weight, and the L2 re-read of x (S·M/R above
    NORM_MAX_REREAD at `cfg` or `config()`)."""
    (m, k), n = x.shape, w.shape[0]
    if g is None or g.dtype != torch.bfloat16 or tuple(g.shape) != (k,) or g.stride(0) != 1:
        what = "none" if g is None else f"{g.dtype} {tuple(g.shape)} {g.stride()}"
        return f"norm weight: {what} (want contiguous bf16 [{k}])"
    cfg = cfg or config(n, k, bucket(m), NORM)
    if cfg.splits * m > NORM_MAX_REREAD * cfg.tile_rows:
        return (f"norm prologue: {cfg.splits} CTAs x {m} rows of x re-read per {cfg.tile_rows} "
                f"rows of W (S·M/R above {NORM_MAX_REREAD})")
    if (need := smem_bytes(cfg) + norm_smem_bytes(cfg, k)) > SMEM_BYTES:
        return (f"norm prologue: {cfg} needs {need} bytes of shared memory (x̂ of "
                f"{cfg.tile_tokens} tokens x {k // cfg.splits} columns resident; at most "
                f"{SMEM_BYTES})")
    return None


def fused_launch_refusal(fusion: Fusion, x, w, residual=None, *, norm_weight=None,
                         out_dtype=None, outs=(), cfg: Config | None = None) -> str | None:
    """Why the variant cannot run this call now: no runtime, `fused_refusal`, not on a GPU,
    unaligned data, or an output buffer (`outs`: (buffer or None, shape, dtype) each) unfit."""
    return (runtime_refusal() or fused_refusal(fusion, x, w, residual, norm_weight=norm_weight,
                                               out_dtype=out_dtype, cfg=cfg)
            or (None if x.is_cuda and w.is_cuda else "not on a CUDA device")
            or unaligned16(x, w, *([norm_weight] if fusion.norm else []))
            or outs_refusal(outs))


def prepare(n: int, k: int, buckets=BUCKETS, *, out_dtype=torch.bfloat16,
            residual: bool = False, fusion: Fusion = PLAIN) -> None:
    """Compile the kernel of every batch bucket for this weight (call before graph capture);
    `fusion`: a one-launch variant's (fp32 first output with a split, bf16 with SiTU; the norm
    prologue as the plain kernel, with or without a residual)."""
    variant = {} if fusion == PLAIN else {"fusion": fusion}
    out_fp32 = bool(fusion.split) or (out_dtype == torch.float32 and not fusion.situ)
    residual = residual and (fusion == PLAIN or fusion.norm)
    for b in buckets:
        KERNEL.compiled(n, k, out_fp32, residual, config(n, k, b, fusion), rows=b, **variant,
                        **trigger_option(n, k, b))


def build(n, k, out_fp32, residual, cfg, arch=None, dump_dir=None, pdl=False, fusion=PLAIN,
          late_trigger=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL; `fusion`:
    a one-launch variant, compiled from its own entry `GemmTC.fused` so that the plain kernel
    stays as it was; `late_trigger`: with PDL, the next kernel launches after the K loops)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from ..device.gemm_tc import GemmTC

    bf16, f32, m = cutlass.BFloat16, cutlass.Float32, cute.sym_int()

    def out_rows(dtype, width=n):  # [M, width] rows with any row stride
        return make_fake_tensor(dtype, (m, width), stride=(cute.sym_int64(), 1),
                                assumed_align=dtype.width // 8)

    gemm = GemmTC(n, k, cfg, out_fp32, residual, pdl, fusion, late_trigger)
    x, w = fake_rows(bf16, m, k), fake_rows(bf16, n, k)
    if fusion == PLAIN:
        return compile_kernel(gemm, x, w, out_rows(bf16) if residual else None,
                              out_rows(f32 if out_fp32 else bf16), fake_stream(), arch=arch,
                              dump_dir=dump_dir)
    if fusion.norm:
        return compile_kernel(gemm.normed, x, w, out_rows(bf16) if residual else None,
                              out_rows(f32 if out_fp32 else bf16), fake_vector(bf16, k),
                              f32(1e-5), fake_stream(), arch=arch, dump_dir=dump_dir)
    split, situ = fusion.split, fusion.situ
    return compile_kernel(
        gemm.fused, x, w, out_rows(f32 if split else bf16, split or n // 2),
        out_rows(bf16, n - split) if split else None, f32(4.0) if situ else None,
        f32(25.0) if situ else None, fake_stream(), arch=arch, dump_dir=dump_dir)


def trigger_option(n: int, k: int, rows: int) -> dict[str, bool]:
    """The build option of K3_GEMM_TC_LATE_TRIGGER (`settings.KERNELS.gemm_tc_late_trigger_mb`)
    for a bf16 weight [n, k] launched for `rows` rows: empty where the trigger stays at the start
    or the launch has no PDL, so those builds keep their keys."""
    mb = KERNELS.gemm_tc_late_trigger_mb
    late = mb is not None and 2 * n * k >= mb * 1e6 and pdl_enabled(rows)
    return {"late_trigger": True} if late else {}


# Buckets with one config share a build (the bucket is not in the key); a variant's key holds
# its fusion (the plain build's key is as before the variants)
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
        KERNEL.compiled(n, k, dtype == torch.float32, residual is not None, chosen, rows=b,
                        **trigger_option(n, k, b))(x, w, residual, y)

    return run_gemm(KERNEL, refusal, launch, x, w, residual, out, out_dtype)


# ---- the one-launch variants of the composites ---------------------------------------------------

# K3_GEMM_TC_FUSED (settings.KERNELS.gemm_tc_fused): which composites take their one-launch
# variant where `router.linear` would run this kernel (`router.tc_fused_takes`).


def fused_ok(name: str, reason: str | None) -> bool:
    """A composite's choice: True (one launch) where the variant takes the call; its refusal
    is logged and the composite runs its two launches."""
    if reason:
        fallback(f"gemm_tc_{name}", f"{reason}; two launches")
    return reason is None


def _launch(fusion: Fusion, x, w, out_fp32: bool, *rest, cfg: Config | None = None,
            residual: bool = False):
    (m, k), n = x.shape, w.shape[0]
    if m:
        b = bucket(m)
        chosen = cfg or config(n, k, b, fusion)
        if chosen.tile_tokens < m:
            raise ValueError(f"{chosen} holds {chosen.tile_tokens} tokens, not {m}")
        if fusion.situ and (n // 2) % (chosen.tile_rows // 2):
            raise ValueError(f"{chosen}: I = {n // 2} is not a multiple of half its tile")
        KERNEL.compiled(n, k, out_fp32, residual, chosen, rows=b, fusion=fusion,
                        **trigger_option(n, k, b))(x, w, *rest)


def gemm_tc_split_cuda(x, w, split, *, out=None, out2=None, cfg: Config | None = None):
    """(x · w[:split]ᵀ in fp32, x · w[split:]ᵀ in bf16) in one launch (k3::moe_front over the
    packed [W_r; W_d]): the plain kernel's sums over w at the same config, stored as two calls
    would; torch (reason logged) when refused. `cfg` overrides `config()` (tests)."""
    fusion = Fusion(split=split)
    return run_split(
        KERNEL, lambda outs: fused_launch_refusal(fusion, x, w, out_dtype=torch.float32, outs=outs),
        lambda y, y2: _launch(fusion, x, w, True, y, y2, None, None, cfg=cfg),
        x, w, split, out, out2, op="gemm_tc_split")


def gemm_tc_situ_cuda(x, w, beta, linear_beta, *, out=None, cfg: Config | None = None):
    """a = bf16(SiTU(bf16(x · W_gᵀ), bf16(x · W_uᵀ))) for w = [W_g; W_u] [2I, K]
    (k3::situ_gate_up) in one launch: the GEMM output rounded as the two-launch path stores
    it, then the situ kernel's math; torch (reason logged) when refused. `cfg` overrides
    `config()` (tests)."""
    width = w.shape[0] // 2

    def reference():
        gate, up = gemm_ref(x, w).split(width, dim=-1)
        return situ_ref(gate, up, beta, linear_beta)

    def launch():
        y = x.new_empty((len(x), width)) if out is None else out
        _launch(SITU, x, w, False, y, None, float(beta), float(linear_beta), cfg=cfg)
        return y

    return KERNEL.run(
        lambda: fused_launch_refusal(SITU, x, w, outs=[(out, (len(x), width), torch.bfloat16)]),
        reference, launch, op="gemm_tc_situ")


def gemm_tc_norm_cuda(x, norm_weight, w, eps, residual=None, *, out=None, out_dtype=None,
                      cfg: Config | None = None):
    """y = RMSNorm(x; norm_weight, eps) · wᵀ [+ residual] (k3::norm_linear) in one launch: each
    CTA computes rstd of every row (summed as the rms_norm kernel sums it), writes x̂ =
    bf16(g · bf16(x · rstd)) of its K range into shared memory once, then the plain kernel's
    sums (the pipeline streaming W alone) and
    epilogue: the two launches (rms_norm kernel, gemm_tc at the same config) bit for bit; torch
    (reason logged) when refused. `cfg` overrides `config()` (tests)."""
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else x.dtype
    m, n = len(x), w.shape[0]

    def launch():
        y = x.new_empty((m, n), dtype=out_dtype) if out is None else out
        _launch(NORM, x, w, out_dtype == torch.float32, residual, y, norm_weight, float(eps),
                cfg=cfg, residual=residual is not None)
        return y

    return KERNEL.run(
        lambda: fused_launch_refusal(NORM, x, w, residual, norm_weight=norm_weight,
                                     out_dtype=out_dtype, outs=[(out, (m, n), out_dtype)],
                                     cfg=cfg),
        lambda: gemm_ref(rms_norm_ref(x, norm_weight, eps), w, residual, out_dtype), launch,
        op="gemm_tc_norm")
