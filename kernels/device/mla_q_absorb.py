"""`MLAQAbsorb`, the CuTe DSL kernel of kernels/mla_q_absorb.py (the per-head absorption; the
q_b GEMM before it is the GEMM router's).

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import BFloat16, Float32, const_expr, cute

from ..common.copy import make_frag, vectors
from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..mla_q_absorb import Config


class MLAQAbsorb:
    """CTA (h, t): columns [t·CT, (t + 1)·CT) of q_lat's head h for every row. Thread
    (v, g, r) of (CV, DG, RG) owns column vector v, d-slice g (S = D / DG values) and rows
    r, r + RG, ...; the DG partial sums meet in shared memory, added in slice order."""

    def __init__(self, heads: int, nope: int, rope: int, latent: int, rows: int, cfg: Config,
                 pdl: bool = False):
        self.H, self.D, self.R, self.C, self.MB, self.pdl = heads, nope, rope, latent, rows, pdl
        self.CV, self.DG, self.RG = cfg.col_vectors, cfg.d_groups, cfg.row_groups
        self.CT, self.S, self.RPT = 8 * self.CV, nope // self.DG, -(-rows // self.RG)
        self.threads = self.CV * self.DG * self.RG
        self.smem = cfg.smem_bytes(nope, rows)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mW: cute.Tensor, mLat: cute.Tensor, mPe: cute.Tensor,
                 stream):
        # mQ: (N, H·(D + R)) the q_b GEMM's rows; mW: (H, D, C) W_UK; mLat: (N, H·C);
        # mPe: (N, H·R)
        self.kernel(mQ, mW, mLat, mPe).launch(
            grid=[self.H, self.C // self.CT, 1], block=[self.threads, 1, 1],
            smem=self.smem + 64, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mW: cute.Tensor, mLat: cute.Tensor, mPe: cute.Tensor):
        pdl_launch_dependents(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        h, tile, _ = cute.arch.block_idx()
        T, D, CV, DG, MB, S = self.threads, self.D, self.CV, self.DG, self.MB, self.S
        n_rows = mQ.shape[0]  # N <= MB
        smem = cutlass.memory.SmemAllocator()
        sW = smem.allocate_tensor(BFloat16, cute.make_layout((D, self.CT), stride=(self.CT, 1)),
                                  16)  # (D, CT): W_UK[h, :, tile]
        sQ = smem.allocate_tensor(BFloat16, cute.make_layout((MB, D), stride=(D, 1)),
                                  16)  # (MB, D): q_nope[:, h]
        sP = None
        if const_expr(DG > 1):  # (DG, MB, CT): each slice's partial sums
            sP = smem.allocate_tensor(Float32, cute.make_layout(
                (DG, MB, self.CT), stride=(MB * self.CT, self.CT, 1)), 16)
        rV = make_frag(BFloat16, 1)  # (8, 1)

        # W_UK's tile, before the PDL wait (a weight): every load in flight, then to smem
        n_w = D * CV
        rW = make_frag(BFloat16, -(-n_w // T))  # (8, ceil(D·CV / T))
        for j in cutlass.range_constexpr(-(-n_w // T)):
            i = tidx + j * T
            if i < n_w:
                cute.autovec_copy(vectors(mW[h, i // CV, None])[None, tile * CV + i % CV],
                                  rW[None, j])
        for j in cutlass.range_constexpr(-(-n_w // T)):
            i = tidx + j * T
            if i < n_w:
                cute.autovec_copy(rW[None, j], vectors(sW[i // CV, None])[None, i % CV])

        pdl_wait(self.pdl)
        self.stage_q(mQ, mPe, sQ, h, tile, tidx, n_rows)
        cute.arch.barrier()

        v, g, r0 = tidx % CV, (tidx // CV) % DG, tidx // (CV * DG)
        rAcc = make_frag(Float32, self.RPT, 8)  # (8, RPT): columns v of rows r0 + i·RG
        rAcc.fill(0.0)
        rQ = make_frag(BFloat16, self.RPT)  # (8, RPT): 8 d of each row
        for k in cutlass.range_constexpr(S // 8):
            d0 = g * S + 8 * k
            for i in cutlass.range_constexpr(self.RPT):
                cute.autovec_copy(vectors(sQ[r0 + i * self.RG, None])[None, d0 // 8],
                                  rQ[None, i])
            q = [rQ[None, i].load().to(Float32) for i in range(self.RPT)]
            for e in cutlass.range_constexpr(8):
                cute.autovec_copy(vectors(sW[d0 + e, None])[None, v], rV[None, 0])
                w = rV[None, 0].load().to(Float32)
                for i in cutlass.range_constexpr(self.RPT):
                    rAcc[None, i].store(rAcc[None, i].load() + q[i][e] * w)
        self.finish(rAcc, sP, mLat, h, tile, tidx, v, g, r0, n_rows)

    @cute.jit
    def stage_q(self, mQ: cute.Tensor, mPe: cute.Tensor, sQ: cute.Tensor, h, tile, tidx,
                n_rows):
        """q_nope of head h for every row into sQ (rows past N zero); CTA tile 0 also copies
        head h's q_pe to its contiguous output. Every load is issued before the first store."""
        T, D, R, MB = self.threads, self.D, self.R, self.MB
        nd, nr, head = D // 8, R // 8, h * ((D + R) // 8)  # vectors
        jn, jr = -(-MB * nd // T), -(-MB * nr // T)
        rQn, rPe = make_frag(BFloat16, jn), make_frag(BFloat16, jr)  # (8, jn), (8, jr)
        rQn.fill(0)
        for j in cutlass.range_constexpr(jn):
            i = tidx + j * T
            if i < n_rows * nd:
                cute.autovec_copy(vectors(mQ[i // nd, None])[None, head + i % nd], rQn[None, j])
        if tile == 0:
            for j in cutlass.range_constexpr(jr):
                i = tidx + j * T
                if i < n_rows * nr:
                    cute.autovec_copy(vectors(mQ[i // nr, None])[None, head + nd + i % nr],
                                      rPe[None, j])
        for j in cutlass.range_constexpr(jn):
            i = tidx + j * T
            if i < MB * nd:
                cute.autovec_copy(rQn[None, j], vectors(sQ[i // nd, None])[None, i % nd])
        if tile == 0:
            for j in cutlass.range_constexpr(jr):
                i = tidx + j * T
                if i < n_rows * nr:
                    cute.autovec_copy(rPe[None, j],
                                      vectors(mPe[i // nr, None])[None, h * nr + i % nr])

    @cute.jit
    def finish(self, rAcc: cute.Tensor, sP, mLat: cute.Tensor, h, tile, tidx, v, g, r0,
               n_rows):
        """Sum the DG slices' partials (in slice order) and store q_lat's rows < N in bf16."""
        T, CV, DG, MB, RG = self.threads, self.CV, self.DG, self.MB, self.RG
        col = h * (self.C // 8) + tile * CV  # q_lat's vector of (h, tile, v = 0)
        rOut = make_frag(BFloat16, 1)  # (8, 1)
        if const_expr(DG == 1):
            for i in cutlass.range_constexpr(self.RPT):
                if r0 + i * RG < n_rows:
                    rOut[None, 0].store(rAcc[None, i].load().to(BFloat16))
                    cute.autovec_copy(rOut[None, 0],
                                      vectors(mLat[r0 + i * RG, None])[None, col + v])
        else:
            for i in cutlass.range_constexpr(self.RPT):
                cute.autovec_copy(rAcc[None, i], vectors(sP[g, r0 + i * RG, None], 8)[None, v])
            cute.arch.barrier()
            rP = make_frag(Float32, 1, 8)  # (8, 1)
            rSum = make_frag(Float32, 1, 8)  # (8, 1)
            for j in cutlass.range_constexpr(-(-MB * CV // T)):
                i = tidx + j * T
                if i < n_rows * CV:
                    cute.autovec_copy(vectors(sP[0, i // CV, None], 8)[None, i % CV],
                                      rSum[None, 0])
                    for s in cutlass.range_constexpr(1, DG):
                        cute.autovec_copy(vectors(sP[s, i // CV, None], 8)[None, i % CV],
                                          rP[None, 0])
                        rSum[None, 0].store(rSum[None, 0].load() + rP[None, 0].load())
                    rOut[None, 0].store(rSum[None, 0].load().to(BFloat16))
                    cute.autovec_copy(rOut[None, 0],
                                      vectors(mLat[i // CV, None])[None, col + i % CV])
