"""`MLALowRankNorm`, the CuTe DSL kernel of kernels/mla_lowrank_norm.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import BFloat16, Float32, const_expr, cute

from ..common.copy import (
    load_vectors,
    make_frag,
    row_vectors,
    store_vectors,
    vectors,
)
from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..common.reduce import block_sum
from ..mla_lowrank_norm import Config


class MLALowRankNorm:
    def __init__(self, q_dim: int, c_dim: int, r_dim: int, cfg: Config, pdl: bool = False,
                 weight_fp32: bool = False):
        self.q_dim, self.c_dim, self.r_dim, self.pdl = q_dim, c_dim, r_dim, pdl
        self.weight_fp32 = weight_fp32
        self.nq, self.nc, self.nr = q_dim // 8, c_dim // 8, r_dim // 8
        self.threads, self.n_warps = cfg.threads, cfg.threads // 32

    @cute.jit
    def __call__(self, mCq: cute.Tensor, mCkv: cute.Tensor, mWq: cute.Tensor,
                 mWkv: cute.Tensor, mQ: cute.Tensor, mKv: cute.Tensor, mPe,
                 eps: Float32, stream):
        # mCq, mQ: (N, Q); mCkv: (N, C + R); mKv: (N, C); mPe: (N, R); mWq: (Q,); mWkv: (C,)
        self.kernel(mCq, mCkv, mWq, mWkv, mQ, mKv, mPe, eps).launch(
            grid=[mCq.shape[0], 1, 1], block=[self.threads, 1, 1],
            smem=8 * self.n_warps + 64, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mCq: cute.Tensor, mCkv: cute.Tensor, mWq: cute.Tensor,
               mWkv: cute.Tensor, mQ: cute.Tensor, mKv: cute.Tensor, mPe, eps: Float32):
        pdl_launch_dependents(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        T = self.threads
        smem = cutlass.memory.SmemAllocator()
        sSum = smem.allocate_tensor(Float32, cute.make_layout((self.n_warps, 2)), 16)
        vq, vc = -(-self.nq // T), -(-self.nc // T)
        gCkv = row_vectors(mCkv, row)  # (8, (C + R) / 8): c vectors, then k_pe vectors
        rCq, rWq = make_frag(BFloat16, vq), make_frag(BFloat16, vq)  # (8, vq)
        rC, rWkv = make_frag(BFloat16, vc), make_frag(BFloat16, vc)  # (8, vc)
        if const_expr(self.pdl):  # the weights first: they load while the producer ends
            load_vectors(vectors(mWq), rWq, tidx, T, self.nq)
            load_vectors(vectors(mWkv), rWkv, tidx, T, self.nc)
        pdl_wait(self.pdl)
        load_vectors(row_vectors(mCq, row), rCq, tidx, T, self.nq)
        load_vectors(gCkv, rC, tidx, T, self.nc)
        if const_expr(self.nr > 0):
            rPe = make_frag(BFloat16, -(-self.nr // T))
            load_vectors(gCkv, rPe, tidx, T, self.nr, first=self.nc)
        if const_expr(not self.pdl):
            load_vectors(vectors(mWq), rWq, tidx, T, self.nq)
            load_vectors(vectors(mWkv), rWkv, tidx, T, self.nc)
        if const_expr(self.nr > 0):
            store_vectors(rPe, row_vectors(mPe, row), tidx, T, self.nr)

        q, c = rCq.load().to(Float32), rC.load().to(Float32)
        ss_q, ss_c = block_sum([(q * q).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0),
                                (c * c).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)],
                               sSum, self.n_warps)
        rstd_q = cute.math.rsqrt(ss_q / self.q_dim + eps, fastmath=True)
        rstd_c = cute.math.rsqrt(ss_c / self.c_dim + eps, fastmath=True)
        if const_expr(self.weight_fp32):  # bf16(x · rstd · w): one rounding
            rCq.store(((q * rstd_q) * rWq.load().to(Float32)).to(BFloat16))
            rC.store(((c * rstd_c) * rWkv.load().to(Float32)).to(BFloat16))
        else:  # bf16(w · bf16(x · rstd)): the rms_norm kernel's roundings
            rCq.store(((q * rstd_q).to(BFloat16).to(Float32) * rWq.load().to(Float32))
                      .to(BFloat16))
            rC.store(((c * rstd_c).to(BFloat16).to(Float32) * rWkv.load().to(Float32))
                     .to(BFloat16))
        store_vectors(rCq, row_vectors(mQ, row), tidx, T, self.nq)
        store_vectors(rC, row_vectors(mKv, row), tidx, T, self.nc)
