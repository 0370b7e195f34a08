"""`Gemv`, the CuTe DSL kernel of kernels/common/gemv.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import BFloat16, Float32, const_expr, cute

from ..common.copy import bf16_halves, load_vectors, make_frag, row_vectors, vectors
from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..common.gemv import PLAIN, Config, Fusion, _vec_per_thread, grid_size
from ..common.reduce import block_sum


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


def heads_as_rows(mW: cute.Tensor) -> cute.Tensor:
    """mW (H, V, K) -> ((V, H), K): row n = h·V + v at h·head_stride + v·row_stride, so a row
    index walks the heads without them being evenly spaced (W_UV inside kv_b's weight)."""
    return cute.make_tensor(mW.iterator,
                            cute.group_modes(cute.select(mW.layout, mode=[1, 0, 2]), 0, 2))


class Gemv:
    def __init__(self, n: int, k: int, m_bucket: int, cfg: Config, out_fp32: bool,
                 has_residual: bool, pdl: bool = False, fusion: Fusion = PLAIN):
        self.n, self.n_vec, self.mb, self.pdl = n, k // 8, m_bucket, pdl
        self.rows, self.threads = cfg.rows_per_cta, cfg.threads
        self.j = _vec_per_thread(k, cfg.threads)
        self.n_warps = cfg.threads // 32
        self.n_vals = cfg.rows_per_cta * m_bucket  # sums per CTA, index m·R + r
        self.out_fp32, self.has_residual = out_fp32, has_residual
        self.k, self.fusion = k, fusion
        # SiTU: a CTA's R rows are R/2 rows of W_g and the same R/2 rows of W_u
        self.pairs, self.width = cfg.rows_per_cta // 2, n // 2
        self.blocks = -(-self.width // self.pairs) if fusion.situ else -(-n // self.rows)
        # persistent: fewer CTAs than row blocks, each looping over blocks cta, cta + G, ...
        self.ctas = grid_size(self.blocks, cfg)
        self.persistent = self.ctas < self.blocks
        self.red_bytes = 4 * self.n_warps * self.n_vals * (2 if self.persistent else 1)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor, stream):
        # mX: (M, K); mW: (N, K); mR, mY: (M, N)
        self.kernel(mX, mW, mR, mY).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1],
            smem=self.red_bytes + 64, stream=stream, use_pdl=self.pdl)

    @cute.jit
    def fused(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor, mY2, mG, eps,
              beta, linear_beta, stream):
        # mY: (M, N), (M, N/2) with SiTU, (M, split) with a split; mY2: (M, N - split);
        # mG: (K,) the norm weight, or (M, N) the gate; mX: (M, (N/V)·K) with a gate
        if const_expr(self.fusion.gate):
            mW = heads_as_rows(mW)
        self.kernel_fused(mX, mW, mR, mY, mY2, mG, eps, beta, linear_beta).launch(
            grid=[self.ctas, 1, 1], block=[self.threads, 1, 1],
            smem=self.red_bytes + 4 * self.n_warps * self.mb + 128, stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor):
        self.body(mX, mW, mR, mY, None, None, None, None, None)

    @cute.kernel
    def kernel_fused(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor, mY2, mG,
                     eps, beta, linear_beta):
        self.body(mX, mW, mR, mY, mY2, mG, eps, beta, linear_beta)

    def w_row(self, blk, r):
        """Row of W behind sum r of row block `blk` (rows past the end re-read the last one)."""
        R, fusion = self.rows, self.fusion
        if const_expr(fusion.situ):  # gate rows, then the same up rows (I further)
            h, I = r % self.pairs, self.width
            row = blk * self.pairs + h
            if const_expr(I % self.pairs):
                row = cutlass.min(row, I - 1)
            return row if r < self.pairs else row + I
        row = blk * R + r
        if const_expr(self.n % R):
            row = cutlass.min(row, self.n - 1)
        return row

    @cute.jit
    def row_rstd(self, mX: cute.Tensor, eps: Float32, sSq: cute.Tensor, tidx, n_rows):
        """rsqrt(mean(x_m²) + eps) of every row m (the rms_norm kernel's formula), from the
        x vectors this thread multiplies: per-thread sums in vector order, then one block
        sum (rows past M give 0)."""
        T, nv, MB, J = self.threads, self.n_vec, self.mb, self.j
        rX = make_frag(BFloat16, J)  # (8, J): one row's vectors, all loads in flight
        sums = []
        for m in cutlass.range_constexpr(MB):
            if const_expr(m == 0):
                load_vectors(row_vectors(mX, 0), rX, tidx, T, nv)
            else:
                rX.fill(0)
                if m < n_rows:
                    load_vectors(row_vectors(mX, m), rX, tidx, T, nv)
            s = Float32(0.0)
            for j in cutlass.range_constexpr(J):
                x = rX[None, j].load().to(Float32)
                for e in cutlass.range_constexpr(8):
                    s = s + x[e] * x[e]  # exact squares of bf16: contraction-proof
            sums.append(s)
        totals = block_sum(sums, sSq, self.n_warps)
        return [cute.math.rsqrt(t / self.k + eps, fastmath=True) for t in totals]

    @cute.jit
    def load_w(self, mW: cute.Tensor, rW: list, blk, tidx):
        """Every W load of row block `blk` into rW (R fragments (8, J)), issued before any math
        (a `sync_warp` after them fences them); rows past N re-read row N - 1."""
        for r in cutlass.range_constexpr(self.rows):
            load_vectors(row_vectors(mW, self.w_row(blk, r)), rW[r], tidx, self.threads,
                         self.n_vec)

    @cute.jit
    def body(self, mX: cute.Tensor, mW: cute.Tensor, mR, mY: cute.Tensor, mY2, mG, eps,
             beta, linear_beta):
        pdl_launch_dependents(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        T, nv, R, MB, J = self.threads, self.n_vec, self.rows, self.mb, self.j
        fusion = self.fusion
        n_rows = mX.shape[0]  # M <= MB
        smem = cutlass.memory.SmemAllocator()
        red = cute.make_layout((self.n_warps, self.n_vals), stride=(self.n_vals, 1))
        sRed = smem.allocate_tensor(Float32, red, 16)

        rW = [make_frag(BFloat16, J) for _ in range(R)]  # each (8, J)
        self.load_w(mW, rW, cta, tidx)
        # the norm weight's vectors (8, J), loaded as a weight
        rG = make_frag(BFloat16, J) if const_expr(fusion.norm) else None
        if const_expr(fusion.norm):
            load_vectors(vectors(mG), rG, tidx, T, nv)
        # A scheduling fence: ptxas would otherwise sink later loads below the first FMAs,
        # so each thread would wait for one load round trip before issuing the next.
        cute.arch.sync_warp()
        pdl_wait(self.pdl)  # x and the residual come from earlier kernels
        rstd = None
        if const_expr(fusion.norm):
            sSq = smem.allocate_tensor(Float32, cute.make_layout(
                (self.n_warps, MB), stride=(MB, 1)), 16)
            rstd = self.row_rstd(mX, eps, sSq, tidx, n_rows)
        args = (mX, mR, mY, mY2, mG, rG, rstd, tidx, n_rows, beta, linear_beta)
        if const_expr(not self.persistent):
            self.row_block(rW, sRed, cta, *args)
        else:
            # Two register sets and two reduction buffers: block b's math and reduction run
            # while block b + G's loads are in flight (G = the grid). A thread reads buffer s's
            # sums before the barrier of the other buffer's block, and writes s again only
            # after it, so the buffers need no barrier of their own.
            rW2 = [make_frag(BFloat16, J) for _ in range(R)]  # each (8, J)
            sRed2 = smem.allocate_tensor(Float32, red, 16)
            G, blocks = self.ctas, self.blocks
            for blk in cutlass.range(cta, blocks, 2 * G, unroll=1):
                if blk + G < blocks:
                    self.load_w(mW, rW2, blk + G, tidx)
                cute.arch.sync_warp()
                self.row_block(rW, sRed, blk, *args)
                if blk + 2 * G < blocks:
                    self.load_w(mW, rW, blk + 2 * G, tidx)
                cute.arch.sync_warp()
                if blk + G < blocks:
                    self.row_block(rW2, sRed2, blk + G, *args)

    @cute.jit
    def row_block(self, rW: list, sRed: cute.Tensor, blk, mX: cute.Tensor, mR, mY: cute.Tensor,
                  mY2, mG, rG: cute.Tensor, rstd: list, tidx, n_rows, beta, linear_beta):
        """The sums of row block `blk` from its W vectors rW, x and the epilogue: R x M sums
        per thread in vector order, warp butterflies, the warps in order through sRed."""
        T, nv, R, MB, J = self.threads, self.n_vec, self.rows, self.mb, self.j
        fusion = self.fusion
        first = blk * R
        acc = [Float32(0.0) for _ in range(R * MB)]  # index m·R + r
        rX = make_frag(BFloat16, 1)  # (8, 1)
        # gate: this CTA's rows share one x slice, vectors h·K/8 on (R divides V)
        x_first = (first // fusion.gate) * nv if const_expr(fusion.gate) else 0
        for j in cutlass.range_constexpr(J):
            w = [bf16_halves(rW[r][None, j].load()) for r in range(R)]  # (even, odd) fp32
            vec = j * T + tidx
            if const_expr(fusion.norm):
                g = rG[None, j].load().to(Float32)
            for m in cutlass.range_constexpr(MB):
                if const_expr(m == 0 and (j + 1) * T <= nv):
                    cute.autovec_copy(row_vectors(mX, m)[None, x_first + vec], rX[None, 0])
                else:
                    rX.fill(0)
                    pred = m < n_rows
                    if const_expr((j + 1) * T > nv):
                        pred = pred & (vec < nv)
                    if pred:
                        cute.autovec_copy(row_vectors(mX, m)[None, x_first + vec],
                                          rX[None, 0])
                x = rX.load()
                if const_expr(fusion.norm):  # rms_norm's roundings: bf16(g · bf16(x · rstd))
                    x = ((x.to(Float32) * rstd[m]).to(BFloat16).to(Float32) * g).to(BFloat16)
                x_even, x_odd = bf16_halves(x)
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
        if const_expr(fusion.situ):
            self.store_situ(sRed, mY, tidx, blk, n_rows, beta, linear_beta)
        else:
            if tidx < V:
                out_m, out_col = tidx // R, first + tidx % R
                write = out_m < n_rows
                if const_expr(self.n % R):
                    write = write & (out_col < self.n)
                if write:
                    total = self.total(sRed, tidx)
                    if const_expr(self.has_residual):
                        total = total + mR[out_m, out_col].to(Float32)
                    if const_expr(fusion.gate):  # o · sigmoid(g), each rounded as torch
                        gate = mG[out_m, out_col].to(Float32)
                        sig = (1.0 / (1.0 + cute.math.exp(-gate, fastmath=False))).to(BFloat16)
                        total = total.to(BFloat16).to(Float32) * sig.to(Float32)
                    if const_expr(fusion.split):
                        if out_col >= fusion.split:
                            mY2[out_m, out_col - fusion.split] = total.to(BFloat16)
                        else:
                            self.store(mY, out_m, out_col, total)
                    else:
                        self.store(mY, out_m, out_col, total)

    def total(self, sRed: cute.Tensor, i):
        total = sRed[0, i]
        for wi in range(1, self.n_warps):
            total = total + sRed[wi, i]
        return total

    def store(self, mY: cute.Tensor, m, col, total):
        if const_expr(self.out_fp32):
            mY[m, col] = total
        else:
            mY[m, col] = total.to(BFloat16)

    @cute.jit
    def store_situ(self, sRed: cute.Tensor, mY: cute.Tensor, tidx, blk, n_rows,
                   beta: Float32, linear_beta: Float32):
        """y[m, n] = bf16(SiTU(g, u)) from the sums of rows n and I + n, rounded to bf16
        first like the GEMM output the situ kernel reads; then the situ kernel's math."""
        H, R = self.pairs, self.rows
        if tidx < self.mb * H:
            out_m, h = tidx // H, tidx % H
            col = blk * H + h
            write = out_m < n_rows
            if const_expr(self.width % H):
                write = write & (col < self.width)
            if write:
                g = self.total(sRed, out_m * R + h).to(BFloat16).to(Float32)
                u = self.total(sRed, out_m * R + H + h).to(BFloat16).to(Float32)
                sig = 1.0 / (1.0 + cute.math.exp(-g, fastmath=True))
                act = beta * cute.math.tanh(g / beta, fastmath=False) * sig
                lin = linear_beta * cute.math.tanh(u / linear_beta, fastmath=False)
                mY[out_m, col] = (act * lin).to(BFloat16)
