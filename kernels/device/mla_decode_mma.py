"""`MLADecodeMMA`, the tensor-core variant of kernels/device/mla_decode.py's `MLADecode`
(`Config.mma`): the same work split, tile ring, cache write and merge launch; the scores and
p·c_kv by mma.sync m16n8k16 (bf16 in, fp32 sums) instead of CUDA-core FMAs.

A CTA takes 16 queries (t·H + h rows of one query group, rows past H·T zero) and 4 warps. Per
tile of 32 cache rows: warp w scores rows 8w .. 8w + 7 against the 16 queries (18 k-chunks of
32 columns: ldmatrix of the rows and of the queries, two mma each; nope and rope in separate
accumulators, as the reference rounds each einsum), rounds as the reference and writes them,
masked, to shared memory; after a barrier every warp runs the same online softmax over the
tile (lane (g, t) takes queries g, g + 8 at the rows its A fragment of p needs: 2t, 2t + 1,
2t + 8, 2t + 9 and those + 16; max and Σp over the lane quad), keeps p as bf16 A fragments
and accumulates o[:, 128w .. 128w + 127] += p · c_kv with the rows by ldmatrix.trans.

Imports `cutlass` at the top (see mla_decode.py)."""

import cutlass
from cutlass import BFloat16, Float32, const_expr, cute
from cutlass.cute.nvgpu import cpasync

from ..common.copy import vectors
from ..common.dsl import pdl_wait
from ..common.mma import ldmatrix_x4, mma_16816, pack_bf16x2
from ..mla_decode import (
    MMA_QUERIES,
    STAGES,
    TILE,
    frag_c,
    ldsm_queries,
    ldsm_rows,
    ldsm_values,
    p_rows,
)
from .mla_decode import NEG_INF, MLADecode, bf16_round

SROW = 40  # fp32 words per query row of the tile's scores in shared memory (32 + 8 pad)


