"""`MLADecode`, the CuTe DSL kernel of kernels/mla_decode.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, const_expr, cute
from cutlass.cute.nvgpu import cpasync

from ..common.copy import vectors
from ..common.dsl import pdl_wait
from ..mla_decode import (
    COMBINE_COLS,
    COMBINE_LANES,
    COMBINE_UNROLL,
    GROUP,
    MAX_SPLITS,
    STAGES,
    TILE,
    Config,
    lane_row,
    reduce_scatter,
    row_lane,
)

NEG_INF = float("-inf")

def bf16_round(x):
    return x.to(BFloat16).to(Float32)

class MLADecode:
    def __init__(self, tokens: int, n_heads: int, latent: int, rope: int, cfg: Config,
                 pdl: bool = False):
        self.T, self.H, self.C, self.R, self.pdl = tokens, n_heads, latent, rope, pdl
        self.QW, self.warps, self.threads = cfg.queries_per_warp, cfg.warps, cfg.threads
        self.Q = self.QW * self.warps  # queries per CTA
        self.groups = cfg.groups(tokens, n_heads)
        self.NV = latent // 256  # latent 16-byte vectors per lane: lane + 32·k
        self.NP = rope // 32  # rope columns per lane: C + NP·lane + e
        self.VR = (latent + rope) // 8  # 16-byte vectors per cache row
        # shared rows padded by 16 bytes: 8 rows at one column fall in 8 distinct bank quads
        self.RS = latent + rope + 8
        self.smem_bytes = STAGES * TILE * self.RS * 2 + 64
        self.combine_threads = COMBINE_COLS // 4 * COMBINE_LANES
        assert MAX_SPLITS <= min(self.combine_threads, COMBINE_UNROLL * COMBINE_LANES)
        assert latent % COMBINE_COLS == 0

    @cute.jit
    def __call__(self, mQ, mQpe, mCkv, mKpe, mKV, mSlots, mPos, mWsO, mWsML, mOut,
                 scale: Float32, stream):
        # mQ: (B, T, H, C); mQpe: (B, T, H, R); mCkv: (B, T, C); mKpe: (B, T, R);
        # mKV: (S, L, C + R); mSlots, mPos: (B,); mWsO: (B, splits, H·T, C) fp32;
        # mWsML: (B, splits, H·T, 2) fp32; mOut: (B, T, H, C)
        B, n_splits = mQ.shape[0], mWsO.shape[1]
        self.attend(mQ, mQpe, mCkv, mKpe, mKV, mSlots, mPos, mWsO, mWsML, scale).launch(
            grid=[n_splits, self.groups, B], block=[self.threads, 1, 1],
            smem=self.smem_bytes, stream=stream, use_pdl=self.pdl)
        self.combine(mWsO, mWsML, mOut).launch(
            grid=[self.H * self.T, self.C // COMBINE_COLS, B],
            block=[self.combine_threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def attend(self, mQ, mQpe, mCkv, mKpe, mKV, mSlots, mPos, mWsO, mWsML, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        split, group, b = cute.arch.block_idx()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        cute.arch.griddepcontrol_launch_dependents()  # combine waits for our completion
        pdl_wait(self.pdl)  # PDL: no constant to read first (the cache rows are state)
        H, QW, NV, NP = self.H, self.QW, self.NV, self.NP
        slot, pos, lo, hi, n_tiles = self.span(b, split, mSlots, mPos, mKV, mWsO)
        smem = cutlass.memory.SmemAllocator()
        sKV = self.alloc_tiles(smem)

        # Tiles 0 .. STAGES - 2 in flight before the loop; each step issues tile + STAGES - 1
        # (one cp.async group per tile, empty past the last) and waits for its own tile only. The
        # queries' loads below fly beside them.
        for k in cutlass.range_constexpr(STAGES - 1):
            if k < n_tiles:
                self.load_tile(tidx, b, group, slot, pos, lo + k * TILE, hi, mCkv, mKpe, mKV,
                               sKV[None, None, k])
            cute.arch.cp_async_commit_group()

        # The warp's queries: latent columns of vectors lane + 32·k, rope columns NP·lane + e.
        q0 = group * self.Q + warp * QW
        rQ = cute.make_rmem_tensor(cute.make_layout((QW, 8 * NV + NP)), Float32)
        rV = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
        limit = []  # the last visible row of each query: pos + t
        for j in cutlass.range_constexpr(QW):
            t, h = (q0 + j) // H, (q0 + j) % H
            limit.append(pos + t)
            for k in cutlass.range_constexpr(NV):
                cute.autovec_copy(vectors(mQ[b, t, h, None])[None, lane + 32 * k], rV)
                for e in cutlass.range_constexpr(8):
                    rQ[j, 8 * k + e] = rV[e].to(Float32)
            for e in cutlass.range_constexpr(NP):
                rQ[j, 8 * NV + e] = mQpe[b, t, h, NP * lane + e].to(Float32)

        rM = cute.make_rmem_tensor(cute.make_layout((QW,)), Float32)  # running max
        rL = cute.make_rmem_tensor(cute.make_layout((QW,)), Float32)  # running Σp
        rS = cute.make_rmem_tensor(cute.make_layout((QW,)), Float32)  # score of row `lane`
        rP = cute.make_rmem_tensor(cute.make_layout((QW,)), Float32)  # bf16(p) of row `lane`
        rAcc = cute.make_rmem_tensor(cute.make_layout((QW, 8 * NV)), Float32)
        rM.fill(NEG_INF)
        rL.fill(0.0)
        rAcc.fill(0.0)
        rK = cute.make_rmem_tensor(cute.make_layout((8 * NV + NP,)), Float32)

        for tile in cutlass.range(n_tiles, unroll=1):
            base = lo + tile * TILE
            ahead = tile + STAGES - 1
            if ahead < n_tiles:
                self.load_tile(tidx, b, group, slot, pos, lo + ahead * TILE, hi, mCkv, mKpe,
                               mKV, sKV[None, None, ahead % STAGES])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(STAGES - 1)
            cute.arch.barrier()  # every thread's copies (and zero / new-row stores) landed
            sTile = sKV[None, None, tile % STAGES]
            for g in cutlass.range(TILE // GROUP, unroll=1):
                self.group_scores(sTile, g, lane, rQ, rK, rS, scale)
            i = base + lane_row(lane)
            for j in cutlass.range_constexpr(QW):
                rS[j] = Float32(cutlass.select_((i < hi) & (i <= limit[j]), rS[j],
                                                Float32(NEG_INF)))
            for j in cutlass.range_constexpr(QW):
                self.softmax_step(j, rS, rM, rL, rP, rAcc)
            for r in cutlass.range(TILE, unroll=2):
                self.row_values(sTile, r, lane, rK, False)
                for j in cutlass.range_constexpr(QW):
                    p = cute.arch.shuffle_sync(rP[j], row_lane(r))
                    for e in cutlass.range_constexpr(8 * NV):
                        rAcc[j, e] = rAcc[j, e] + p * rK[e]
            cute.arch.barrier()  # the tile is read before a later step's copies overwrite it

        rOut = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        for j in cutlass.range_constexpr(QW):
            q = q0 + j
            for k in cutlass.range_constexpr(NV):
                for half in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(4):
                        rOut[e] = rAcc[j, 8 * k + 4 * half + e]
                    cute.autovec_copy(rOut, vectors4(mWsO[b, split, q, None])[
                        None, 2 * (lane + 32 * k) + half])
            if lane == 0:
                mWsML[b, split, q, 0] = rM[j]
                mWsML[b, split, q, 1] = rL[j]

    @cute.jit
    def span(self, b, split, mSlots, mPos, mKV, mWsO):
        """Request b's slot and position, and split `split`'s rows [lo, hi) of its visible
        context in n_tiles tiles."""
        slot = mSlots[b]
        slot = Int64(cutlass.select_(slot < 0, slot + Int64(mKV.shape[0]), slot))
        pos = Int32(mPos[b])
        n_vis = cutlass.min(pos + self.T, Int32(mKV.shape[1]))
        n_splits = Int32(mWsO.shape[1])
        length = ((n_vis + n_splits - 1) // n_splits + TILE - 1) // TILE * TILE
        lo = split * length
        hi = cutlass.min(lo + length, n_vis)
        n_tiles = cutlass.max(hi - lo + TILE - 1, 0) // TILE
        return slot, pos, lo, hi, n_tiles

    def alloc_tiles(self, smem):
        """The ring of STAGES tiles, (32 rows, C + R, STAGES), rows RS apart."""
        return smem.allocate_tensor(BFloat16, cute.make_layout(
            (TILE, self.C + self.R, STAGES), stride=(self.RS, 1, TILE * self.RS)), 16)

    @cute.jit
    def load_tile(self, tidx, b, group, slot, pos, base, hi, mCkv, mKpe, mKV, sKV):
        """Cache rows base .. base + 31 -> sKV (32, C + R): rows before pos by cp.async (no
        register round trip, every copy of the tile in flight at once), rows at or past hi
        zero-filled; the new rows (>= pos) come from c_kv | k_pe and are written to the cache
        here (by query group 0 only: the other groups' CTAs load the same tile). The caller
        commits the copies as one group. Thread (row r0, u) of (threads / 8, 8) takes vectors
        u, u + 8, ... of rows r0, r0 + threads / 8, ...: 8 threads read 128 contiguous bytes,
        and a thread's addresses are two row bases plus constants."""
        VR, RP = self.VR, self.threads // 8
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                   num_bits_per_copy=128)
        rV = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
        old = cutlass.min(hi, pos)  # rows below this one are the cache's
        r0, u = tidx // 8, tidx % 8
        fast = base + TILE <= old  # every row the cache's (all tiles but the last one or two)
        for jr in cutlass.range_constexpr(-(-TILE // RP)):
            r = r0 + jr * RP
            if const_expr((jr + 1) * RP <= TILE) or r < TILE:
                gRow = vectors(mKV[slot, cutlass.min(base + r, mKV.shape[1] - 1), None])
                sRow = vectors(sKV[r, None])
                for k in cutlass.range_constexpr(-(-VR // 8)):
                    v = u + 8 * k
                    if const_expr(8 * (k + 1) <= VR) or v < VR:
                        if fast:
                            cute.copy(atom, gRow[None, v], sRow[None, v])
                        else:
                            self.load_vector(r, v, b, group, slot, pos, base, hi, old, mCkv,
                                             mKpe, mKV, sKV, rV, atom)

    @cute.jit
    def load_vector(self, r, v, b, group, slot, pos, base, hi, old, mCkv, mKpe, mKV, sKV, rV,
                    atom):
        CV = self.C // 8
        i = base + r
        dst = vectors(sKV[r, None])[None, v]
        if i < old:
            cute.copy(atom, vectors(mKV[slot, i, None])[None, v], dst)
        else:
            rV.fill(0.0)
            if i < hi:
                if v < CV:
                    cute.autovec_copy(vectors(mCkv[b, i - pos, None])[None, v], rV)
                else:
                    cute.autovec_copy(vectors(mKpe[b, i - pos, None])[None, v - CV], rV)
                if group == 0:
                    cute.autovec_copy(rV, vectors(mKV[slot, i, None])[None, v])
            cute.autovec_copy(rV, dst)

    @cute.jit
    def group_scores(self, sKV, g, lane, rQ, rK, rS, scale: Float32):
        """Scores of tile rows GROUP·g .. GROUP·g + 3 for the warp's queries; lanes with
        lane & 7 == g keep theirs (row lane_row(lane)) in rS."""
        QW, NV, NP = self.QW, self.NV, self.NP
        nope = [[None] * GROUP for _ in range(QW)]
        rope = [[None] * GROUP for _ in range(QW)]
        for k in cutlass.range_constexpr(GROUP):
            self.row_values(sKV, GROUP * g + k, lane, rK, True)
            for j in cutlass.range_constexpr(QW):
                sn = rQ[j, 0] * rK[0]
                for e in cutlass.range_constexpr(1, 8 * NV):
                    sn = sn + rQ[j, e] * rK[e]
                sp = rQ[j, 8 * NV] * rK[8 * NV]
                for e in cutlass.range_constexpr(1, NP):
                    sp = sp + rQ[j, 8 * NV + e] * rK[8 * NV + e]
                nope[j][k], rope[j][k] = sn, sp

        def lane_bit(off):
            return (lane & off) != 0

        def shfl_xor(v, off):
            return cute.arch.shuffle_sync_bfly(v, off)

        def select(c, a, b):
            return Float32(cutlass.select_(c, a, b))

        mine = (lane & 7) == g
        for j in cutlass.range_constexpr(QW):
            sn = reduce_scatter(nope[j], lane_bit, shfl_xor, select)
            sp = reduce_scatter(rope[j], lane_bit, shfl_xor, select)
            s = bf16_round(bf16_round(sn) + bf16_round(sp)) * scale
            rS[j] = Float32(cutlass.select_(mine, s, rS[j]))

    @cute.jit
    def row_values(self, sKV, r, lane, rK, with_rope: cutlass.Constexpr[bool]):
        """Tile row r's lane columns -> rK fp32 (latent vectors lane + 32·k, then rope)."""
        NV, NP, C = self.NV, self.NP, self.C
        rV = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
        row = sKV[r, None]
        for k in cutlass.range_constexpr(NV):
            cute.autovec_copy(vectors(row)[None, lane + 32 * k], rV)
            for e in cutlass.range_constexpr(8):
                rK[8 * k + e] = rV[e].to(Float32)
        if const_expr(with_rope):
            for e in cutlass.range_constexpr(NP):
                rK[8 * NV + e] = row[C + NP * lane + e].to(Float32)

    @cute.jit
    def softmax_step(self, j: cutlass.Constexpr[int], rS, rM, rL, rP, rAcc):
        """Online softmax over one tile for query j: lane r holds row r's score."""
        s = rS[j]
        m_new = cute.arch.fmax(rM[j], cute.arch.warp_reduction_max(s))
        m_use = Float32(cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new))
        p = cute.math.exp(s - m_use)
        corr = cute.math.exp(rM[j] - m_use)
        rL[j] = rL[j] * corr + cute.arch.warp_reduction(p, lambda x, y: x + y)
        rM[j] = m_new
        rP[j] = bf16_round(p)
        for e in cutlass.range_constexpr(8 * self.NV):
            rAcc[j, e] = rAcc[j, e] * corr

    @cute.kernel
    def combine(self, mWsO, mWsML, mOut):
        """o_lat[b, t, h, COMBINE_COLS columns of chunk] from every split's partial: thread
        (v, k) sums the splits k, k + LANES, ... of column vector v in split order, then the
        LANES sums meet in shared memory in lane order (a fixed order: deterministic)."""
        tidx, _, _ = cute.arch.thread_idx()
        q, chunk, b = cute.arch.block_idx()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        t, h = q // self.H, q % self.H
        n_splits = Int32(mWsO.shape[1])
        CV, LANES, warps = COMBINE_COLS // 4, COMBINE_LANES, self.combine_threads // 32
        smem = cutlass.memory.SmemAllocator()
        sW = smem.allocate_tensor(Float32, cute.make_layout((self.combine_threads,)), 16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout((2, warps)), 16)
        sPart = smem.allocate_tensor(Float32, cute.make_layout(
            (COMBINE_COLS, LANES), stride=(1, COMBINE_COLS)), 16)  # (columns, lanes)
        cute.arch.griddepcontrol_wait()  # PDL: every attend CTA has finished and flushed

        # Every load first, in one round trip: this thread's U partial vectors (splits k,
        # k + LANES, ...; MAX_SPLITS <= U·LANES; past n_splits a real split's row, weighed 0),
        # then (m, l) of split tidx (MAX_SPLITS <= threads). The warp barrier between them keeps
        # ptxas from putting the (m, l) loads and the reductions that wait for them first.
        v, k = tidx % CV, tidx // CV
        U = COMBINE_UNROLL
        rO = cute.make_rmem_tensor(cute.make_layout((4, U)), Float32)
        for u in cutlass.range_constexpr(U):
            s = cutlass.min(k + u * LANES, n_splits - 1)
            cute.autovec_copy(vectors4(mWsO[b, s, q, None])[None, chunk * CV + v], rO[None, u])
        cute.arch.sync_warp()
        s_ml = cutlass.min(tidx, n_splits - 1)
        rML = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
        cute.autovec_copy(mWsML[b, s_ml, q, None], rML)  # one 8-byte load
        l_s = rML[1]
        m = Float32(cutlass.select_(tidx < n_splits, rML[0], Float32(NEG_INF)))
        m_all = self.block_reduce(cute.arch.warp_reduction_max(m), sRed, 0, lane, warp,
                                  cute.arch.fmax)
        w = cute.math.exp(m - m_all)  # 0 for an empty split (m = -inf) and past n_splits
        sW[tidx] = w
        total = self.block_reduce(cute.arch.warp_reduction(l_s * w, lambda x, y: x + y), sRed,
                                  1, lane, warp, lambda x, y: x + y)

        col0 = chunk * COMBINE_COLS
        rAcc = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        rAcc.fill(0.0)
        for u in cutlass.range_constexpr(U):
            s = k + u * LANES
            ws = Float32(cutlass.select_(s < n_splits, sW[cutlass.min(s, MAX_SPLITS - 1)],
                                         Float32(0.0)))
            for e in cutlass.range_constexpr(4):
                rAcc[e] = rAcc[e] + rO[e, u] * ws
        for e in cutlass.range_constexpr(4):
            sPart[4 * v + e, k] = rAcc[e]
        cute.arch.barrier()
        if tidx < COMBINE_COLS:
            o = sPart[tidx, 0]
            for kk in cutlass.range_constexpr(1, LANES):
                o = o + sPart[tidx, kk]
            mOut[b, t, h, col0 + tidx] = (o * (1.0 / total)).to(BFloat16)

    @cute.jit
    def block_reduce(self, x, sRed, row: cutlass.Constexpr[int], lane, warp, op):
        """The CTA's reduction of x (each warp's value already reduced, identical in its
        lanes): the warps' values in warp order, the same result in every thread."""
        if lane == 0:
            sRed[row, warp] = x
        cute.arch.barrier()
        out = sRed[row, 0]
        for i in cutlass.range_constexpr(1, self.combine_threads // 32):
            out = op(out, sRed[row, i])
        return out

def vectors4(mX):
    """fp32 row (dim,) -> (4, dim / 4): 16-byte vectors."""
    return cute.zipped_divide(mX, (4,))
