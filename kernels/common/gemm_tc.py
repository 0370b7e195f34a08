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
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .dsl import (
    compile_kernel,
    fake_rows,
    fake_stream,
    log,
    pdl_launch_dependents,
    pdl_wait,
)
from .gemm import gemm_ref, gemm_refusal, run_gemm
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
    faster}, from `TABLE` (written by `benchmarks/gemm_tc.py --table`). Empty when the table was
    measured on another GPU than this process's (its choices need not hold there)."""
    data = json.loads(TABLE.read_text())
    if torch.cuda.is_available() and torch.cuda.get_device_name() != data["device"]:
        log.info("%s: tuned on %s, not %s: heuristic configs", OP, data["device"],
                 torch.cuda.get_device_name())
        return {}
    return {(e["N"], e["K"], e["bucket"]): e["config"] and Config(**e["config"])
            for e in data["entries"]}


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


@functools.cache
def _kernel_class():
    import cutlass
    import cutlass.utils.hopper_helpers as sm90
    from cutlass import AddressSpace, BFloat16, Float32, Int32, const_expr, cute, pipeline
    from cutlass._mlir.dialects import llvm, nvvm
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.cutlass_dsl import dsl_user_op
    from cutlass.tensor_utils import LayoutEnum

    @dsl_user_op
    def load_from_peer(ptr: cute.Pointer, peer, *, loc=None, ip=None) -> Float32:
        """ld.shared::cluster of one fp32 at the same smem address in cluster CTA `peer`."""
        remote = nvvm.mapa(llvm.PointerType.get(AddressSpace.dsmem),
                           ptr.to_llvm_ptr(loc=loc, ip=ip), Int32(peer).ir_value(loc=loc, ip=ip),
                           loc=loc, ip=ip)
        return Float32(llvm.load(Float32.mlir_type, remote, loc=loc, ip=ip))

    class GemmTC:
        def __init__(self, n: int, k: int, cfg: Config, out_fp32: bool, has_residual: bool,
                     pdl: bool = False):
            self.n, self.k_tiles, self.pdl = n, -(-k // TILE_K), pdl
            self.rows, self.tokens = cfg.tile_rows, cfg.tile_tokens
            self.stages, self.splits = cfg.stages, cfg.splits
            self.p_stride, self.w_elems = _partial_stride(cfg), _w_buffer_elems(cfg)
            self.out_fp32, self.has_residual = out_fp32, has_residual

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor, stream):
            # mX: (M, K); mW: (N, K); mR, mY: (M, N)
            k_major = LayoutEnum.ROW_MAJOR
            tiled_mma = sm90.make_trivial_tiled_mma(
                BFloat16, BFloat16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
                Float32, (1, 1, 1), tiler_mn=(64, self.tokens))
            tile_mnk = (self.rows, self.tokens, TILE_K)
            sW_layout = sm90.make_smem_layout_a(k_major, tile_mnk, BFloat16, self.stages)
            sX_layout = sm90.make_smem_layout_b(k_major, tile_mnk, BFloat16, self.stages)
            tma_w, tW = cpasync.make_tiled_tma_atom(  # tW: (N, K) as TMA coordinates
                cpasync.CopyBulkTensorTileG2SOp(), mW, cute.slice_(sW_layout, (None, None, 0)),
                (self.rows, TILE_K))
            tma_x, tX = cpasync.make_tiled_tma_atom(  # tX: (M, K)
                cpasync.CopyBulkTensorTileG2SOp(), mX, cute.slice_(sX_layout, (None, None, 0)),
                (self.tokens, TILE_K))

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, self.w_elems], 1024]
                sX: cute.struct.Align[
                    cute.struct.MemRange[BFloat16, self.stages * self.tokens * TILE_K], 1024]

            self.storage = Storage
            self.kernel(tma_w, tW, tma_x, tX, mR, mY, tiled_mma, sW_layout, sX_layout).launch(
                grid=[-(-self.n // self.rows), self.splits, 1], block=[THREADS, 1, 1],
                cluster=[1, self.splits, 1], stream=stream, use_pdl=self.pdl)

        def load_slice(self, pipe, state, tma_w, tWgW, tWsW, tma_x, tXgX, tXsX, k_first):
            """TMA of K slice k_first + state.count of W and x into stage state.index."""
            self.load_w(pipe, state, tma_w, tWgW, tWsW, k_first)
            self.load_x(pipe, state, tma_x, tXgX, tXsX, k_first)

        def load_w(self, pipe, state, tma_w, tWgW, tWsW, k_first):
            """Acquire stage state.index (its barrier now expects the W and x bytes) and start the
            TMA of W's K slice k_first + state.count into it."""
            pipe.producer_acquire(state)
            cute.copy(tma_w, tWgW[None, k_first + state.count], tWsW[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))

        def load_x(self, pipe, state, tma_x, tXgX, tXsX, k_first):
            """The TMA of x's K slice into the stage `load_w` acquired: it completes the stage."""
            cute.copy(tma_x, tXgX[None, k_first + state.count], tXsX[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))
            pipe.producer_commit(state)

        @cute.kernel
        def kernel(self, tma_w: cute.CopyAtom, tW: cute.Tensor, tma_x: cute.CopyAtom,
                   tX: cute.Tensor, mR, mY: cute.Tensor, tiled_mma: cute.TiledMma,
                   sW_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout):
            pdl_launch_dependents(self.pdl)
            tidx, _, _ = cute.arch.thread_idx()
            tile, split, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp == 0:
                cpasync.prefetch_descriptor(tma_w)
                cpasync.prefetch_descriptor(tma_x)
            storage = cutlass.utils.SmemAllocator().allocate(self.storage)
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.bars.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
                tx_count=(self.rows + self.tokens) * TILE_K * 2,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
            pipeline.pipeline_init_arrive()
            pipeline.pipeline_init_wait()

            sW = storage.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)  # (R, 64, st)
            sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)  # (T, 64, st)
            gW = cute.local_tile(tW, (self.rows, TILE_K), (tile, None))  # (R, 64, k_tiles)
            gX = cute.local_tile(tX, (self.tokens, TILE_K), (0, None))  # (T, 64, k_tiles)
            tWsW, tWgW = cpasync.tma_partition(tma_w, 0, cute.make_layout(1),
                                               cute.group_modes(sW, 0, 2),
                                               cute.group_modes(gW, 0, 2))
            tXsX, tXgX = cpasync.tma_partition(tma_x, 0, cute.make_layout(1),
                                               cute.group_modes(sX, 0, 2),
                                               cute.group_modes(gX, 0, 2))
            thr_mma = tiled_mma.get_slice(tidx)
            tCrW = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))  # (MMA, MMA_M, 4, st)
            tCrX = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))  # (MMA, MMA_N, 4, st)
            acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((self.rows, self.tokens)),
                                        Float32)
            acc.fill(0.0)

            # This CTA's K slices: an even share (S <= k_tiles, so none is empty).
            k_first = split * self.k_tiles // self.splits
            k_count = (split + 1) * self.k_tiles // self.splits - k_first
            loads = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            if const_expr(self.pdl):
                # W (a weight) before the wait, x (the previous kernel's output) after it
                if warp == 0:
                    for _ in cutlass.range(cutlass.min(self.stages, k_count), unroll=1):
                        self.load_w(pipe, loads, tma_w, tWgW, tWsW, k_first)
                        loads.advance()
                pdl_wait(True)
                if warp == 0:
                    xs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                      self.stages)
                    for _ in cutlass.range(cutlass.min(self.stages, k_count), unroll=1):
                        self.load_x(pipe, xs, tma_x, tXgX, tXsX, k_first)
                        xs.advance()
            else:
                if warp == 0:
                    for _ in cutlass.range(cutlass.min(self.stages, k_count), unroll=1):
                        self.load_slice(pipe, loads, tma_w, tWgW, tWsW, tma_x, tXgX, tXsX,
                                        k_first)
                        loads.advance()
            reads = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            for _ in cutlass.range(k_count, unroll=1):
                pipe.consumer_wait(reads)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tCrW, mode=[2])):
                    cute.gemm(tiled_mma, acc, tCrW[None, None, kb, reads.index],
                              tCrX[None, None, kb, reads.index], acc)
                warpgroup.commit_group()
                # The MMAs are tiny next to a slice's load: finish them, so the stage refills now.
                warpgroup.wait_group(0)
                pipe.consumer_release(reads)
                reads.advance()
                if warp == 0 and loads.count < k_count:
                    self.load_slice(pipe, loads, tma_w, tWgW, tWsW, tma_x, tXgX, tXsX, k_first)
                    loads.advance()

            # Partial tile over the (now idle) W stages: sP (R, T) fp32, columns p_stride apart.
            cute.arch.barrier()
            sP = cute.make_tensor(
                cute.recast_ptr(storage.sW.data_ptr(), dtype=Float32),
                cute.make_layout((self.rows, self.tokens), stride=(1, self.p_stride)))
            tCsP = thr_mma.partition_C(sP)
            tCsP.store(acc.load())
            if const_expr(self.splits > 1):
                cute.arch.cluster_arrive()  # release: the partials are visible to the peers
                cute.arch.cluster_wait()
            else:
                cute.arch.barrier()
            self.reduce_store(sP, tile, tidx, mR, mY)
            if const_expr(self.splits > 1):
                cute.arch.cluster_arrive()  # the peers may still read this CTA's tile
                cute.arch.cluster_wait()

        @cute.jit
        def reduce_store(self, sP: cute.Tensor, tile, tidx, mR, mY: cute.Tensor):
            """This CTA's rows of the tile, summed over the cluster's partials in rank order:
            element e = token · R/S + row, so consecutive threads write consecutive columns of y."""
            share = self.rows // self.splits
            rank = cute.arch.block_idx_in_cluster()
            n_tokens = mY.shape[0]
            for j in cutlass.range_constexpr(-(-share * self.tokens // THREADS)):
                e = j * THREADS + tidx
                local = rank * share + e % share
                m, col = e // share, tile * self.rows + local
                write = m < n_tokens
                if const_expr(self.n % self.rows):
                    write = write & (col < self.n)
                if const_expr((j + 1) * THREADS > share * self.tokens):
                    write = write & (e < share * self.tokens)
                if write:
                    total = Float32(0.0)
                    if const_expr(self.splits == 1):
                        total = sP[local, m]
                    else:
                        ptr = sP.iterator + cute.crd2idx((local, m), sP.layout)
                        for p in cutlass.range_constexpr(self.splits):
                            total = total + load_from_peer(ptr, p)
                    if const_expr(self.has_residual):
                        total = total + mR[m, col].to(Float32)
                    if const_expr(self.out_fp32):
                        mY[m, col] = total
                    else:
                        mY[m, col] = total.to(BFloat16)

    return GemmTC


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

    bf16, m = cutlass.BFloat16, cute.sym_int()

    def out_rows(dtype):  # [M, N] rows with any row stride
        return make_fake_tensor(dtype, (m, n), stride=(cute.sym_int64(), 1),
                                assumed_align=dtype.width // 8)

    return compile_kernel(
        _kernel_class()(n, k, cfg, out_fp32, residual, pdl),
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
