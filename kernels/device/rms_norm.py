"""`RMSNorm`, the CuTe DSL kernel of kernels/rms_norm.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import BFloat16, Float32, const_expr, cute

from ..common.copy import load_vectors, make_frag, row_vectors, store_vectors, vectors
from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..common.reduce import block_sum
from ..rms_norm import Config


class RMSNorm:
    """`fp32_weight` (`k3compile.math.rms_norm_fp32_weight`): x bf16 or fp32 (`x_fp32`), the
    weight bf16 or fp32 (`w_fp32`), multiplied in fp32 before the one rounding to bf16. Every
    vector is 8 elements (16 bytes of bf16, 32 of fp32), so a thread's x, weight and y vectors
    cover the same columns whatever their dtypes."""

    def __init__(self, dim: int, cfg: Config, pdl: bool = False, fp32_weight: bool = False,
                 x_fp32: bool = False, w_fp32: bool = False):
        self.dim, self.n_vec, self.pdl = dim, dim // 8, pdl
        self.threads, self.v = cfg.threads, cfg.vec_per_thread
        self.n_warps = cfg.threads // 32
        self.fp32_weight = fp32_weight
        self.x_dtype = Float32 if x_fp32 else BFloat16
        self.w_dtype = Float32 if w_fp32 else BFloat16

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32,
                 stream):
        # mX, mY: (N, D); mW: (D,)
        self.kernel(mX, mW, mY, eps).launch(grid=[mX.shape[0], 1, 1],
                                            block=[self.threads, 1, 1],
                                            smem=4 * self.n_warps + 64, stream=stream,
                                            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32):
        pdl_launch_dependents(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        T, nv = self.threads, self.n_vec
        smem = cutlass.memory.SmemAllocator()
        sSum = smem.allocate_tensor(Float32, cute.make_layout((self.n_warps, 1)), 16)
        rX, rW = make_frag(self.x_dtype, self.v, 8), make_frag(self.w_dtype, self.v, 8)  # (8, V)
        gX, gW = row_vectors(mX, row), vectors(mW)
        if const_expr(self.fp32_weight):  # 8 columns a vector whatever the dtype
            gX, gW = vectors(mX[row, None], 8), vectors(mW, 8)
        if const_expr(self.pdl):  # the weight first: it loads while the producer of x ends
            load_vectors(gW, rW, tidx, T, nv)
        pdl_wait(self.pdl)
        load_vectors(gX, rX, tidx, T, nv)
        if const_expr(not self.pdl):
            load_vectors(gW, rW, tidx, T, nv)
        x = rX.load().to(Float32)
        ss = block_sum([(x * x).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)],
                       sSum, self.n_warps)[0]
        rstd = cute.math.rsqrt(ss / self.dim + eps, fastmath=True)
        if const_expr(self.fp32_weight):
            rY = make_frag(BFloat16, self.v)
            rY.store((x * rstd * rW.load().to(Float32)).to(BFloat16))
            store_vectors(rY, row_vectors(mY, row), tidx, T, nv)
        else:
            rX.store(((x * rstd).to(BFloat16).to(Float32) * rW.load().to(Float32)).to(BFloat16))
            store_vectors(rX, row_vectors(mY, row), tidx, T, nv)
