"""`OProjMixNorm`, the CuTe DSL kernel of kernels/oproj_attn_res_mix_norm.py: gemv's plain build
over W_o writes a = o·W_oᵀ (bf16) to a scratch buffer; its last CTA to finish
(`last_cta.arrive`) runs the attn_res_mix_norm kernel's steps (`AttnResMixNorm`) for every row.

That CTA plays the mix kernel's whole grid of a row: the C·W warps of its C cluster CTAs (W warps
each) are virtual warps, v = warp + t·(this CTA's warps), v standing for warp v % W of CTA v // W.
Each virtual warp loads and sums exactly what that warp does there (same vectors, same per-thread
order, the same warp butterfly), and the warp totals are added up in the same row order
(`column_sums`), so every output is the two-launch path's bit for bit.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import operator

import cutlass
from cutlass import BFloat16, Float32, Int32, const_expr, cute
from cutlass.cutlass_dsl import dsl_user_op

from ..attn_res_mix_norm import Config as MixConfig
from ..common.copy import load_vectors, make_frag, row_vectors, store_vectors, vectors
from ..common.gemv import Config
from ..common.reduce import column_sums
from .attn_res_mix_norm import AttnResMixNorm
from .gemv import Gemv
from .last_cta import arrive


@dsl_user_op
def prefetch_l2(ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """prefetch.global.L2 of the line holding ptr: no register waits for it."""
    cute.arch.prefetch(ptr.to_llvm_ptr(loc=loc, ip=ip), cache_level="L2", loc=loc, ip=ip)


class OProjMixNorm(Gemv):
    def __init__(self, dim: int, k: int, m_bucket: int, cfg: Config, n_blocks: int,
                 has_prefix: bool, mix_cfg: MixConfig, pdl: bool = False):
        super().__init__(dim, k, m_bucket, cfg, False, False, pdl)
        self.has_prefix = has_prefix
        self.mix = AttnResMixNorm(dim, n_blocks, has_prefix, mix_cfg)  # the row's math
        self.mix_warps = mix_cfg.threads // 32  # W
        self.virtual = mix_cfg.cluster_n * self.mix_warps  # C·W virtual warps per row
        self.turns = -(-self.virtual // self.n_warps)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mW: cute.Tensor, mA: cute.Tensor, mPrefix, blocks,
                 mWn, mWp, mWx: cute.Tensor, mPrefixOut: cute.Tensor, mX: cute.Tensor,
                 mCount: cute.Tensor, mix_eps: Float32, norm_eps: Float32, stream):
        # mO: (M, K); mW: (D, K); mA, mPrefix, blocks[i], mPrefixOut, mX: (M, D) rows;
        # mWn, mWp, mWx: (D,); mCount: (1,) int32, 0 between launches
        smem = self.red_bytes + 64 + 16 + 4 * self.virtual * (2 * self.mix.n_src + 1) + 64
        self.kernel_mixed(mO, mW, mA, mPrefix, blocks, mWn, mWp, mWx, mPrefixOut, mX, mCount,
                          mix_eps, norm_eps).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], smem=smem, stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel_mixed(self, mO: cute.Tensor, mW: cute.Tensor, mA: cute.Tensor, mPrefix, blocks,
                     mWn, mWp, mWx: cute.Tensor, mPrefixOut: cute.Tensor, mX: cute.Tensor,
                     mCount: cute.Tensor, mix_eps: Float32, norm_eps: Float32):
        self.body(mO, mW, None, mA, None, None, None, None, None)
        self.prefetch(mPrefix, blocks, mWn, mWp, mWx, mO.shape[0])
        smem = cutlass.memory.SmemAllocator()
        sLast = smem.allocate_tensor(Int32, cute.make_layout((4,)), 16)  # (4,): [0] the flag
        S, V = self.mix.n_src, self.virtual
        sMix = smem.allocate_tensor(Float32, cute.make_layout((V, 2 * S)), 16)
        sNorm = smem.allocate_tensor(Float32, cute.make_layout((V, 1)), 16)
        if arrive(mCount, self.ctas, sLast):
            cute.arch.fence_acq_rel_gpu()  # acquire: every CTA's a is visible
            # a is the mix's delta after the prefix, or its prefix where a block starts
            first, delta = (mPrefix, mA) if const_expr(self.has_prefix) else (mA, None)
            for row in cutlass.range(mO.shape[0], unroll=1):
                self.mix_row(first, delta, blocks, mWn, mWp, mWx, mPrefixOut, mX, mix_eps,
                             norm_eps, row, sMix, sNorm)

    @cute.jit
    def prefetch(self, mPrefix, blocks, mWn, mWp, mWx: cute.Tensor, n_rows):
        """Every CTA, its GEMV done, prefetches into L2 a few 128-byte lines of the mix's inputs
        (the blocks' and the prefix's rows, then wn, wp, wx), one line a thread over the grid:
        the last CTA's passes then wait on L2, not on HBM. Changes no value."""
        cta, _, _ = cute.arch.block_idx()
        g = cta * self.threads + cute.arch.thread_idx()[0]  # this thread's line over the grid
        per_row = -(-self.n * 2 // 128)  # lines of a bf16 row of D
        rows = list(blocks) if const_expr(self.mix.n_blocks > 0) else []
        if const_expr(self.has_prefix):
            rows.append(mPrefix)
        vecs = [mWn, mWp, mWx] if const_expr(self.mix.n_blocks > 0) else [mWx]
        base = Int32(0)
        for t in cutlass.range_constexpr(len(rows)):
            i = g - base
            if i >= 0 and i < n_rows * per_row:
                m, c = i // per_row, (i % per_row) * 64
                prefetch_l2(rows[t].iterator + cute.crd2idx((m, c), rows[t].layout))
            base = base + n_rows * per_row
        for t in cutlass.range_constexpr(len(vecs)):
            i = g - base
            if i >= 0 and i < per_row:
                prefetch_l2(vecs[t].iterator + i * 64)
            base = base + per_row

    def share(self, t):
        """Virtual warp of turn t, and its thread index and first vector in the mix's grid."""
        vw = cute.arch.warp_idx() + t * self.n_warps
        tidx = (vw % self.mix_warps) * 32 + cute.arch.lane_idx()
        return vw, tidx, (vw // self.mix_warps) * self.mix.n_vec

    @cute.jit
    def publish(self, vals: list, sBuf: cute.Tensor, vw):
        """row_sum's first step for virtual warp vw: warp butterflies, lane 0 stores row vw."""
        vals = [cute.arch.warp_reduction(v, operator.add) for v in vals]
        if cute.arch.lane_idx() == 0:
            for k in cutlass.range_constexpr(len(vals)):
                sBuf[vw, k] = vals[k]

    @cute.jit
    def mix_row(self, mPrefix: cute.Tensor, mDelta, blocks, mWn, mWp, mWx: cute.Tensor,
                mPrefixOut: cute.Tensor, mX: cute.Tensor, mix_eps: Float32, norm_eps: Float32,
                row, sMix: cute.Tensor, sNorm: cute.Tensor):
        """One row in three passes over the virtual warps: sources, prefix_out and the score
        sums; the mix (sources again, from L1/L2), bf16(h) parked in x and Σ h²; the norm over
        x (each thread reads back only what it wrote). Barriers between passes (they also keep
        the next row's stores off buffers still being read)."""
        S = self.mix.n_src
        srcs = (mPrefix, mDelta, blocks, row)
        # Loops, not unrolled: unrolled, ptxas overlapped the turns' loads at 254 registers a
        # thread, which would cut the gemv's CTAs per SM.
        for t in cutlass.range(self.turns, unroll=1):
            vw, tidx, first = self.share(t)
            if vw < self.virtual:
                self.sums(*srcs, mWn, mWp, mPrefixOut, sMix, vw, tidx, first)
        cute.arch.barrier()
        total = column_sums(sMix, self.virtual, 2 * S) if const_expr(S > 1) else None
        for t in cutlass.range(self.turns, unroll=1):
            vw, tidx, first = self.share(t)
            if vw < self.virtual:
                self.mixed(*srcs, total, mix_eps, mX, sNorm, vw, tidx, first)
        cute.arch.barrier()
        ss = column_sums(sNorm, self.virtual, 1)[0]
        for t in cutlass.range(self.turns, unroll=1):
            vw, tidx, first = self.share(t)
            if vw < self.virtual:
                self.normed(mWx, mX, row, ss, norm_eps, tidx, first)

    @cute.jit
    def sums(self, mPrefix: cute.Tensor, mDelta, blocks, row, mWn, mWp,
             mPrefixOut: cute.Tensor, sMix: cute.Tensor, vw, tidx, first):
        """Pass 1 of a virtual warp: its sources, its share of prefix_out, its score sums."""
        mix = self.mix
        S, T, nv, Vt = mix.n_src, mix.threads, mix.n_vec, mix.v
        rSrc, rDelta = mix.load_sources(mPrefix, mDelta, blocks, row, tidx, first)
        if const_expr(S > 1):
            rWn, rWp = make_frag(BFloat16, Vt), make_frag(BFloat16, Vt)
            load_vectors(vectors(mWn), rWn, tidx, T, nv, first)
            load_vectors(vectors(mWp), rWp, tidx, T, nv, first)
        mix.add_delta(rSrc, rDelta)
        store_vectors(rSrc[S - 1], row_vectors(mPrefixOut, row), tidx, T, nv, first)
        if const_expr(S > 1):
            self.publish(mix.partials(rSrc, rWn, rWp), sMix, vw)

    @cute.jit
    def mixed(self, mPrefix: cute.Tensor, mDelta, blocks, row, total, mix_eps: Float32,
              mX: cute.Tensor, sNorm: cute.Tensor, vw, tidx, first):
        """Pass 2: bf16(h) of its share into x, its Σ h²."""
        mix = self.mix
        rSrc, rDelta = mix.load_sources(mPrefix, mDelta, blocks, row, tidx, first)
        mix.add_delta(rSrc, rDelta)
        rH = make_frag(BFloat16, mix.v)
        if const_expr(mix.n_src > 1):
            rH.store(mix.mix(rSrc, total, mix_eps).to(BFloat16))
        else:
            rH.store(rSrc[0].load())
        store_vectors(rH, row_vectors(mX, row), tidx, mix.threads, mix.n_vec, first)
        self.publish([mix.square_sum(rH.load().to(Float32))], sNorm, vw)

    @cute.jit
    def normed(self, mWx: cute.Tensor, mX: cute.Tensor, row, ss: Float32, norm_eps: Float32,
               tidx, first):
        """Pass 3: x of its share, from the bf16(h) it parked there."""
        mix = self.mix
        T, nv = mix.threads, mix.n_vec
        rH, rWx = make_frag(BFloat16, mix.v), make_frag(BFloat16, mix.v)
        load_vectors(row_vectors(mX, row), rH, tidx, T, nv, first)
        load_vectors(vectors(mWx), rWx, tidx, T, nv, first)
        rOut = mix.normed(rH.load().to(Float32), ss, norm_eps, rWx)
        store_vectors(rOut, row_vectors(mX, row), tidx, T, nv, first)
