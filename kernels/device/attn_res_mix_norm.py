"""`AttnResMixNorm`, the CuTe DSL kernel of kernels/attn_res_mix_norm.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import BFloat16, Float32, const_expr, cute

from ..attn_res_mix_norm import Config
from ..common.copy import (
    bf16_halves,
    load_vectors,
    make_frag,
    row_vectors,
    store_vectors,
    vectors,
)
from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..common.reduce import row_sum


class AttnResMixNorm:
    def __init__(self, dim: int, n_blocks: int, has_delta: bool, cfg: Config,
                 pdl: bool = False, norm_weight_fp32: bool = False):
        self.dim, self.n_blocks, self.has_delta, self.pdl = dim, n_blocks, has_delta, pdl
        self.norm_weight_fp32 = norm_weight_fp32
        self.n_src = n_blocks + 1
        self.threads, self.v, self.cluster_n = cfg.threads, cfg.vec_per_thread, cfg.cluster_n
        self.n_vec = dim // 8 // cfg.cluster_n  # vectors of a row per CTA
        self.n_warps = cfg.threads // 32
        self.smem_bytes = 4 * cfg.cluster_n * self.n_warps * (2 * self.n_src + 1) + 64

    @cute.jit
    def __call__(self, mPrefix: cute.Tensor, mDelta, blocks, mWn, mWp, mWx: cute.Tensor,
                 mPrefixOut: cute.Tensor, mX: cute.Tensor, mix_eps: Float32,
                 norm_eps: Float32, stream):
        # mPrefix, mDelta, blocks[i], mPrefixOut, mX: (N, D); mWn, mWp, mWx: (D,)
        C = self.cluster_n
        self.kernel(mPrefix, mDelta, blocks, mWn, mWp, mWx, mPrefixOut, mX, mix_eps,
                    norm_eps).launch(grid=[C, mPrefix.shape[0], 1], block=[self.threads, 1, 1],
                                     cluster=[C, 1, 1] if const_expr(C > 1) else None,
                                     smem=self.smem_bytes, stream=stream,
                                     use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mPrefix: cute.Tensor, mDelta, blocks, mWn, mWp, mWx: cute.Tensor,
               mPrefixOut: cute.Tensor, mX: cute.Tensor, mix_eps: Float32,
               norm_eps: Float32):
        pdl_launch_dependents(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        rank, row, _ = cute.arch.block_idx()  # rank: this CTA's column slice of the row
        T, nv, S, C, V = self.threads, self.n_vec, self.n_src, self.cluster_n, self.v
        if const_expr(C > 1):
            cute.arch.cluster_arrive_relaxed()  # matched in the first row_sum
        first = rank * nv
        smem = cutlass.memory.SmemAllocator()
        sMix = smem.allocate_tensor(Float32, cute.make_layout((C * self.n_warps, 2 * S)), 16)
        sNorm = smem.allocate_tensor(Float32, cute.make_layout((C * self.n_warps, 1)), 16)

        # Issue every load first: sources (blocks..., prefix) and delta, then wn and wp (with
        # PDL wn and wp first: they load while the previous kernel finishes).
        if const_expr(S > 1):
            rWn, rWp = make_frag(BFloat16, V), make_frag(BFloat16, V)
            if const_expr(self.pdl):
                load_vectors(vectors(mWn), rWn, tidx, T, nv, first)
                load_vectors(vectors(mWp), rWp, tidx, T, nv, first)
        pdl_wait(self.pdl)
        rSrc, rDelta = self.load_sources(mPrefix, mDelta, blocks, row, tidx, first)
        if const_expr(S > 1 and not self.pdl):
            load_vectors(vectors(mWn), rWn, tidx, T, nv, first)
            load_vectors(vectors(mWp), rWp, tidx, T, nv, first)
        self.add_delta(rSrc, rDelta)
        store_vectors(rSrc[S - 1], row_vectors(mPrefixOut, row), tidx, T, nv, first)

        rWx = make_frag(BFloat16, V)
        h = rSrc[S - 1].load().to(Float32)
        if const_expr(S > 1):
            partial = self.partials(rSrc, rWn, rWp)
            # wx is needed last: load it now, behind the barrier, once wn/wp are dead.
            load_vectors(vectors(mWx), rWx, tidx, T, nv, first)
            h = self.mix(rSrc, row_sum(partial, sMix, self.n_warps, C, True), mix_eps)
        else:
            load_vectors(vectors(mWx), rWx, tidx, T, nv, first)

        hb = h.to(BFloat16).to(Float32)  # the mix output is a bf16 tensor in the model
        ss = row_sum([self.square_sum(hb)], sNorm, self.n_warps, C, S == 1)[0]
        rOut = self.normed(hb, ss, norm_eps, rWx)
        store_vectors(rOut, row_vectors(mX, row), tidx, T, nv, first)

    # The steps of one thread's share of a row (vectors first + j·T + tidx), also run by the
    # one-launch oproj_attn_res_mix_norm kernel for each thread of this kernel's grid in turn.

    @cute.jit
    def load_sources(self, mPrefix: cute.Tensor, mDelta, blocks, row, tidx, first):
        """Fragments (8, V) of the sources (blocks..., prefix) and of delta (or None)."""
        T, nv, S, V = self.threads, self.n_vec, self.n_src, self.v
        rSrc = [make_frag(BFloat16, V) for _ in range(S)]  # each (8, V)
        for i in cutlass.range_constexpr(S - 1):
            load_vectors(row_vectors(blocks[i], row), rSrc[i], tidx, T, nv, first)
        load_vectors(row_vectors(mPrefix, row), rSrc[S - 1], tidx, T, nv, first)
        rDelta = None
        if const_expr(self.has_delta):
            rDelta = make_frag(BFloat16, V)
            load_vectors(row_vectors(mDelta, row), rDelta, tidx, T, nv, first)
        return rSrc, rDelta

    @cute.jit
    def add_delta(self, rSrc: list, rDelta):
        """p = bf16(prefix + delta) in place of the prefix: the model's bf16 add, rounded before
        reuse."""
        if const_expr(self.has_delta):
            p = rSrc[-1].load().to(Float32) + rDelta.load().to(Float32)
            rSrc[-1].store(p.to(BFloat16))

    @cute.jit
    def partials(self, rSrc: list, rWn: cute.Tensor, rWp: cute.Tensor) -> list:
        """This thread's (Σ v², Σ v·wn·wp) of each source, elements in a fixed order."""
        # Widen through integer ops here and through cvt in the mix: the compiler would
        # otherwise keep one fp32 copy of every source live across the barrier.
        wn_lo, wn_hi = bf16_halves(rWn.load())
        wp_lo, wp_hi = bf16_halves(rWp.load())
        w_lo, w_hi = wn_lo * wp_lo, wn_hi * wp_hi
        partial = []
        for i in cutlass.range_constexpr(self.n_src):
            lo, hi = bf16_halves(rSrc[i].load())
            ss, dot = Float32(0.0), Float32(0.0)
            for e in cutlass.range_constexpr(4 * self.v):  # one fma per element and sum
                ss = ss + lo[e] * lo[e]
                ss = ss + hi[e] * hi[e]
                dot = dot + lo[e] * w_lo[e]
                dot = dot + hi[e] * w_hi[e]
            partial += [ss, dot]
        return partial

    @cute.jit
    def mix(self, rSrc: list, total: list, mix_eps: Float32):
        """h = Σ_i α_i·v_i (fp32) from the row's totals of `partials`."""
        S = self.n_src
        scores = [total[2 * i + 1] * cute.math.rsqrt(total[2 * i] / self.dim + mix_eps,
                                                     fastmath=True) for i in range(S)]
        s_max = scores[0]
        for i in cutlass.range_constexpr(1, S):
            s_max = cute.arch.fmax(s_max, scores[i])
        e = [cute.math.exp(s - s_max, fastmath=True) for s in scores]
        z = e[0]
        for i in cutlass.range_constexpr(1, S):
            z = z + e[i]
        inv_z = 1.0 / z
        h = rSrc[0].load().to(Float32) * (e[0] * inv_z)
        for i in cutlass.range_constexpr(1, S):
            h = h + rSrc[i].load().to(Float32) * (e[i] * inv_z)
        return h

    @cute.jit
    def square_sum(self, hb):
        return (hb * hb).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)

    @cute.jit
    def normed(self, hb, ss: Float32, norm_eps: Float32, rWx: cute.Tensor) -> cute.Tensor:
        """x = bf16(wx · bf16(h · rstd)) from the row's Σ h² (the rms_norm kernel's roundings);
        with norm_weight_fp32 bf16(h · rstd · wx), one rounding (`math.rms_norm_fp32_weight`)."""
        rstd = cute.math.rsqrt(ss / self.dim + norm_eps, fastmath=True)
        if const_expr(self.norm_weight_fp32):
            y = (hb * rstd) * rWx.load().to(Float32)
        else:
            y = (hb * rstd).to(BFloat16).to(Float32) * rWx.load().to(Float32)
        rOut = make_frag(BFloat16, self.v)
        rOut.store(y.to(BFloat16))
        return rOut
