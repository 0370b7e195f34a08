"""`KDADecode`, the CuTe DSL kernel of kernels/kda_decode.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import operator

import cutlass
from cutlass import BFloat16, Float32, Int64, const_expr, cute
from cutlass.cute.nvgpu import cpasync

from k3compile.ops.kda_decode import BUILTIN, ConvRounding, KDAVariant

from ..common.copy import vectors
from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..common.reduce import row_sum
from ..kda_decode import HEAD_DIM, VEC, Config, smem_bytes, tile


def sigmoid(x):
    return 1.0 / (1.0 + cute.math.exp(-x))

def bf16_round(x):
    return x.to(BFloat16).to(Float32)

class KDADecode:
    """`fb_rank` R > 0: the f_b build, whose gate input is fa [B, T, R] with W_fb [W, R] (each
    CTA computes its head's graw; host entry `with_fb`), not graw [B, T, W] (`__call__`)."""

    def __init__(self, tokens: int, n_heads: int, taps: int, cfg: Config, pdl: bool = False,
                 variant: KDAVariant = BUILTIN, fb_rank: int = 0):
        self.T, self.H, self.taps, self.pdl = tokens, n_heads, taps, pdl
        # the variant's compile-time choices (its layouts are the host's tensors' strides):
        # fla's fp32 gated norm; with it or the Flax norm, o unrounded into the norm
        self.norm_fp32, self.o_fp32 = variant.norm_fp32, variant.o_fp32
        # the Flax norm: bf16(o'·rstd·w) in fp32, then the gate in bf16
        self.norm_weight_fp32 = variant.norm_weight_fp32
        # the built-in norm, then the gate product in fp32: σ(g) not rounded before it
        self.gate_fp32 = variant.gate_fp32
        # ROUNDED: the conv rounded to bf16 before its SiLU; PRODUCTS_ROUNDED: each tap product
        # rounded to bf16, the fp32 sum in tap order, rounded before its SiLU
        self.conv = variant.conv
        self.K = HEAD_DIM
        self.W = n_heads * HEAD_DIM
        self.tile = tile(cfg)
        # the f_b build: L = R/8 lanes a W_fb row (a power of 2), rows a step of the CTA
        self.fb_rank, self.fb_lanes = fb_rank, fb_rank // 8
        self.fb_rows = 32 // self.fb_lanes * self.tile.warps if fb_rank else 0
        self.C, self.R = cfg.cluster_n, cfg.rows_per_thread
        self.threads, self.warps = self.tile.threads, self.tile.warps
        self.smem_bytes = smem_bytes(tokens, cfg, fb_rank)  # the allocations of `kernel`

    @cute.jit
    def __call__(self, mQ, mK, mV, mG, mGraw, mB, mConv, mState, mSlots, mWq, mWk, mWv,
                 mALog, mDt, mWo, mOut, lower_bound: Float32, l2_eps: Float32,
                 q_scale: Float32, norm_eps: Float32, stream):
        # mQ, mK, mV, mG, mGraw: (B, T, W); mB: (B, T, H); mConv: (S, 3W, taps-1);
        # mState: (S, H, K, K); mSlots: (B,); mW*: (W, 1, taps); mALog: (H,); mDt: (W,);
        # mWo: (K,); mOut: (B, T, H, K)
        self.launch(mQ, mK, mV, mG, mGraw, None, mB, mConv, None, None, mState, mSlots, mWq,
                    mWk, mWv, mALog, mDt, mWo, mOut, lower_bound, l2_eps, q_scale, norm_eps,
                    stream)

    @cute.jit
    def three_states(self, mQ, mK, mV, mG, mGraw, mB, mConv, mConvK, mConvV, mState, mSlots,
                     mWq, mWk, mWv, mALog, mDt, mWo, mOut, lower_bound: Float32,
                     l2_eps: Float32, q_scale: Float32, norm_eps: Float32, stream):
        # mConv, mConvK, mConvV: (S, W, taps-1) each, q's, k's and v's; the rest as __call__
        self.launch(mQ, mK, mV, mG, mGraw, None, mB, mConv, mConvK, mConvV, mState, mSlots,
                    mWq, mWk, mWv, mALog, mDt, mWo, mOut, lower_bound, l2_eps, q_scale,
                    norm_eps, stream)

    @cute.jit
    def with_fb(self, mQ, mK, mV, mG, mFa, mWfb, mB, mConv, mState, mSlots, mWq, mWk, mWv,
                mALog, mDt, mWo, mOut, lower_bound: Float32, l2_eps: Float32,
                q_scale: Float32, norm_eps: Float32, stream):
        # mFa: (B, T, R); mWfb: (W, R); the rest as __call__
        self.launch(mQ, mK, mV, mG, mFa, mWfb, mB, mConv, None, None, mState, mSlots, mWq, mWk,
                    mWv, mALog, mDt, mWo, mOut, lower_bound, l2_eps, q_scale, norm_eps, stream)

    def launch(self, mQ, mK, mV, mG, mGate, mWfb, mB, mConv, mConvK, mConvV, mState, mSlots,
               mWq, mWk, mWv, mALog, mDt, mWo, mOut, lower_bound, l2_eps, q_scale, norm_eps,
               stream):
        C = self.C
        self.kernel(mQ, mK, mV, mG, mGate, mWfb, mB, mConv, mConvK, mConvV, mState, mSlots,
                    mWq, mWk, mWv, mALog, mDt, mWo, mOut, lower_bound, l2_eps, q_scale,
                    norm_eps).launch(
            grid=[C, self.H, mQ.shape[0]], block=[self.threads, 1, 1],
            cluster=[C, 1, 1] if const_expr(C > 1) else None, smem=self.smem_bytes,
            stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mQ, mK, mV, mG, mGate, mWfb, mB, mConv, mConvK, mConvV, mState, mSlots,
               mWq, mWk, mWv, mALog, mDt, mWo, mOut, lower_bound: Float32, l2_eps: Float32,
               q_scale: Float32, norm_eps: Float32):
        """mGate: graw (B, T, W), or in the f_b build fa (B, T, R) with mWfb (W, R). mConvK,
        mConvV: None (mConv holds q|k|v), or k's and v's conv states (mConv then q's)."""
        convs = (mConv, mConvK, mConvV)
        pdl_launch_dependents(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        rank, h, req = cute.arch.block_idx()
        T, K, R, C, tl = self.T, self.K, self.R, self.C, self.tile
        if const_expr(C > 1):
            cute.arch.cluster_arrive_relaxed()  # matched in row_sum
        if const_expr(not self.fb_rank):  # the f_b build waits after W_fb's copies (below)
            pdl_wait(self.pdl)
            slot = self.slot_of(req, mSlots, mState)
        smem = cutlass.memory.SmemAllocator()
        sQ = smem.allocate_tensor(Float32, cute.make_layout((T, K), stride=(K, 1)), 16)
        sK = smem.allocate_tensor(Float32, cute.make_layout((T, K), stride=(K, 1)), 16)
        sA = smem.allocate_tensor(Float32, cute.make_layout((T, K), stride=(K, 1)), 16)
        sV = smem.allocate_tensor(Float32, cute.make_layout((T, tl.vc), stride=(tl.vc, 1)), 16)
        sO = smem.allocate_tensor(Float32, cute.make_layout((T, tl.vc), stride=(tl.vc, 1)), 16)
        sBeta = smem.allocate_tensor(Float32, cute.make_layout((T,)), 16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout(
            (C * self.warps, T), stride=(T, 1)), 16)
        sFa, sWfb = None, None
        if const_expr(self.fb_rank):
            sFa = smem.allocate_tensor(Float32, cute.make_layout(
                (T, self.fb_rank), stride=(self.fb_rank, 1)), 16)
            sWfb = smem.allocate_tensor(BFloat16, cute.make_layout(
                (K, self.fb_rank), stride=(self.fb_rank, 1)), 16)
            # W_fb is a weight: its copies fly while the previous kernel finishes
            self.load_wfb(tidx, h, mWfb, sWfb)
            pdl_wait(self.pdl)
            slot = self.slot_of(req, mSlots, mState)

        # The state first: R 16-byte loads per thread, in flight during the prologue.
        rg, lc0 = tl.thread(tidx)
        vg = (rank * tl.vc + lc0) // VEC
        gS = mState[slot, h, None, None]  # (K, K): key rows, value columns
        rS = cute.make_rmem_tensor(cute.make_layout((VEC, R)), Float32)  # (4 cols, R rows)
        for i in cutlass.range_constexpr(R):
            cute.autovec_copy(vectors(gS[rg + tl.rw * i, None])[None, vg], rS[None, i])

        if const_expr(self.fb_rank):
            self.load_fa(tidx, req, mGate, sFa)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()  # sFa stored, every thread's W_fb copies landed
            self.fb_graw(sWfb, sFa, sA)
            cute.arch.barrier()
        self.prologue(tidx, rank, h, req, slot, mQ, mK, mV, mGate, mB, convs, mWq, mWk,
                      mWv, mALog, mDt, sQ, sK, sV, sA, sBeta, lower_bound)
        cute.arch.barrier()
        self.l2norm(sQ, sK, l2_eps, q_scale)
        cute.arch.barrier()
        ss = self.recurrence(rS, rg, lc0, sQ, sK, sA, sV, sO, sBeta)
        for i in cutlass.range_constexpr(R):
            cute.autovec_copy(rS[None, i], vectors(gS[rg + tl.rw * i, None])[None, vg])
        if const_expr(C * self.warps == 1):
            cute.arch.barrier()  # row_sum has none for a single warp; sO must be visible
        totals = row_sum(ss, sRed, self.warps, C, True)  # Σ o'² per token over the head
        self.epilogue(tidx, rank, h, req, totals, sO, mG, mWo, mOut, norm_eps)
        self.write_conv_state(tidx, rank, h, req, slot, mQ, mK, mV, convs)

    def slot_of(self, req, mSlots, mState):
        """The request's state slot (negative: from the end, as torch indexing)."""
        slot = mSlots[req]
        return Int64(cutlass.select_(slot < 0, slot + Int64(mState.shape[0]), slot))

    @cute.jit
    def load_wfb(self, tidx, h, mWfb, sWfb):
        """The head's rows h·K .. h·K + K - 1 of W_fb -> sWfb (K, R) by cp.async, 16 bytes a copy
        (no register round trip), committed as one group: consecutive threads copy consecutive
        vectors of the contiguous [K, R] slice (coalesced)."""
        K, L, n = self.K, self.fb_lanes, self.threads
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                   num_bits_per_copy=128)
        total = K * L
        for it in cutlass.range_constexpr(-(-total // n)):
            item = it * n + tidx
            c, v = item // L, item % L
            if const_expr((it + 1) * n <= total):
                cute.copy(atom, vectors(mWfb[h * K + c, None])[None, v],
                          vectors(sWfb[c, None])[None, v])
            else:
                if item < total:
                    cute.copy(atom, vectors(mWfb[h * K + c, None])[None, v],
                              vectors(sWfb[c, None])[None, v])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def load_fa(self, tidx, req, mFa, sFa):
        """fa of the request -> sFa (T, R) in fp32, one element a thread per pass: any row
        stride (the in-projection's column slice has rows 4 bytes apart in alignment)."""
        R, n = self.fb_rank, self.threads
        total = self.T * R
        for it in cutlass.range_constexpr(-(-total // n)):
            item = it * n + tidx
            if const_expr((it + 1) * n <= total):
                sFa[item // R, item % R] = mFa[req, item // R, item % R].to(Float32)
            else:
                if item < total:
                    sFa[item // R, item % R] = mFa[req, item // R, item % R].to(Float32)

    @cute.jit
    def prologue(self, tidx, rank, h, req, slot, mQ, mK, mV, mGate, mB, convs, mWq, mWk,
                 mWv, mALog, mDt, sQ, sK, sV, sA, sBeta, lower_bound: Float32):
        """Conv + SiLU of q, k (all channels), v (own columns); α; β -> shared memory."""
        T, tl, n = self.T, self.tile, self.threads
        items = tl.prologue_items()
        plan = tl.plan(items)
        for p in cutlass.range_constexpr(len(plan)):
            it, s, full = plan[p]
            kind, lo, hi = items[s]
            item = it * n + tidx
            args = (kind, item - lo, rank, h, req, slot, mQ, mK, mV, mGate, convs, mWq, mWk,
                    mWv, mALog, mDt, sQ, sK, sV, sA, lower_bound)
            if const_expr(full):
                self.prologue_item(*args)
            else:
                if (item >= lo) & (item < hi):
                    self.prologue_item(*args)
        if tidx < T:
            sBeta[tidx] = sigmoid(mB[req, tidx, h].to(Float32))

    def prologue_item(self, kind, c, rank, h, req, slot, mQ, mK, mV, mGate, convs, mWq, mWk,
                      mWv, mALog, mDt, sQ, sK, sV, sA, lower_bound):
        T, K, taps = self.T, self.K, self.taps
        if kind == "alpha":
            ch = h * K + c
            e = cute.math.exp(mALog[h].to(Float32))  # fp32 or bf16
            dt = mDt[ch].to(Float32)
            for t in range(T):
                graw = sA[t, c] if const_expr(self.fb_rank) else mGate[req, t, ch].to(Float32)
                gate = e * (graw + dt)
                sA[t, c] = cute.math.exp(lower_bound * sigmoid(gate))
        else:
            s = "qkv".index(kind)
            mX, mW, sX = (mQ, mWq, sQ) if s == 0 else (mK, mWk, sK) if s == 1 else (
                mV, mWv, sV)
            ch = h * K + (rank * self.tile.vc if s == 2 else 0) + c
            mConv, row = self.conv_rows(convs, s, ch)
            win = [mConv[slot, row, j].to(Float32) for j in range(taps - 1)]
            win += [mX[req, t, ch].to(Float32) for t in range(T)]
            w = [mW[ch, 0, j].to(Float32) for j in range(taps)]
            for t in range(T):
                if const_expr(self.conv is ConvRounding.PRODUCTS_ROUNDED):  # no FMA
                    acc = bf16_round(win[t] * w[0])
                    for j in range(1, taps):
                        acc = acc + bf16_round(win[t + j] * w[j])
                else:
                    acc = win[t] * w[0]
                    for j in range(1, taps):
                        acc = acc + win[t + j] * w[j]
                if const_expr(self.conv is not ConvRounding.FP32):
                    acc = bf16_round(acc)
                sX[t, c] = bf16_round(acc / (1.0 + cute.math.exp(-acc)))  # SiLU

    @cute.jit
    def fb_graw(self, sWfb, sFa, sA):
        """sA[t, c] <- graw[req, t, h·K + c] = bf16(Σ_r fa[t, r]·W_fb[h·K + c, r]) for the head's
        K channels (sWfb: its rows of W_fb): fp32 sums, one rounding, as a bf16 GEMM's output.
        L = R/8 lanes a row, one 16-byte vector of sWfb each (a warp reads whole rows: 512
        contiguous bytes, no bank conflict), then a butterfly over the L lanes; a step of the CTA
        takes 32/L rows a warp. The alpha items turn sA into α."""
        K, L, rows = self.K, self.fb_lanes, self.fb_rows
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        rW = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
        rF = cute.make_rmem_tensor(cute.make_layout((8,)), Float32)
        steps = -(-K // rows)
        # <= 8 rows a thread unrolled; 4 at 16 tokens (8 spilled at one TP16 rank, batch 1)
        for step in cutlass.range(steps, unroll=min(steps, 8 if self.T <= 8 else 4)):
            c = step * rows + warp * (32 // L) + lane // L
            self.fb_row(c, lane % L, sWfb, sFa, sA, rW, rF)

    @cute.jit
    def fb_row(self, c, v, sWfb, sFa, sA, rW, rF):
        """Row c of the head's W_fb: this lane's vector v, the L lanes' butterfly, lane v = 0
        stores the T sums."""
        K, L = self.K, self.fb_lanes
        if const_expr(self.fb_rows <= K):
            cute.autovec_copy(vectors(sWfb[c, None])[None, v], rW)
        else:  # a step's rows past K (few channels, many warps) load nothing
            rW.fill(0.0)
            if c < K:
                cute.autovec_copy(vectors(sWfb[c, None])[None, v], rW)
        w = rW.load().to(Float32)
        sums = []
        for t in cutlass.range_constexpr(self.T):
            cute.autovec_copy(vectors(sFa[t, None], 8)[None, v], rF)
            f = rF.load()
            acc = f[0] * w[0]
            for e in cutlass.range_constexpr(1, 8):
                acc = acc + f[e] * w[e]
            sums.append(acc)
        for i in cutlass.range_constexpr(L.bit_length() - 1):
            sums = [x + cute.arch.shuffle_sync_bfly(x, 1 << i) for x in sums]
        if (v == 0) & (c < K):
            for t in cutlass.range_constexpr(self.T):
                sA[t, c] = bf16_round(sums[t])

    @cute.jit
    def l2norm(self, sQ, sK, l2_eps: Float32, q_scale: Float32):
        """One warp per (token, q or k): x <- x·rsqrt(Σx² + eps) (·q_scale for q), in place."""
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        for p in cutlass.range_constexpr(2 * self.T):
            sX, t, scale = (sQ, p // 2, q_scale) if p % 2 == 0 else (sK, p // 2, None)
            if const_expr(self.warps == 1):
                self.l2norm_row(sX, t, lane, l2_eps, scale)
            else:
                if warp == p % self.warps:
                    self.l2norm_row(sX, t, lane, l2_eps, scale)

    def l2norm_row(self, sX, t, lane, l2_eps, scale):
        x = [sX[t, lane + 32 * j] for j in range(self.K // 32)]
        ss = x[0] * x[0]
        for j in range(1, len(x)):
            ss = ss + x[j] * x[j]
        inv = cute.math.rsqrt(cute.arch.warp_reduction(ss, operator.add) + l2_eps)
        for j in range(len(x)):
            y = x[j] * inv
            sX[t, lane + 32 * j] = y if scale is None else y * scale

    def column_sum(self, vals):
        """Butterfly over the lanes of a column group: each lane gets the column totals."""
        for off in self.tile.bfly_offsets():
            vals = [x + cute.arch.shuffle_sync_bfly(x, off) for x in vals]
        return vals

    def state_pass(self, rS, rg, t, sX, sY, update):
        """One sweep over the thread's R x 4 state tile at token t: S[i, j] <- update(S[i, j],
        x_i, j), then the column sums Σ_i S[i, j]·y_i of the updated state (`column_sum`);
        x_i, y_i: rows rg + rw·i of sX, sY."""
        rw = self.tile.rw
        acc = [Float32(0.0) for _ in range(VEC)]
        for i in range(self.R):
            x, y = sX[t, rg + rw * i], sY[t, rg + rw * i]
            for j in range(VEC):
                s = update(rS[j, i], x, j)
                rS[j, i] = s
                acc[j] = acc[j] + s * y
        return self.column_sum(acc)

    @cute.jit
    def recurrence(self, rS, rg, lc0, sQ, sK, sA, sV, sO, sBeta):
        """The delta rule over the T tokens on the thread's R x 4 state tile. o' = bf16(o) (with
        `o_fp32`: o) of the owned columns goes to sO; returns each token's Σ o'² over the thread's columns
        (row group 0 only, so the CTA sum counts every column once)."""
        ss = []
        for t in cutlass.range_constexpr(self.T):
            kv = self.state_pass(rS, rg, t, sA, sK, lambda s, a, j: s * a)
            beta = sBeta[t]
            u = [beta * (sV[t, lc0 + j] - kv[j]) for j in range(VEC)]
            o = self.state_pass(rS, rg, t, sK, sQ, lambda s, kk, j, u=u: s + kk * u[j])
            if const_expr(not self.o_fp32):
                o = [bf16_round(x) for x in o]
            if rg == 0:
                for j in cutlass.range_constexpr(VEC):
                    sO[t, lc0 + j] = o[j]
            sq = o[0] * o[0]
            for j in cutlass.range_constexpr(1, VEC):
                sq = sq + o[j] * o[j]
            ss.append(Float32(cutlass.select_(rg == 0, sq, Float32(0.0))))
        return ss

    @cute.jit
    def epilogue(self, tidx, rank, h, req, totals, sO, mG, mWo, mOut, norm_eps: Float32):
        """out = bf16(bf16(w·bf16(o'·rstd))·bf16(σ(g))), or with `norm_fp32` bf16(o'·rstd·w·σ(g))
        in fp32, or with `norm_weight_fp32` bf16(bf16(o'·rstd·w)·bf16(σ(g))), or with
        `gate_fp32` bf16(bf16(w·bf16(o'·rstd))·σ(g)); one 16-byte vector per item."""
        total, n = self.tile.out_vectors(self.T), self.threads
        for it in cutlass.range_constexpr(-(-total // n)):
            item = it * n + tidx
            if const_expr((it + 1) * n <= total):
                self.out_vector(item, rank, h, req, totals, sO, mG, mWo, mOut, norm_eps)
            else:
                if item < total:
                    self.out_vector(item, rank, h, req, totals, sO, mG, mWo, mOut, norm_eps)

    def out_vector(self, item, rank, h, req, totals, sO, mG, mWo, mOut, norm_eps):
        T, K, vc = self.T, self.K, self.tile.vc
        t, lc = item // (vc // 8), item % (vc // 8) * 8
        col = rank * vc + lc
        ms = totals[0]
        for tt in range(1, T):
            ms = Float32(cutlass.select_(t == tt, totals[tt], ms))
        rstd = cute.math.rsqrt(ms / K + norm_eps)
        rY = cute.make_rmem_tensor(cute.make_layout((8,)), Float32)
        for e in range(8):
            if const_expr(self.norm_fp32):  # fla's FusedRMSNormGated: one rounding, at the store
                y = sO[t, lc + e] * rstd * mWo[col + e].to(Float32)
                rY[e] = y * sigmoid(mG[req, t, h * K + col + e].to(Float32))
            elif const_expr(self.norm_weight_fp32):  # a Flax RMSNorm, then the gate in bf16
                y = bf16_round(sO[t, lc + e] * rstd * mWo[col + e].to(Float32))
                rY[e] = y * bf16_round(sigmoid(mG[req, t, h * K + col + e].to(Float32)))
            else:
                y = bf16_round(mWo[col + e].to(Float32) * bf16_round(sO[t, lc + e] * rstd))
                gate = sigmoid(mG[req, t, h * K + col + e].to(Float32))
                rY[e] = y * (gate if const_expr(self.gate_fp32) else bf16_round(gate))
        rOut = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
        rOut.store(rY.load().to(BFloat16))
        cute.autovec_copy(rOut, vectors(mOut[req, t, h, None])[None, col // 8])

    @cute.jit
    def write_conv_state(self, tidx, rank, h, req, slot, mQ, mK, mV, convs):
        """conv_state <- the last taps-1 window inputs, for this CTA's channels of q, k, v.
        Runs after the cluster barrier: every CTA has read the old rows."""
        K, n, tl = self.K, self.threads, self.tile
        items = tl.conv_write_items()
        plan = tl.plan(items)
        for p in cutlass.range_constexpr(len(plan)):
            it, s, full = plan[p]
            _, lo, hi = items[s]
            item = it * n + tidx
            ch = h * K + rank * tl.vc + item - lo
            mX = mQ if s == 0 else mK if s == 1 else mV
            if const_expr(full):
                self.conv_row(s, ch, req, slot, mX, convs)
            else:
                if (item >= lo) & (item < hi):
                    self.conv_row(s, ch, req, slot, mX, convs)

    def conv_rows(self, convs, s, ch):
        """(the conv state tensor, its row) of channel ch of q|k|v (s = 0|1|2): row s·W + ch of
        the one q|k|v buffer, or row ch of the projection's own."""
        if convs[1] is None:
            return convs[0], s * self.W + ch
        return convs[s], ch

    def conv_row(self, s, ch, req, slot, mX, convs):
        """Channel ch of q|k|v (s = 0|1|2): window positions T .. T + taps - 2, old inputs
        while below taps - 1. All read before any is written (T < taps - 1 shifts the row)."""
        T, keep = self.T, self.taps - 1
        mConv, row = self.conv_rows(convs, s, ch)
        new = [mConv[slot, row, T + j] if T + j < keep else mX[req, T + j - keep, ch]
               for j in range(keep)]
        for j in range(keep):
            mConv[slot, row, j] = new[j]
