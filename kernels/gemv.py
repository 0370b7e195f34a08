"""CuTe DSL weight-streaming skinny GEMM ("GEMV") for decode: y = x · Wᵀ [+ r] at M <= 16 rows.

    y[m, n] = out(Σ_k x[m, k] · W[n, k] + r[m, n])      (fp32 products and sums, one rounding)

Decode time is the time to stream W from HBM, and cuBLAS reaches 55-70% of the copy bandwidth at
M = 1 on the TP16-rank shapes, so this kernel only streams W: CUDA cores, no tensor cores (at
M <= 8 the FMAs hide under the loads; at M = 16 they roughly equal them). One CTA takes R
consecutive rows of W; its T threads stride over each row's K/8 16-byte vectors (thread t: t,
t + T, ...) and issue all R x ceil(K/8/T) loads of W before any math. Each thread reads the
matching x vectors (small, L1/L2-resident) and keeps R x M fp32 partial dot products; a
butterfly reduce-scatter across each warp (every lane ends with distinct sums) and one pass
over shared memory across warps give the R x M results in a fixed order (deterministic, no
atomics, no split-K). Grid: ceil(N / R) CTAs, several resident per SM. With PDL
(`common.dsl.PDL`) the W loads are issued before `griddepcontrol.wait`, so they stream while the
previous kernel finishes; x and the residual are read, and y written, after it.

Batch buckets: the kernel is compiled per bucket (1, 2, 4, 8, 16), which fixes the number of
accumulators; the row count M <= bucket is a runtime size. Rows of x past M read as zeros and
their sums are never written, so callers pass their M rows as they are (no padding copies).

Used through `linear()` by the fused ops' CUDA paths (kernels/composite.py) where it beats
cuBLAS: on the H200 (2026-11-29, BENCHMARKS.md) at M = 1 on all ten TP16-rank shapes (x1.19 to
x1.84, 74-85% of the copy bandwidth on the >= 10 MB weights); at M = 8 only on two of them and at
M = 16 on none, so `GEMV_MAX_M` keeps larger batches on cuBLAS until a tensor-core variant exists.

Constraints:
    * x bf16 [M, K], 1 <= M <= 16 (more rows go to cuBLAS), contiguous rows, row stride a
      multiple of 8 elements, 16-byte-aligned data; W bf16 [N, K] likewise (any row stride that
      keeps rows 16-byte aligned); K % 8 == 0, 8 <= K <= 65536; N >= 1 and N rows past a
      multiple of R are predicated off.
    * Output bf16 (default) or fp32 (router logits) [M, N], last dim contiguous; optional residual
      r bf16 [M, N], last dim contiguous, added in fp32 before the rounding.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .common.dsl import (
    CompileCache,
    aligned16,
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
    fallback,
    pdl_enabled,
    pdl_launch_dependents,
    pdl_wait,
    runtime_refusal,
)

OP = "gemv"
BUCKETS = (1, 2, 4, 8, 16)
MAX_M = BUCKETS[-1]
MAX_K = 65536
SMS = 132  # H200
OUT_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Config:
    rows_per_cta: int  # R: rows of W per CTA
    threads: int  # T: 128 or 256


def config(n: int, k: int, m_bucket: int) -> Config:
    """T = 256 for K >= 4096 (fewer passes over a row), else 128. R must fit: at most 16 W
    vectors in flight per thread and at most ~128 registers (two CTAs of 256 per SM; sm_90a
    builds: 4 per W vector and ~3 per accumulator) with >= 4 CTAs per SM. M <= 2 takes the
    smallest such R with >= 4 vectors in flight per thread (the most CTAs: x reuse does not
    matter), larger M the largest (each x vector read from L1 serves R rows). Untuned:
    `benchmarks/gemv.py --sweep` times every config."""
    threads = 256 if k >= 4096 else 128
    j = _vec_per_thread(k, threads)
    fits = [r for r in (1, 2, 4, 8) if r == 1 or (
        r * j <= 16 and 4 * r * j + 3 * r * m_bucket <= 128 and -(-n // r) >= 4 * SMS)]
    if m_bucket <= 2:
        return Config(next((r for r in fits if r * j >= 4), fits[-1]), threads)
    return Config(fits[-1], threads)


def configs(n: int, k: int, m_bucket: int) -> list[Config]:
    """Every config worth timing at these sizes (for sweeps): up to 16 W vectors per thread and
    64 accumulators (beyond that, sm_90a builds spill)."""
    return [Config(r, t) for t in (128, 256) for r in (1, 2, 4, 8)
            if r * _vec_per_thread(k, t) <= 16 and r * m_bucket <= 64]


def _vec_per_thread(k: int, threads: int) -> int:
    return -(-(k // 8) // threads)


def can_implement(x, w, residual=None, *, out_dtype=None) -> bool:
    return refusal(x, w, residual, out_dtype=out_dtype) is None


def refusal(x, w, residual=None, *, out_dtype=None) -> str | None:
    """Why the kernel cannot take these inputs, or None. Metadata only (fake tensors work); data
    alignment is checked at launch."""
    return gemm_refusal(x, w, residual, out_dtype, max_m=MAX_M, min_k=8)


def gemm_refusal(x, w, residual, out_dtype, *, max_m: int, min_k: int) -> str | None:
    """The constraints this kernel and the tensor-core one (gemm_tc) share: bf16 x [M <= max_m,
    K] and w [N, K] with 16-byte rows, min_k <= K <= MAX_K a multiple of 8, an optional bf16
    residual [M, N], bf16 or fp32 output."""
    bf16 = torch.bfloat16
    if x.dim() != 2 or w.dim() != 2:
        return f"x {tuple(x.shape)}, w {tuple(w.shape)} (want x [M, K], w [N, K])"
    (m, k), n = x.shape, w.shape[0]
    if m > max_m:
        return f"batch above {max_m}: cuBLAS"
    if n < 1:
        return "w has no rows"
    if k % 8 or not min_k <= k <= MAX_K or w.shape[1] != k:
        return (f"K {k}, w {tuple(w.shape)} (want w [N, K], K a multiple of 8 in "
                f"[{min_k}, {MAX_K}])")
    for name, t in (("x", x), ("w", w)):
        if t.dtype != bf16:
            return f"{name}: dtype {t.dtype} (want {bf16})"
        if t.stride(-1) != 1 or t.stride(0) % 8:
            return f"{name}: strides {t.stride()} (last dim contiguous, rows 16-byte aligned)"
    if residual is not None and (residual.dtype != bf16 or residual.shape != (m, n)
                                 or residual.stride(-1) != 1):
        return (f"residual: {residual.dtype} {tuple(residual.shape)} {residual.stride()} "
                f"(want bf16 [{m}, {n}], last dim contiguous)")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        return f"output dtype {out_dtype} (want bf16 or fp32)"
    return None


def launch_refusal(refuse, x, w, residual, out, out_dtype) -> str | None:
    """Why a GEMM kernel with refusal `refuse` cannot run this call now (shapes, device,
    alignment, the `out` buffer), or None."""
    reason = (runtime_refusal() or refuse(x, w, residual, out_dtype=out_dtype)
              or (None if x.is_cuda and w.is_cuda else "not on a CUDA device")
              or (None if aligned16(x, w) else "data not 16-byte aligned"))
    if reason is None and out is not None and (
            out.dtype != out_dtype or out.shape != (x.shape[0], w.shape[0])
            or out.stride(-1) != 1):
        reason = f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
    return reason


@functools.cache
def _kernel_class():
    import cutlass
    from cutlass import BFloat16, Float32, const_expr, cute

    from .common.copy import bf16_halves, load_vectors, make_frag, row_vectors

    def warp_reduce_scatter(vals: list) -> list:
        """Butterfly sum over the warp of 2^v values per lane. While a lane holds several, it
        keeps half and trades the other half with its partner (V - 1 shuffles for V <= 32,
        against 5 V for one warp_reduction per value). Lane l ends with the totals of values
        l·V/32 ... (l + 1)·V/32 - 1, or, for V < 32, of value l >> (5 - v)."""
        lane = cute.arch.lane_idx()
        offset = 16
        while offset:
            if len(vals) > 1:
                half = len(vals) // 2
                upper = (lane & offset) != 0
                kept = []
                for i in range(half):
                    lo, hi = vals[i], vals[i + half]
                    send = Float32(cutlass.select_(upper, lo, hi))
                    keep = Float32(cutlass.select_(upper, hi, lo))
                    kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset))
                vals = kept
            else:
                vals = [vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset)]
            offset //= 2
        return vals

    class Gemv:
        def __init__(self, n: int, k: int, m_bucket: int, cfg: Config, out_fp32: bool,
                     has_residual: bool, pdl: bool = False):
            self.n, self.n_vec, self.mb, self.pdl = n, k // 8, m_bucket, pdl
            self.rows, self.threads = cfg.rows_per_cta, cfg.threads
            self.j = _vec_per_thread(k, cfg.threads)
            self.n_warps = cfg.threads // 32
            self.n_vals = cfg.rows_per_cta * m_bucket  # sums per CTA, index m·R + r
            self.out_fp32, self.has_residual = out_fp32, has_residual

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor, stream):
            # mX: (M, K); mW: (N, K); mR, mY: (M, N)
            self.kernel(mX, mW, mR, mY).launch(
                grid=[-(-self.n // self.rows), 1, 1], block=[self.threads, 1, 1],
                smem=4 * self.n_warps * self.n_vals + 64, stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor):
            pdl_launch_dependents(self.pdl)
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            T, nv, R, MB, J = self.threads, self.n_vec, self.rows, self.mb, self.j
            n_rows = mX.shape[0]  # M <= MB
            first = cta * R
            smem = cutlass.memory.SmemAllocator()
            sRed = smem.allocate_tensor(Float32, cute.make_layout(
                (self.n_warps, self.n_vals), stride=(self.n_vals, 1)), 16)

            # Every W load first: R rows x J vectors per thread. Rows past N re-read row N - 1.
            rW = [make_frag(BFloat16, J) for _ in range(R)]  # each (8, J)
            for r in cutlass.range_constexpr(R):
                row = first + r
                if const_expr(self.n % R):
                    row = cutlass.min(row, self.n - 1)
                load_vectors(row_vectors(mW, row), rW[r], tidx, T, nv)
            # A scheduling fence: ptxas would otherwise sink later loads below the first FMAs,
            # so each thread would wait for one load round trip before issuing the next.
            cute.arch.sync_warp()
            pdl_wait(self.pdl)  # x and the residual come from earlier kernels

            acc = [Float32(0.0) for _ in range(R * MB)]  # index m·R + r
            rX = make_frag(BFloat16, 1)  # (8, 1)
            for j in cutlass.range_constexpr(J):
                w = [bf16_halves(rW[r][None, j].load()) for r in range(R)]  # (even, odd) fp32
                vec = j * T + tidx
                for m in cutlass.range_constexpr(MB):
                    if const_expr(m == 0 and (j + 1) * T <= nv):
                        cute.autovec_copy(row_vectors(mX, m)[None, vec], rX[None, 0])
                    else:
                        rX.fill(0)
                        pred = m < n_rows
                        if const_expr((j + 1) * T > nv):
                            pred = pred & (vec < nv)
                        if pred:
                            cute.autovec_copy(row_vectors(mX, m)[None, vec], rX[None, 0])
                    x_even, x_odd = bf16_halves(rX.load())
                    for r in cutlass.range_constexpr(R):
                        a = acc[m * R + r]
                        for e in cutlass.range_constexpr(4):
                            a = a + x_even[e] * w[r][0][e]
                            a = a + x_odd[e] * w[r][1][e]
                        acc[m * R + r] = a

            # Warp sums (lane-distinct), then a fixed-order sum over warps in shared memory.
            part = warp_reduce_scatter(acc)
            lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
            V = self.n_vals
            if const_expr(V >= 32):
                for i in cutlass.range_constexpr(V // 32):
                    sRed[warp, lane * (V // 32) + i] = part[i]
            else:
                if lane % (32 // V) == 0:
                    sRed[warp, lane // (32 // V)] = part[0]
            cute.arch.barrier()
            if tidx < V:
                out_m, out_col = tidx // R, first + tidx % R
                write = out_m < n_rows
                if const_expr(self.n % R):
                    write = write & (out_col < self.n)
                if write:
                    total = sRed[0, tidx]
                    for wi in cutlass.range_constexpr(1, self.n_warps):
                        total = total + sRed[wi, tidx]
                    if const_expr(self.has_residual):
                        total = total + mR[out_m, out_col].to(Float32)
                    if const_expr(self.out_fp32):
                        mY[out_m, out_col] = total
                    else:
                        mY[out_m, out_col] = total.to(BFloat16)

    return Gemv


_cache = CompileCache(OP)


def compiled(n: int, k: int, m_bucket: int, out_fp32: bool, residual: bool, cfg: Config,
             arch: str | None = None):
    """The compiled kernel for these scalars and the PDL setting now (cached)."""
    pdl = pdl_enabled()
    return _cache.get((n, k, m_bucket, out_fp32, residual, cfg, arch, pdl),
                      lambda: build(n, k, m_bucket, out_fp32, residual, cfg, arch, pdl=pdl))


def prepare(n: int, k: int, buckets=BUCKETS, *, out_dtype=torch.bfloat16,
            residual: bool = False) -> None:
    """Compile the kernel of every batch bucket for this weight (call before graph capture)."""
    for b in buckets:
        compiled(n, k, b, out_dtype == torch.float32, residual, config(n, k, b))


def build(n, k, m_bucket, out_fp32, residual, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    bf16, m = cutlass.BFloat16, cute.sym_int()

    def out_rows(dtype):  # [M, N] rows with any row stride
        return make_fake_tensor(dtype, (m, n), stride=(cute.sym_int64(), 1),
                                assumed_align=dtype.width // 8)

    return compile_kernel(
        _kernel_class()(n, k, m_bucket, cfg, out_fp32, residual, pdl),
        fake_rows(bf16, m, k), fake_rows(bf16, n, k),
        out_rows(bf16) if residual else None,
        out_rows(cutlass.Float32 if out_fp32 else bf16), fake_stream(), arch=arch,
        dump_dir=dump_dir)


# Rows up to which `linear` takes the kernel instead of cuBLAS (measured: see the docstring)
GEMV_MAX_M = 1
# The tensor-core skinny GEMM for the rows above (kernels/gemm_tc.py), once its `register()`
# has run (it is in KERNELS, or K3_KERNELS_EXTRA names it); None: cuBLAS there
_tensor_core = None


def use_tensor_cores(module) -> None:
    """Route GEMV_MAX_M < M <= module.MAX_M through `module.gemm_tc_cuda` (its refusals fall back
    to cuBLAS)."""
    global _tensor_core
    _tensor_core = module


def linear(x, w, residual=None, *, out_dtype=None):
    """y = x · wᵀ [+ residual] for x [M, K] rows: this kernel at M <= GEMV_MAX_M, the
    tensor-core kernel above where it is registered and not measured slower than cuBLAS
    (`gemm_tc.prefers`), cuBLAS (`gemv_ref`) otherwise, each where it takes the inputs. The
    choice is by shape only, fixed per bucket."""
    if x.dim() == 2 and x.is_cuda:
        m, tc = x.shape[0], _tensor_core
        if m <= GEMV_MAX_M and can_implement(x, w, residual, out_dtype=out_dtype):
            return gemv_cuda(x, w, residual, out_dtype=out_dtype)
        if tc is not None and m <= tc.MAX_M and tc.prefers(w.shape[0], x.shape[1], m) and \
                tc.can_implement(x, w, residual, out_dtype=out_dtype):
            return tc.gemm_tc_cuda(x, w, residual, out_dtype=out_dtype)
    return gemv_ref(x, w, residual, out_dtype)


def gemv_ref(x, w, residual=None, out_dtype=None):
    """torch: one cuBLAS call when every dtype agrees (addmm adds the residual before its single
    rounding, like the kernel); a 16-bit GEMM writing fp32 on a GPU (exact products, fp32 sums:
    no upcast copy of w); otherwise fp32 math, cast once."""
    out_dtype = out_dtype or x.dtype
    if (out_dtype == torch.float32 and x.is_cuda and residual is None and x.dim() == 2
            and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)):
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    if x.dtype == w.dtype == out_dtype and (residual is None or residual.dtype == out_dtype):
        if residual is None:
            return F.linear(x, w)
        lead = x.shape[:-1]
        y = torch.addmm(residual.reshape(-1, w.shape[0]), x.reshape(-1, x.shape[-1]), w.t())
        return y.view(*lead, w.shape[0])
    y = F.linear(x.float(), w.float())
    if residual is not None:
        y = y + residual.float()
    return y.to(out_dtype)


def gemv_cuda(x, w, residual=None, *, out=None, out_dtype=None):
    """y = x · wᵀ [+ residual] with the kernel, or with torch (`gemv_ref`, reason logged) when it
    refuses the inputs (M > 16 included). `out` [M, N] (last dim contiguous) is written only when
    the kernel runs; the fallback returns a new tensor."""
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else x.dtype
    reason = launch_refusal(refusal, x, w, residual, out, out_dtype)
    if reason:
        fallback(OP, reason)
        return gemv_ref(x, w, residual, out_dtype)
    (m, k), n = x.shape, w.shape[0]
    y = x.new_empty((m, n), dtype=out_dtype) if out is None else out
    if m:
        b = bucket(m)
        compiled(n, k, b, out_dtype == torch.float32, residual is not None,
                 config(n, k, b))(x, w, residual, y)
    return y