class MLADecodeMMA(MLADecode):
    def __init__(self, tokens, n_heads, latent, rope, cfg, pdl=False):
        super().__init__(tokens, n_heads, latent, rope, cfg, pdl)
        assert cfg.warps == 4 and latent % 64 == 0 and (latent + rope) % 32 == 0
        self.CW = latent // cfg.warps  # o columns per warp
        self.smem_bytes += MMA_QUERIES * self.RS * 2 + MMA_QUERIES * SROW * 4 + 32

    @cute.kernel
    def attend(self, mQ, mQpe, mCkv, mKpe, mKV, mSlots, mPos, mWsO, mWsML, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        split, group, b = cute.arch.block_idx()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        cute.arch.griddepcontrol_launch_dependents()  # combine waits for our completion
        pdl_wait(self.pdl)  # PDL: no constant to read first (the cache rows are state)
        C, RS, NB = self.C, self.RS, self.CW // 8
        g, t4 = lane // 4, lane % 4
        slot, pos, lo, hi, n_tiles = self.span(b, split, mSlots, mPos, mKV, mWsO)
        smem = cutlass.memory.SmemAllocator()
        sKV = self.alloc_tiles(smem)
        sQ = smem.allocate_tensor(BFloat16, cute.make_layout(
            (MMA_QUERIES, C + self.R), stride=(RS, 1)), 16)  # (16 queries, C + R)
        sS = smem.allocate_tensor(Float32, cute.make_layout(
            (MMA_QUERIES, TILE), stride=(SROW, 1)), 16)  # (16 queries, 32 rows): scores
        kv_addr, q_addr = sKV.iterator.toint(), sQ.iterator.toint()

        self.load_queries(tidx, b, group, mQ, mQpe, sQ)  # committed with tile 0
        for k in cutlass.range_constexpr(STAGES - 1):
            if k < n_tiles:
                self.load_tile(tidx, b, group, slot, pos, lo + k * TILE, hi, mCkv, mKpe, mKV,
                               sKV[None, None, k])
            cute.arch.cp_async_commit_group()
        # the last visible row of this lane's queries g, g + 8 (rows past H·T: any)
        limit = [pos + cutlass.min(group * MMA_QUERIES + g + 8 * h, self.H * self.T - 1)
                 // self.H for h in range(2)]
        rM = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)  # running max, g and g + 8
        rL = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)  # running Σp
        rO = cute.make_rmem_tensor(cute.make_layout((4, NB)), Float32)  # C fragments of o
        rM.fill(NEG_INF)
        rL.fill(0.0)
        rO.fill(0.0)

        for tile in cutlass.range(n_tiles, unroll=1):
            base = lo + tile * TILE
            ahead = tile + STAGES - 1
            if ahead < n_tiles:
                self.load_tile(tidx, b, group, slot, pos, lo + ahead * TILE, hi, mCkv, mKpe,
                               mKV, sKV[None, None, ahead % STAGES])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(STAGES - 1)
            cute.arch.barrier()  # every thread's copies (and zero / new-row stores) landed
            tile_addr = kv_addr + (tile % STAGES) * (TILE * RS * 2)
            self.scores(tile_addr, q_addr, base, hi, limit, lane, warp, sS, scale)
            cute.arch.barrier()  # the tile's scores are in sS
            a = self.softmax_step(sS, g, t4, rM, rL, rO)
            self.accumulate(tile_addr, a, lane, warp, rO)
            cute.arch.barrier()  # sS and the tile are read before later steps overwrite them
        cute.arch.cp_async_wait_group(0)  # an empty split's query copies land before exit

        for h in cutlass.range_constexpr(2):
            q = group * MMA_QUERIES + g + 8 * h
            if q < self.H * self.T:
                rPair = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
                for j in cutlass.range_constexpr(NB):
                    rPair[0] = rO[2 * h, j]
                    rPair[1] = rO[2 * h + 1, j]
                    col = self.CW * warp + 8 * j + frag_c(lane, 0)[1]
                    cute.autovec_copy(rPair, vectors(mWsO[b, split, q, None], 2)[
                        None, col // 2])
                if (warp == 0) & (t4 == 0):
                    rPair[0] = rM[h]
                    rPair[1] = rL[h]
                    cute.autovec_copy(rPair, mWsML[b, split, q, None])

    @cute.jit
    def load_queries(self, tidx, b, group, mQ, mQpe, sQ):
        """The CTA's 16 query rows [q_lat | q_pe] -> sQ by cp.async (the caller commits them);
        rows past H·T zero."""
        CV, n = self.C // 8, self.threads
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                   num_bits_per_copy=128)
        total = MMA_QUERIES * self.VR
        for it in cutlass.range_constexpr(-(-total // n)):
            item = it * n + tidx
            if item < total:
                m, v = item // self.VR, item % self.VR
                q = group * MMA_QUERIES + m
                dst = vectors(sQ[m, None])[None, v]
                if q < self.H * self.T:
                    t, h = q // self.H, q % self.H
                    if v < CV:
                        cute.copy(atom, vectors(mQ[b, t, h, None])[None, v], dst)
                    else:
                        cute.copy(atom, vectors(mQpe[b, t, h, None])[None, v - CV], dst)
                else:
                    dst.fill(0.0)

    @cute.jit
    def scores(self, tile_addr, q_addr, base, hi, limit, lane, warp, sS, scale: Float32):
        """Scores of tile rows 8·warp .. + 7 for the 16 queries -> sS, rounded as the reference
        (bf16 of each einsum's fp32 sum, bf16 of their sum, times scale), masked to -inf past
        hi and past each query's last visible row."""
        C, RS = self.C, self.RS
        # four nope accumulators (k-steps 4k + a, a = 0..3), so that the dependent chain of
        # mma is C / 64 long, not C / 16; rope's is R / 16
        nope = [[Float32(0.0)] * 4 for _ in range(4)]
        rope = [Float32(0.0)] * 4
        for kc in cutlass.range_constexpr((C + self.R) // 32):
            col = 32 * kc
            row, c = ldsm_rows(lane, warp, col)
            kb = ldmatrix_x4(tile_addr + (row * RS + c) * 2)  # B of k-steps col, col + 16
            for ks in cutlass.range_constexpr(2):
                m, c = ldsm_queries(lane, col + 16 * ks)
                qa = ldmatrix_x4(q_addr + (m * RS + c) * 2)
                if const_expr(col < C):
                    a = 2 * (kc % 2) + ks
                    nope[a] = mma_16816(qa, (kb[2 * ks], kb[2 * ks + 1]), nope[a])
                else:
                    rope = mma_16816(qa, (kb[2 * ks], kb[2 * ks + 1]), rope)
        for e in cutlass.range_constexpr(4):
            m, n = frag_c(lane, e)
            row = 8 * warp + n
            sn = (nope[0][e] + nope[1][e]) + (nope[2][e] + nope[3][e])
            s = bf16_round(bf16_round(sn) + bf16_round(rope[e])) * scale
            ok = (base + row < hi) & (base + row <= limit[e // 2])
            sS[m, row] = Float32(cutlass.select_(ok, s, Float32(NEG_INF)))

    @cute.jit
    def softmax_step(self, sS, g, t4, rM, rL, rO):
        """Online softmax over the tile for queries g, g + 8 (the same in every warp); returns
        p as the A fragments of the two k-steps of p·c_kv (rows 16ks + 2t, + 1, + 8, + 9)."""
        a = [[None] * 4 for _ in range(2)]
        for h in cutlass.range_constexpr(2):
            m = g + 8 * h
            s = [sS[m, r] for r in p_rows(t4)]
            mx = s[0]
            for k in cutlass.range_constexpr(1, 8):
                mx = cute.arch.fmax(mx, s[k])
            for k in cutlass.range_constexpr(2):
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, 1 << k))
            m_new = cute.arch.fmax(rM[h], mx)
            m_use = Float32(cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new))
            p = [cute.math.exp(x - m_use) for x in s]
            corr = cute.math.exp(rM[h] - m_use)
            total = p[0]
            for k in cutlass.range_constexpr(1, 8):
                total = total + p[k]
            for k in cutlass.range_constexpr(2):
                total = total + cute.arch.shuffle_sync_bfly(total, 1 << k)
            rL[h] = rL[h] * corr + total
            rM[h] = m_new
            for j in cutlass.range_constexpr(cute.size(rO, mode=[1])):
                rO[2 * h, j] = rO[2 * h, j] * corr
                rO[2 * h + 1, j] = rO[2 * h + 1, j] * corr
            for ks in cutlass.range_constexpr(2):
                for hi in cutlass.range_constexpr(2):
                    k = 4 * ks + 2 * hi
                    a[ks][h + 2 * hi] = pack_bf16x2(p[k], p[k + 1])
        return a

    @cute.jit
    def accumulate(self, tile_addr, a, lane, warp, rO):
        """o[:, CW·warp ..] += p · c_kv over the tile: per k-step and pair of n-blocks, one
        ldmatrix.trans (`ldsm_values`) and two mma."""
        for cp in cutlass.range_constexpr(self.CW // 16):
            for ks in cutlass.range_constexpr(2):
                row, c = ldsm_values(lane, 16 * ks, self.CW * warp + 16 * cp)
                vb = ldmatrix_x4(tile_addr + (row * self.RS + c) * 2, trans=True)
                for n in cutlass.range_constexpr(2):
                    acc = mma_16816(a[ks], (vb[2 * n], vb[2 * n + 1]),
                                    [rO[e, 2 * cp + n] for e in range(4)])
                    for e in cutlass.range_constexpr(4):
                        rO[e, 2 * cp + n] = acc[e]

