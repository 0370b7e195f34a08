"""CuTe DSL weight-streaming skinny GEMM ("GEMV") for decode: y = x · Wᵀ [+ r] at M <= 16 rows.

    y[m, n] = out(Σ_k x[m, k] · W[n, k] + r[m, n])      (fp32 products and sums, one rounding)

CUDA cores only; compiled per batch bucket (1, 2, 4, 8, 16); the router (`router.linear`) takes
it at M <= GEMV_MAX_M. One-launch variants (`Fusion`, compile-time, from a second entry
`Gemv.fused` so the plain build is unchanged), taken by the fused ops where
settings.KERNELS.gemv_fused names them:
    norm  (norm_linear):   y = Σ_k W[n, k] · x̂[m, k] [+ r],  x̂ = bf16(g · bf16(x · rstd_m))
    situ  (situ_gate_up):  W = [W_g; W_u]; y[m, n] = bf16(SiTU(bf16(g), bf16(u)))
    split (moe_front):     W = [W_r; W_d]; rows < split to y (fp32), the others to y2 (bf16)
    gate  (mla_uv_gate):   W [H, V, K]; row n = h·V + v reads x's columns [h·K, (h + 1)·K);
                           y = bf16(bf16(Σ) · bf16(sigmoid(g[m, n])))
Each row's sum is the plain kernel's bit for bit at the same T (threads per CTA): its order
depends on K and T only. Configs (R rows per block, T, C persistent CTAs per SM): the tuned table
gemv_tuned.json (`benchmarks/gemv.py --sweep`) where it has the shape and bucket, else
`heuristic_config`. Design and measurements: docs/kernels.md, gemv.

Constraints:
    * x bf16 [M, K], 1 <= M <= 16 (more rows go to cuBLAS), contiguous rows, row stride a
      multiple of 8 elements, 16-byte-aligned data; W bf16 [N, K] likewise (any row stride that
      keeps rows 16-byte aligned); K % 8 == 0, 8 <= K <= 65536; N >= 1 and N rows past a
      multiple of R are predicated off.
    * Output bf16 (default) or fp32 (router logits) [M, N], last dim contiguous; optional residual
      r bf16 [M, N], last dim contiguous, added in fp32 before the rounding.
    * Variants: K <= 16384 with norm or SiTU; norm weight bf16 [K] contiguous; SiTU: N even,
      bf16 output [M, N / 2], no residual; split: 0 < split < N, no residual; gate: W bf16
      [H, V, K] read in place, row h·V + v at h·stride(0) + v·stride(1) (each a multiple of 8
      elements, K contiguous: W_UV inside kv_b's weight), x [M, H·K], g bf16 [M, H·V] with
      contiguous rows, bf16 output, no residual.
    * With PDL (settings.KERNELS.pdl): W of a CTA's first row block (and the norm weight) load
      before `griddepcontrol.wait`; x, the residual, later blocks' W and every store after it.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from k3compile.math import situ as situ_ref
from k3compile.ops.mla_uv_gate import mla_uv_gate_ref
from k3compile.ops.rms_norm import rms_norm_ref
from k3compile.settings import KERNELS

from .dsl import (
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
    fake_vector,
    fallback,
    runtime_refusal,
    unaligned16,
)
from .gemm import (  # noqa: F401  (launch_refusal: the fused ops check their weights with it)
    GEMV_MAX_M,
    MAX_K,
    OUT_DTYPES,
    gemm_ref,
    gemm_refusal,
    launch_refusal,
    load_tuned,
    run_gemm,
    run_split,
)
from .launch import Kernel

OP = "gemv"
BUCKETS = (1, 2, 4, 8, 16)
MAX_M = BUCKETS[-1]
SMS = 132  # H200
MAX_FUSED_K = 16384  # norm prologue, SiTU epilogue: <= 8 more vectors per thread in registers


@dataclass(frozen=True)
class Config:
    rows_per_cta: int  # R: rows of W per row block (a CTA's rows at a time)
    threads: int  # T: 128, 256 or 512 (sets the summation order, with K)
    # C: 0, one CTA per row block; C > 0, a persistent grid of min(blocks, SMS·C) CTAs, each
    # looping over its row blocks with the next block's R·J loads in flight during the math
    ctas_per_sm: int = 0


@dataclass(frozen=True)
class Fusion:
    """What one launch does around the GEMM (compile-time; at most one of them)."""
    norm: bool = False  # RMSNorm prologue on x, weight and eps as operands (norm_linear)
    situ: bool = False  # SiTU-GLU epilogue on rows n and I + n of W = [W_g; W_u] (situ_gate_up)
    split: int = 0  # rows < split to the first output, the others to a second, bf16 (moe_front)
    gate: int = 0  # V: rows per x slice, times sigmoid(g) after rounding (mla_uv_gate)


PLAIN, NORM, SITU = Fusion(), Fusion(norm=True), Fusion(situ=True)


TABLE = Path(__file__).with_name("gemv_tuned.json")


@functools.cache
def tuned() -> dict[tuple[int, int, int], Config]:
    """The sweep's winners {(N, K, bucket): config} from `TABLE` (written by `benchmarks/gemv.py
    --sweep --table`); empty where there is none or it was measured on another GPU."""
    return load_tuned(TABLE, OP, lambda c: Config(**c))


def config(n: int, k: int, m_bucket: int, fusion: Fusion = PLAIN) -> Config:
    """The tuned config of this weight shape and bucket (`tuned()`) where it fits the variant
    (`fits`), else `heuristic_config`."""
    cfg = tuned().get((n, k, m_bucket))
    return cfg if cfg and fits(cfg, k, m_bucket, fusion) else heuristic_config(n, k, m_bucket,
                                                                                fusion)


def heuristic_config(n: int, k: int, m_bucket: int, fusion: Fusion = PLAIN) -> Config:
    """T = 256 for K >= 4096 (fewer passes over a row), else 128. R must fit: at most 16 W
    vectors in flight per thread and at most ~128 registers (two CTAs of 256 per SM; sm_90a
    builds: 4 per W vector and ~3 per accumulator) with >= 4 CTAs per SM. M <= 2 takes the
    smallest such R with >= 4 vectors in flight per thread (the most CTAs: x reuse does not
    matter), larger M the largest (each x vector read from L1 serves R rows). One CTA per row
    block. The SiTU epilogue needs an even R (a CTA pairs gate and up rows); the norm prologue
    holds the norm weight's J vectors and an rstd per row besides."""
    threads = 256 if k >= 4096 else 128
    j = _vec_per_thread(k, threads)
    least = 2 if fusion.situ else 1
    extra = 4 * j + m_bucket if fusion.norm else 0
    fits_ = [r for r in (1, 2, 4, 8) if r % least == 0 and fusion.gate % r == 0 and (
        r == least or (r * j <= 16 and 4 * r * j + 3 * r * m_bucket + extra <= 128
                       and -(-n // r) >= 4 * SMS))]
    if m_bucket <= 2:
        return Config(next((r for r in fits_ if r * j >= 4), fits_[-1]), threads)
    return Config(fits_[-1], threads)


def fits(cfg: Config, k: int, m_bucket: int, fusion: Fusion = PLAIN) -> bool:
    """Whether this config builds for the variant without spilling and with its C CTAs
    resident per SM: an even R with SiTU, R dividing V with the gate, at most 16 W vectors per
    thread (both register sets of a persistent grid), at most 64 accumulators, and `registers`
    within the register file's share (65536 / (T·C), at most 255)."""
    r, least = cfg.rows_per_cta, 2 if fusion.situ else 1
    share = min(255, 65536 // (cfg.threads * max(cfg.ctas_per_sm, 1)))
    return (r % least == 0 and fusion.gate % r == 0 and r * m_bucket <= 64
            and _w_vectors(cfg, k) <= 16 and registers(cfg, k, m_bucket, fusion) <= share)


def configs(n: int, k: int, m_bucket: int) -> list[Config]:
    """Every config worth timing at these sizes (for sweeps): R in 1..8 rows, T in 128..512
    threads (no more threads than a row has vectors), one CTA per row block or a persistent
    grid of 1, 2 or 4 CTAs per SM (where it has fewer CTAs than blocks), each that `fits`."""
    return [Config(r, t, c) for t in (128, 256, 512) for r in (1, 2, 4, 8) for c in (0, 1, 2, 4)
            if (t == 128 or k // 8 >= t) and (c == 0 or -(-n // r) > c * SMS)
            and fits(Config(r, t, c), k, m_bucket)]


def grid_size(blocks: int, cfg: Config) -> int:
    """CTAs of a launch over `blocks` row blocks: one per block, or the persistent grid."""
    return min(blocks, SMS * cfg.ctas_per_sm) if cfg.ctas_per_sm else blocks


def _w_vectors(cfg: Config, k: int) -> int:
    """W vectors a thread holds: R·J, twice that in a persistent grid (the next block's)."""
    return (2 if cfg.ctas_per_sm else 1) * cfg.rows_per_cta * _vec_per_thread(k, cfg.threads)


def registers(cfg: Config, k: int, m_bucket: int, fusion: Fusion = PLAIN) -> int:
    """Registers per thread of an sm_90a build: an upper envelope of 71 builds' counts
    (docs/kernels.md, gemv, 2026-12-03). 4 per W vector, 3 per accumulator and 18 more; a
    persistent grid 12 per W vector of a block, 5 per accumulator and 24 more; the norm
    prologue 4 per norm-weight vector and one rstd per row besides."""
    j, r = _vec_per_thread(k, cfg.threads), cfg.rows_per_cta
    extra = 4 * j + m_bucket if fusion.norm else 0
    if cfg.ctas_per_sm:
        return 12 * r * j + 5 * r * m_bucket + 24 + extra
    return 4 * r * j + 3 * r * m_bucket + 18 + extra


def _vec_per_thread(k: int, threads: int) -> int:
    return -(-(k // 8) // threads)


def can_implement(x, w, residual=None, *, out_dtype=None) -> bool:
    return refusal(x, w, residual, out_dtype=out_dtype) is None


def refusal(x, w, residual=None, *, out_dtype=None) -> str | None:
    """Why the kernel cannot take these inputs, or None. Metadata only (fake tensors work); data
    alignment is checked at launch."""
    return gemm_refusal(x, w, residual, out_dtype, max_m=MAX_M, min_k=8)


def fused_refusal(fusion: Fusion, x, w, residual=None, *, norm_weight=None,
                  out_dtype=None) -> str | None:
    """Why the one-launch variant `fusion` cannot take these inputs, or None (metadata only)."""
    if reason := refusal(x, w, residual, out_dtype=out_dtype):
        return reason
    k, n = x.shape[1], w.shape[0]
    if (fusion.norm or fusion.situ) and k > MAX_FUSED_K:
        return f"K {k} above {MAX_FUSED_K} with a norm prologue or a SiTU epilogue (registers)"
    g = norm_weight
    if fusion.norm and (g is None or g.dtype != torch.bfloat16 or tuple(g.shape) != (k,)
                        or g.stride(0) != 1):
        what = "none" if g is None else f"{g.dtype} {tuple(g.shape)} {g.stride()}"
        return f"norm weight: {what} (want contiguous bf16 [{k}])"
    if fusion.situ and (n % 2 or residual is not None
                        or out_dtype not in (None, torch.bfloat16)):
        return (f"SiTU epilogue: w [{n}, {k}], residual {residual is not None}, output "
                f"{out_dtype} (want [W_g; W_u] with an even row count, no residual, bf16)")
    if fusion.split and not 0 < fusion.split < n:
        return f"split at row {fusion.split} of {n} (want 0 < split < N)"
    if fusion.split and residual is not None:
        return "no residual with a split output"
    return None


def gate_refusal(x, w, g) -> str | None:
    """Why the gate variant cannot take x [M, H·K], w [H, V, K] (any head and row strides that
    keep rows 16-byte aligned: W_UV inside kv_b's weight), g [M, H·V], or None (metadata
    only)."""
    if x.dim() != 2 or w.dim() != 3 or g.dim() != 2:
        return f"x {tuple(x.shape)}, w {tuple(w.shape)}, g {tuple(g.shape)} (want 2-d, 3-d, 2-d)"
    (m, kx), (h, v, k) = x.shape, w.shape
    n = h * v
    if kx != h * k:
        return f"x [{m}, {kx}] / w [{h}, {v}, {k}] are not {h} slices of {v} rows"
    if reason := refusal(x[:, :k], w[0]):
        return reason
    if w.stride(0) % 8:  # the build assumes it, however many heads
        return f"w: strides {w.stride()} (head stride not a multiple of 16 bytes)"
    if k > MAX_FUSED_K:
        return f"K {k} above {MAX_FUSED_K} with the gate epilogue"
    if g.dtype != torch.bfloat16 or tuple(g.shape) != (m, n) or g.stride(-1) != 1:
        return f"gate: {g.dtype} {tuple(g.shape)} {g.stride()} (want bf16 [{m}, {n}], rows)"
    return None


def fused_launch_refusal(fusion: Fusion, x, w, residual=None, *, norm_weight=None,
                         out_dtype=None, outs=()) -> str | None:
    """Why the variant cannot run this call now (as `launch_refusal`); `outs`: (buffer or None,
    its shape, its dtype) of each output."""
    reason = (runtime_refusal() or fused_refusal(fusion, x, w, residual,
                                                 norm_weight=norm_weight, out_dtype=out_dtype)
              or (None if x.is_cuda and w.is_cuda else "not on a CUDA device")
              or unaligned16(x, w, *([norm_weight] if fusion.norm else [])))
    for out, shape, dtype in outs:
        if reason is None and out is not None and (
                out.dtype != dtype or tuple(out.shape) != shape or out.stride(-1) != 1):
            reason = f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
    return reason


def prepare(n: int, k: int, buckets=BUCKETS, *, out_dtype=torch.bfloat16,
            residual: bool = False, fusion: Fusion = PLAIN) -> None:
    """Compile the kernel of every batch bucket for this weight (call before graph capture)."""
    for b in buckets:
        KERNEL.compiled(n, k, b, out_dtype == torch.float32, residual, config(n, k, b, fusion),
                        rows=b, fusion=fusion)


def build(n, k, m_bucket, out_fp32, residual, cfg, arch=None, dump_dir=None, pdl=False,
          fusion=PLAIN):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL; `fusion`:
    the one-launch variant, compiled from its own entry so that the plain kernel stays as it
    was)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from ..device.gemv import Gemv

    bf16, f32, m = cutlass.BFloat16, cutlass.Float32, cute.sym_int()

    def out_rows(dtype, width=n):  # [M, width] rows with any row stride
        return make_fake_tensor(dtype, (m, width), stride=(cute.sym_int64(), 1),
                                assumed_align=dtype.width // 8)

    gemv = Gemv(n, k, m_bucket, cfg, out_fp32, residual, pdl, fusion)
    x, w = fake_rows(bf16, m, k), fake_rows(bf16, n, k)
    r = out_rows(bf16) if residual else None
    y = f32 if out_fp32 else bf16
    if fusion == PLAIN:
        return compile_kernel(gemv, x, w, r, out_rows(y), fake_stream(), arch=arch,
                              dump_dir=dump_dir)
    split, norm, situ, gate = fusion.split, fusion.norm, fusion.situ, fusion.gate
    if gate:  # W [H, V, K] with any 16-byte head and row strides (`Gemv.fused` walks them)
        x = fake_rows(bf16, m, k * (n // gate))
        w = make_fake_tensor(bf16, (n // gate, gate, k), stride=(
            cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1), assumed_align=16)
    g = fake_vector(bf16, k) if norm else out_rows(bf16) if gate else None
    return compile_kernel(
        gemv.fused, x, w, r, out_rows(bf16 if situ else y, n // 2 if situ else split or n),
        out_rows(bf16, n - split) if split else None, g,
        f32(1e-5) if norm else None, f32(4.0) if situ else None, f32(25.0) if situ else None,
        fake_stream(), arch=arch, dump_dir=dump_dir)


# the compile cache and call skeleton; a build's key holds its fusion (`Gemv.fused` for variants)
KERNEL = Kernel(OP, build)


def gemv_cuda(x, w, residual=None, *, out=None, out_dtype=None, cfg: Config | None = None):
    """y = x · wᵀ [+ residual] with the kernel, or with torch when it refuses the inputs (M > 16
    included): `run_gemm`. `cfg` overrides `config()` (sweeps)."""
    return run_gemm(KERNEL, refusal, lambda y, dtype: _launch(PLAIN, x, w, residual,
                                                          dtype == torch.float32, y, cfg=cfg),
                    x, w, residual, out, out_dtype)


# ---- the one-launch variants of the composites ---------------------------------------------------

# K3_GEMV_FUSED (settings.KERNELS.gemv_fused): which composites take their one-launch variant at
# M <= GEMV_MAX_M. Measurements behind the default: docs/decisions.md.


def fused_enabled(variant: str) -> bool:
    """Whether the fused ops take this one-launch variant now (settings.KERNELS.gemv_fused, read
    at every call)."""
    return variant in KERNELS.gemv_fused


def fused_takes(x, variant: str) -> bool:
    """Whether a composite with rows x takes its one-launch variant: the switch names it and
    `linear` would run this kernel at this M."""
    return (fused_enabled(variant) and x.dim() == 2 and x.is_cuda
            and x.shape[0] <= GEMV_MAX_M)


def fused_ok(name: str, reason: str | None) -> bool:
    """A composite's choice: True (one launch) where the variant takes the call; its refusal
    is logged and the composite runs its two launches."""
    if reason:
        fallback(f"gemv_{name}", f"{reason}; two launches")
    return reason is None


def _launch(fusion, x, w, residual, out_fp32, *rest, cfg: Config | None = None):
    # x [M, K] and w [N, K], or x [M, H·K] and w [H, V, K] (N = H·V) with a gate
    m, n, k = x.shape[0], w.shape[:-1].numel(), w.shape[-1]
    if m:
        b = bucket(m)
        KERNEL.compiled(n, k, b, out_fp32, residual is not None, cfg or config(n, k, b, fusion),
                        rows=b, fusion=fusion)(x, w, residual, *rest)


def gemv_norm_cuda(x, norm_weight, w, eps, residual=None, *, out=None, out_dtype=None):
    """y = RMSNorm(x; norm_weight, eps) · wᵀ [+ residual] (k3::norm_linear) in one launch:
    x̂ = bf16(g · bf16(x · rstd)) as the rms_norm kernel and the reference round it, the GEMM
    and the residual as `gemv_cuda`; torch (reason logged) when refused."""
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else x.dtype
    n = w.shape[0]

    def launch():
        y = x.new_empty((x.shape[0], n), dtype=out_dtype) if out is None else out
        _launch(NORM, x, w, residual, out_dtype == torch.float32, y, None, norm_weight,
                float(eps), None, None)
        return y

    return KERNEL.run(
        lambda: fused_launch_refusal(NORM, x, w, residual, norm_weight=norm_weight,
                                     out_dtype=out_dtype, outs=[(out, (len(x), n), out_dtype)]),
        lambda: gemm_ref(rms_norm_ref(x, norm_weight, eps), w, residual, out_dtype), launch,
        op="gemv_norm")


def gemv_situ_cuda(x, w, beta, linear_beta, *, out=None):
    """a = bf16(SiTU(bf16(x · W_gᵀ), bf16(x · W_uᵀ))) for w = [W_g; W_u] [2I, K]
    (k3::situ_gate_up) in one launch: the GEMM output rounded as the two-launch path stores
    it, then the situ kernel's math; torch (reason logged) when refused."""
    width = w.shape[0] // 2

    def reference():
        gate, up = gemm_ref(x, w).split(width, dim=-1)
        return situ_ref(gate, up, beta, linear_beta)

    def launch():
        y = x.new_empty((x.shape[0], width)) if out is None else out
        _launch(SITU, x, w, None, False, y, None, None, None, float(beta), float(linear_beta))
        return y

    return KERNEL.run(
        lambda: fused_launch_refusal(SITU, x, w, outs=[(out, (len(x), width), torch.bfloat16)]),
        reference, launch, op="gemv_situ")


def gemv_gate_cuda(x, w, g, *, out=None):
    """y = bf16(bf16(x_h · w[h]ᵀ) · bf16(sigmoid(g))) for x [M, H·K] in H slices x_h, w
    [H, V, K] read in place through its head and row strides, g [M, H·V] (k3::mla_uv_gate's
    W_UV and gate) in one launch; torch (reason logged) when refused."""
    h, v, k = w.shape

    def reference():
        m = len(x)
        return mla_uv_gate_ref(x.view(m, 1, h, k), w, g.view(m, 1, h * v)).view(m, h * v)

    def launch():
        y = x.new_empty((len(x), h * v)) if out is None else out
        _launch(Fusion(gate=v), x, w, None, False, y, None, g, None, None, None)
        return y

    return KERNEL.run(
        lambda: gate_refusal(x, w, g) or fused_launch_refusal(
            PLAIN, x[:, :k], w[0], outs=[(out, (len(x), h * v), torch.bfloat16)]),
        reference, launch, x, op="gemv_gate")


def gemv_split_cuda(x, w, split, *, out=None, out2=None):
    """(x · w[:split]ᵀ in fp32, x · w[split:]ᵀ in bf16) in one launch (k3::moe_front over the
    cached [W_r; W_d]): the sums of two `gemv_cuda` calls, stored as each would; torch (reason
    logged) when refused."""
    fusion = Fusion(split=split)
    return run_split(
        KERNEL, lambda outs: fused_launch_refusal(fusion, x, w, out_dtype=torch.float32, outs=outs),
        lambda y, y2: _launch(fusion, x, w, None, True, y, y2, None, None, None, None),
        x, w, split, out, out2, op="gemv_split")
