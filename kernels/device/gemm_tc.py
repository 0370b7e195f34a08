"""`GemmTC`, the CuTe DSL kernel of kernels/common/gemm_tc.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import operator

import cutlass
import cutlass.utils.hopper_helpers as sm90
from cutlass import AddressSpace, BFloat16, Float32, Int32, const_expr, cute, pipeline
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from ..common.copy import load_vectors, make_frag, row_vectors, vectors
from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..common.gemm_tc import (
    PLAIN,
    THREADS,
    TILE_K,
    Config,
    Fusion,
    _partial_stride,
    _w_buffer_elems,
    norm_rms_config,
    norm_weight_vectors,
)


@dsl_user_op
def load_from_peer(ptr: cute.Pointer, peer, *, loc=None, ip=None) -> Float32:
    """ld.shared::cluster of one fp32 at the same smem address in cluster CTA `peer`."""
    remote = nvvm.mapa(llvm.PointerType.get(AddressSpace.dsmem),
                       ptr.to_llvm_ptr(loc=loc, ip=ip), Int32(peer).ir_value(loc=loc, ip=ip),
                       loc=loc, ip=ip)
    return Float32(llvm.load(Float32.mlir_type, remote, loc=loc, ip=ip))

class GemmTC:
    def __init__(self, n: int, k: int, cfg: Config, out_fp32: bool, has_residual: bool,
                 pdl: bool = False, fusion: Fusion = PLAIN, late_trigger: bool = False):
        self.n, self.k, self.k_tiles, self.pdl = n, k, -(-k // TILE_K), pdl
        # PDL: the next kernel may launch when every CTA has finished its K loop (not at start)
        self.late_trigger = late_trigger
        self.rows, self.tokens = cfg.tile_rows, cfg.tile_tokens
        self.stages, self.splits = cfg.stages, cfg.splits
        self.p_stride, self.w_elems = _partial_stride(cfg), _w_buffer_elems(cfg)
        self.out_fp32, self.has_residual = out_fp32, has_residual
        # SiTU: a tile's rows are R/2 rows of W_g and the same R/2 rows of W_u (I further)
        self.fusion, self.half = fusion, cfg.tile_rows // 2
        # norm: the rms_norm kernel's config at these rows (its summation order)
        self.rms = norm_rms_config(k, self.tokens) if fusion.norm else None
        self.g_vectors = norm_weight_vectors(cfg, k) if fusion.norm else 0
        # x's slices in shared memory: the pipeline's stages, or with the norm prologue all of
        # the CTA's K slices at once (x̂ written once before the main loop, which streams W only)
        self.x_stages = self.g_vectors // (TILE_K // 8) if fusion.norm else self.stages

    def operands(self, mX: cute.Tensor, mW: cute.Tensor):
        """The MMA, the shared-memory layouts and the TMA atoms of x and W (with SiTU, W's
        atom copies half tiles: R/2 rows)."""
        k_major = LayoutEnum.ROW_MAJOR
        tiled_mma = sm90.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            Float32, (1, 1, 1), tiler_mn=(64, self.tokens))
        tile_mnk = (self.rows, self.tokens, TILE_K)
        sW_layout = sm90.make_smem_layout_a(k_major, tile_mnk, BFloat16, self.stages)
        sX_layout = sm90.make_smem_layout_b(k_major, tile_mnk, BFloat16, self.x_stages)
        # With SiTU the W stages as 2·stages half tiles (R/2, 64): the 128-byte swizzle atom
        # is 8 rows and tiles along rows first, so half tile 2s + h is rows h·R/2... of stage s,
        # byte for byte (R/2 >= 32 rows keeps each half 1024-byte aligned)
        situ = self.fusion.situ
        sWt_layout = sm90.make_smem_layout_a(
            k_major, (self.half, self.tokens, TILE_K), BFloat16, 2 * self.stages) if situ \
            else sW_layout
        tma_w, tW = cpasync.make_tiled_tma_atom(  # tW: (N, K) as TMA coordinates
            cpasync.CopyBulkTensorTileG2SOp(), mW, cute.slice_(sWt_layout, (None, None, 0)),
            (self.half if situ else self.rows, TILE_K))
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
        if self.fusion.norm:
            rms_warps = self.rms.threads // 32

            @cute.struct
            class NormStorage:  # the norm prologue: x̂ resident, rstd of each token besides
                bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                sW: cute.struct.Align[cute.struct.MemRange[BFloat16, self.w_elems], 1024]
                sX: cute.struct.Align[
                    cute.struct.MemRange[BFloat16, self.x_stages * self.tokens * TILE_K], 1024]
                rstd: cute.struct.Align[cute.struct.MemRange[Float32, self.tokens], 16]
                part: cute.struct.Align[  # the rms_norm kernel's warp totals of each token
                    cute.struct.MemRange[Float32, self.tokens * rms_warps], 16]
                g: cute.struct.Align[  # the norm weight of this CTA's K slices
                    cute.struct.MemRange[BFloat16, 8 * self.g_vectors], 16]

            self.storage = NormStorage
        return tiled_mma, sW_layout, sX_layout, sWt_layout, tma_w, tW, tma_x, tX

    def launch(self, kernel, stream):
        kernel.launch(grid=[-(-self.n // self.rows), self.splits, 1], block=[THREADS, 1, 1],
                      cluster=[1, self.splits, 1], stream=stream, use_pdl=self.pdl)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor, stream):
        # mX: (M, K); mW: (N, K); mR, mY: (M, N)
        tiled_mma, sW_layout, sX_layout, _, tma_w, tW, tma_x, tX = self.operands(mX, mW)
        self.launch(self.kernel(tma_w, tW, tma_x, tX, mR, mY, tiled_mma, sW_layout, sX_layout),
                    stream)

    @cute.jit
    def fused(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mY2, beta, linear_beta,
              stream):
        # mY: (M, split) fp32 and mY2: (M, N - split) bf16 with a split; mY: (M, N/2) with SiTU
        tiled_mma, sW_layout, sX_layout, sWt_layout, tma_w, tW, tma_x, tX = self.operands(mX, mW)
        self.launch(self.kernel_fused(tma_w, tW, tma_x, tX, mY, mY2, beta, linear_beta,
                                      tiled_mma, sW_layout, sX_layout, sWt_layout), stream)

    @cute.jit
    def normed(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor, mG: cute.Tensor,
               eps: Float32, stream):
        # the norm prologue: mX (M, K) also read by the threads for rstd; mG: (K,) the norm
        # weight; mR, mY: (M, N)
        tiled_mma, sW_layout, sX_layout, _, tma_w, tW, tma_x, tX = self.operands(mX, mW)
        self.launch(self.kernel_norm(tma_w, tW, tma_x, tX, mX, mR, mY, mG, eps, tiled_mma,
                                     sW_layout, sX_layout), stream)

    def load_slice(self, pipe, state, tma_w, tWgW, tWsW, tma_x, tXgX, tXsX, k_first):
        """TMA of K slice k_first + state.count of W and x into stage state.index."""
        self.load_w(pipe, state, tma_w, tWgW, tWsW, k_first)
        self.load_x(pipe, state, tma_x, tXgX, tXsX, k_first)

    def load_w(self, pipe, state, tma_w, tWgW, tWsW, k_first):
        """Acquire stage state.index (its barrier now expects the W and x bytes) and start the
        TMA of W's K slice k_first + state.count into it."""
        pipe.producer_acquire(state)
        if const_expr(self.fusion.situ):  # tWgW: (gate rows, up rows); tWsW: 2·stages halves
            for h in range(2):
                cute.copy(tma_w, tWgW[h][None, k_first + state.count],
                          tWsW[None, 2 * state.index + h],
                          tma_bar_ptr=pipe.producer_get_barrier(state))
        else:
            cute.copy(tma_w, tWgW[None, k_first + state.count], tWsW[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))

    def load_w_only(self, pipe, state, tma_w, tWgW, tWsW, k_first):
        """A stage of W alone (the norm prologue's x̂ is resident): `load_w`, committed."""
        self.load_w(pipe, state, tma_w, tWgW, tWsW, k_first)
        pipe.producer_commit(state)

    def load_x(self, pipe, state, tma_x, tXgX, tXsX, k_first):
        """The TMA of x's K slice into the stage `load_w` acquired: it completes the stage."""
        cute.copy(tma_x, tXgX[None, k_first + state.count], tXsX[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state))
        pipe.producer_commit(state)

    def w_partition(self, tma_w, tW: cute.Tensor, sWt: cute.Tensor, tile, rows: int):
        """TMA partitions of row tile `tile` (`rows` high) of W and of the W stages sWt."""
        gW = cute.local_tile(tW, (rows, TILE_K), (tile, None))  # (rows, 64, k_tiles)
        return cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sWt, 0, 2),
                                     cute.group_modes(gW, 0, 2))

    @cute.kernel
    def kernel(self, tma_w: cute.CopyAtom, tW: cute.Tensor, tma_x: cute.CopyAtom,
               tX: cute.Tensor, mR, mY: cute.Tensor, tiled_mma: cute.TiledMma,
               sW_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout):
        self.body(tma_w, tW, tma_x, tX, mR, mY, None, None, None, tiled_mma, sW_layout,
                  sX_layout, sW_layout)

    @cute.kernel
    def kernel_fused(self, tma_w: cute.CopyAtom, tW: cute.Tensor, tma_x: cute.CopyAtom,
                     tX: cute.Tensor, mY: cute.Tensor, mY2, beta, linear_beta,
                     tiled_mma: cute.TiledMma, sW_layout: cute.ComposedLayout,
                     sX_layout: cute.ComposedLayout, sWt_layout: cute.ComposedLayout):
        self.body(tma_w, tW, tma_x, tX, None, mY, mY2, beta, linear_beta, tiled_mma, sW_layout,
                  sX_layout, sWt_layout)

    @cute.kernel
    def kernel_norm(self, tma_w: cute.CopyAtom, tW: cute.Tensor, tma_x: cute.CopyAtom,
                    tX: cute.Tensor, mX: cute.Tensor, mR, mY: cute.Tensor, mG: cute.Tensor,
                    eps: Float32, tiled_mma: cute.TiledMma, sW_layout: cute.ComposedLayout,
                    sX_layout: cute.ComposedLayout):
        self.body(tma_w, tW, tma_x, tX, mR, mY, None, None, None, tiled_mma, sW_layout,
                  sX_layout, sW_layout, mX, mG, eps)

    @cute.jit
    def row_rstd(self, mX: cute.Tensor, eps: Float32, sPart: cute.Tensor, sRstd: cute.Tensor,
                 warp, lane):
        """sRstd[m] = rsqrt(Σ_k x[m, k]² / K + eps) of every token m of the tile, 0 past M, bit
        for bit the rms_norm kernel's at the config it runs for these rows (`self.rms`: T
        threads of V vectors; batch <= 8 where the tile has 8 tokens, else above 8): its sums
        in its order. Its thread t = 32·v + l of warp v sums the squares of its (8, V)
        fragment (vectors t, t + T, ...) with the same reduce, then a warp butterfly; then one
        warp adds up the T/32 warp totals by a butterfly (lane v holds warp v's). Here warp w
        plays the rms_norm kernel's warps v = w, w + 4, ... for every row (lane l as its lane
        l; up to 16 vectors a lane in flight: G rows at a time), the totals go to sPart
        (tokens, T/32), and after a barrier warp w adds up rows w, w + 4, ..."""
        nv, n_rows = self.k // 8, mX.shape[0]
        T, V = self.rms.threads, self.rms.vec_per_thread
        n_warps = T // 32
        group = max(1, 16 // V)  # rows whose loads are in flight at once
        for i in cutlass.range_constexpr(-(-n_warps // (THREADS // 32))):
            v = warp + i * (THREADS // 32)  # the rms_norm kernel's warp
            take = v < n_warps if const_expr((i + 1) * (THREADS // 32) > n_warps) else True
            if take:
                for g0 in cutlass.range_constexpr(0, self.tokens, group):
                    rows = range(g0, min(g0 + group, self.tokens))
                    frags = [make_frag(BFloat16, V) for _ in rows]  # each (8, V)
                    for rX, m in zip(frags, rows):
                        rX.fill(0)
                        if m < n_rows:
                            load_vectors(row_vectors(mX, m), rX, v * 32 + lane, T, nv)
                    for rX, m in zip(frags, rows):
                        x = rX.load().to(Float32)  # the rms_norm kernel's expressions
                        ss = cute.arch.warp_reduction(
                            (x * x).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0),
                            operator.add)
                        if lane == 0:
                            sPart[m, v] = ss
        cute.arch.barrier()
        for m in cutlass.range(warp, self.tokens, THREADS // 32, unroll=1):
            t = Float32(0.0)  # `reduce.column_sums` of the warp totals, as block_sum does
            if lane < n_warps:
                t = t + sPart[m, lane]
            total = cute.arch.warp_reduction(t, operator.add)
            if const_expr(n_warps == 1):
                total = t  # block_sum of one warp: its total as it is (the same bits)
            if lane == 0:
                sRstd[m] = Float32(0.0)
                if m < n_rows:
                    sRstd[m] = cute.math.rsqrt(total / self.k + eps, fastmath=True)

    @cute.jit
    def load_norm_weight(self, mG: cute.Tensor, sG: cute.Tensor, rG: cute.Tensor, k_first,
                         k_count, tidx):
        """sG (8, vectors): the norm weight of this CTA's K slices k_first... (k_count of
        them; zero past K, where the TMA zero-fills x), copied once before the main loop, so
        no stage waits on a global load of it (the version that loaded each slice's vector
        from global memory before the stage's wait ran at 0.43x the two launches on the H200,
        BENCHMARKS.md session 22)."""
        first = k_first * (TILE_K // 8)
        for i in cutlass.range(tidx, k_count * (TILE_K // 8), THREADS, unroll=1):
            rG.fill(0)
            if first + i < self.k // 8:
                cute.autovec_copy(vectors(mG)[None, first + i], rG[None, 0])
            sG[None, i].store(rG[None, 0].load())

    @cute.jit
    def fill_resident(self, mX: cute.Tensor, sXflat: cute.Tensor, sG: cute.Tensor,
                      sRstd: cute.Tensor, k_first, k_count, tidx):
        """x̂ = bf16(g · bf16(x · rstd_m)) (the rms_norm kernel's roundings) of the CTA's K
        slices, written once into the resident x slices. Item i = tidx + j·THREADS is 16-byte
        chunk c = i % 8 of token t = (i // 8) % T of slice s = i // (8·T): a warp reads 4
        tokens' 128 contiguous bytes of one slice. A group of items' loads is issued before its
        math. Tokens past M and columns past K are zero (what the TMA's fill gives the plain
        kernel). Each chunk is one 16-byte store into sXflat (the x slices' bytes, unswizzled)
        at the MMA's 128-byte swizzle: the slice's rows are 128 bytes, 8-row atoms tile along
        the tokens, and chunk c of row t sits at chunk c ⊕ (t mod 8) of its row."""
        chunks = TILE_K // 8
        n_rows, nv = mX.shape[0], self.k // 8
        per_thread = -(-self.x_stages * self.tokens * chunks // THREADS)
        group = 8
        for j0 in cutlass.range_constexpr(0, per_thread, group):
            items = range(j0, min(j0 + group, per_thread))
            frags = [make_frag(BFloat16, 1) for _ in items]
            for rX, j in zip(frags, items):
                i = j * THREADS + tidx
                c, t, s = i % chunks, (i // chunks) % self.tokens, i // (chunks * self.tokens)
                v = (k_first + s) * chunks + c
                rX.fill(0)
                if s < k_count:
                    if t < n_rows:
                        if v < nv:
                            cute.autovec_copy(row_vectors(mX, t)[None, v], rX[None, 0])
            rY = make_frag(BFloat16, 1)
            for rX, j in zip(frags, items):
                i = j * THREADS + tidx
                c, t, s = i % chunks, (i // chunks) % self.tokens, i // (chunks * self.tokens)
                if s < k_count:
                    g = sG[None, s * chunks + c].load().to(Float32)
                    rstd = sRstd[t]
                    for e in range(8):
                        x = rX[e, 0].to(Float32)
                        rY[e, 0] = ((x * rstd).to(BFloat16).to(Float32) * g[e]).to(BFloat16)
                    at = (s * self.tokens + t) * chunks + (c ^ (t % 8))
                    cute.autovec_copy(rY[None, 0], vectors(sXflat)[None, at])

    @cute.jit
    def body(self, tma_w: cute.CopyAtom, tW: cute.Tensor, tma_x: cute.CopyAtom, tX: cute.Tensor,
             mR, mY: cute.Tensor, mY2, beta, linear_beta, tiled_mma: cute.TiledMma,
             sW_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout,
             sWt_layout: cute.ComposedLayout, mX=None, mG=None, eps=None):
        # sWt_layout: W's stages as the TMA writes them (with SiTU 2·stages half tiles)
        pdl_launch_dependents(self.pdl and not self.late_trigger)
        tidx, _, _ = cute.arch.thread_idx()
        tile, split, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cpasync.prefetch_descriptor(tma_w)
            if const_expr(not self.fusion.norm):  # the norm prologue writes x̂ itself
                cpasync.prefetch_descriptor(tma_x)
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
            tx_count=(self.rows + (0 if self.fusion.norm else self.tokens)) * TILE_K * 2,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        sW = storage.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)  # (R, 64, st)
        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)  # (T, 64, st)
        gX = cute.local_tile(tX, (self.tokens, TILE_K), (0, None))  # (T, 64, k_tiles)
        if const_expr(self.fusion.situ):
            # half tiles: rows tile·R/2... of W_g, and the same rows of W_u (I = N/2 further);
            # sWt: (R/2, 64, 2·stages)
            sWt = storage.sW.get_tensor(sWt_layout.outer, swizzle=sWt_layout.inner)
            tWsW, gate = self.w_partition(tma_w, tW, sWt, tile, self.half)
            _, up = self.w_partition(tma_w, tW, sWt, tile + self.n // 2 // self.half, self.half)
            tWgW = (gate, up)
        else:
            gW = cute.local_tile(tW, (self.rows, TILE_K), (tile, None))  # (R, 64, k_tiles)
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
        if const_expr(self.fusion.norm):
            # W only: x̂ is resident (before the PDL wait: a weight)
            if warp == 0:
                for _ in cutlass.range(cutlass.min(self.stages, k_count), unroll=1):
                    self.load_w_only(pipe, loads, tma_w, tWgW, tWsW, k_first)
                    loads.advance()
            pdl_wait(self.pdl)
        elif const_expr(self.pdl):
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
        sRstd, sG = None, None
        if const_expr(self.fusion.norm):
            # rstd of the tile's tokens while the first stages land (x read again, from L2)
            sRstd = storage.rstd.get_tensor(cute.make_layout(self.tokens))
            n_warps = self.rms.threads // 32
            sPart = storage.part.get_tensor(cute.make_layout((self.tokens, n_warps),
                                                             stride=(n_warps, 1)))
            sG = storage.g.get_tensor(cute.make_layout((8, self.g_vectors), stride=(1, 8)))
            self.load_norm_weight(mG, sG, make_frag(BFloat16, 1), k_first, k_count, tidx)
            self.row_rstd(mX, eps, sPart, sRstd, warp, cute.arch.lane_idx())
            cute.arch.barrier()
            sXflat = storage.sX.get_tensor(
                cute.make_layout(self.x_stages * self.tokens * TILE_K))
            self.fill_resident(mX, sXflat, sG, sRstd, k_first, k_count, tidx)
            # the threads' stores reach the MMA's async proxy through the fence, every
            # thread's through the barrier
            cute.arch.fence_view_async_shared()
            cute.arch.barrier()
        reads = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        for _ in cutlass.range(k_count, unroll=1):
            pipe.consumer_wait(reads)
            # x's slice: the stage's, or with the norm prologue the resident slice k_first +
            # reads.count
            x_slice = reads.count if const_expr(self.fusion.norm) else reads.index
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tCrW, mode=[2])):
                cute.gemm(tiled_mma, acc, tCrW[None, None, kb, reads.index],
                          tCrX[None, None, kb, x_slice], acc)
            warpgroup.commit_group()
            # The MMAs are tiny next to a slice's load: finish them, so the stage refills now.
            warpgroup.wait_group(0)
            pipe.consumer_release(reads)
            reads.advance()
            if warp == 0 and loads.count < k_count:
                if const_expr(self.fusion.norm):
                    self.load_w_only(pipe, loads, tma_w, tWgW, tWsW, k_first)
                else:
                    self.load_slice(pipe, loads, tma_w, tWgW, tWsW, tma_x, tXgX, tXsX,
                                    k_first)
                loads.advance()
        pdl_launch_dependents(self.pdl and self.late_trigger)

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
        if const_expr(self.fusion.situ):
            self.store_situ(sP, tile, tidx, mY, beta, linear_beta)
        else:
            self.reduce_store(sP, tile, tidx, mR, mY, mY2)
        if const_expr(self.splits > 1):
            cute.arch.cluster_arrive()  # the peers may still read this CTA's tile
            cute.arch.cluster_wait()

    @cute.jit
    def reduce_store(self, sP: cute.Tensor, tile, tidx, mR, mY: cute.Tensor, mY2):
        """This CTA's rows of the tile, summed over the cluster's partials in rank order:
        element e = token · R/S + row, so consecutive threads write consecutive columns of y
        (with a split: columns >= split of y2)."""
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
                if const_expr(self.fusion.split):
                    if col >= self.fusion.split:
                        mY2[m, col - self.fusion.split] = total.to(BFloat16)
                    else:
                        mY[m, col] = total
                else:
                    if const_expr(self.out_fp32):
                        mY[m, col] = total
                    else:
                        mY[m, col] = total.to(BFloat16)

    def peer_sum(self, sP: cute.Tensor, row, m):
        """Row `row`, token m of the tile summed over the cluster's partials in rank order."""
        total = Float32(0.0)
        if const_expr(self.splits == 1):
            total = sP[row, m]
        else:
            ptr = sP.iterator + cute.crd2idx((row, m), sP.layout)
            for p in range(self.splits):
                total = total + load_from_peer(ptr, p)
        return total

    @cute.jit
    def store_situ(self, sP: cute.Tensor, tile, tidx, mY: cute.Tensor, beta: Float32,
                   linear_beta: Float32):
        """y[m, n] = bf16(SiTU(bf16(g), bf16(u))) of this CTA's pairs of the tile (gate row h,
        up row R/2 + h), each sum over the cluster's partials in rank order and rounded to bf16
        like the GEMM output the situ kernel reads; then the situ kernel's math. Element
        e = token · R/(2S) + pair: consecutive threads write consecutive columns of y."""
        share = self.half // self.splits
        rank = cute.arch.block_idx_in_cluster()
        n_tokens = mY.shape[0]
        for j in cutlass.range_constexpr(-(-share * self.tokens // THREADS)):
            e = j * THREADS + tidx
            h = rank * share + e % share
            m, col = e // share, tile * self.half + h
            write = m < n_tokens
            if const_expr((j + 1) * THREADS > share * self.tokens):
                write = write & (e < share * self.tokens)
            if write:
                g = self.peer_sum(sP, h, m).to(BFloat16).to(Float32)
                u = self.peer_sum(sP, self.half + h, m).to(BFloat16).to(Float32)
                sig = 1.0 / (1.0 + cute.math.exp(-g, fastmath=True))
                act = beta * cute.math.tanh(g / beta, fastmath=False) * sig
                lin = linear_beta * cute.math.tanh(u / linear_beta, fastmath=False)
                mY[m, col] = (act * lin).to(BFloat16)
