"""`MoEFrontRoute`, the CuTe DSL kernel of kernels/moe_front_route.py: gemv's split variant
(`Gemv` with `Fusion(split=E)`) whose last CTA to finish routes every row with `MoERoute`'s
device code.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import Float32, Int32, cute

from ..common.gemv import Config, Fusion
from ..moe_route import Config as RouteConfig
from .gemv import Gemv
from .last_cta import arrive
from .moe_route import MoERoute


class MoEFrontRoute(Gemv):
    def __init__(self, n: int, k: int, m_bucket: int, cfg: Config, split: int, top_k: int,
                 pdl: bool = False):
        super().__init__(n, k, m_bucket, cfg, True, False, pdl, Fusion(split=split))
        # the routing in the gemv's own CTA shape: T threads, ceil(E/4 / T) float4s each
        n_vec = split // 4
        self.router = MoERoute(split, top_k, RouteConfig(cfg.threads, -(-n_vec // cfg.threads)))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mY2: cute.Tensor,
                 mBias: cute.Tensor, mIds: cute.Tensor, mWeights: cute.Tensor,
                 mCount: cute.Tensor, scaling: Float32, stream):
        # mX: (M, K); mW: (E + L, K); mY: (M, E) fp32 logits; mY2: (M, L) bf16; mBias: (E,);
        # mIds, mWeights: (M, top_k); mCount: (1,) int32, 0 between launches
        smem = (self.red_bytes + 4 * self.n_warps * self.mb + 128 + self.router.smem_bytes + 64)
        self.kernel_routed(mX, mW, mY, mY2, mBias, mIds, mWeights, mCount, scaling).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1], smem=smem, stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel_routed(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor,
                      mY2: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                      mWeights: cute.Tensor, mCount: cute.Tensor, scaling: Float32):
        self.body(mX, mW, None, mY, mY2, None, None, None, None)
        self.route_if_last(mY, mBias, mIds, mWeights, mCount, scaling, mX.shape[0])

    @cute.jit
    def route_if_last(self, mY: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                      mWeights: cute.Tensor, mCount: cute.Tensor, scaling: Float32, n_rows):
        """The "last block" pattern (`last_cta.arrive`): the last CTA to finish routes each
        row. No CTA waits for another."""
        tidx = cute.arch.thread_idx()[0]
        smem = cutlass.memory.SmemAllocator()
        sLast = smem.allocate_tensor(Int32, cute.make_layout((4,)), 16)  # (4,): [0] the flag
        buffers = self.router.allocate(smem)
        if arrive(mCount, self.ctas, sLast):
            cute.arch.fence_acq_rel_gpu()  # acquire: every CTA's logits are visible
            rB = self.router.load_bias(mBias, tidx)
            for row in cutlass.range(n_rows, unroll=1):
                self.router.route_row(mY, rB, mIds, mWeights, scaling, row, tidx, buffers)
                cute.arch.barrier()  # warp 0 is done with the buffers before the next row
