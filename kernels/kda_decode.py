"""CuTe DSL kernel for `k3::kda_decode`: the whole KDA recurrent step of one layer in one launch
(spec §3.1 steps 3-7; `kda_decode_ref` in k3compile/ops/kda.py is the math and the rounding).

    x̃ = bf16(SiLU(conv(x))); q̂ = l2n(q̃)·s; k̂ = l2n(k̃); β = σ(b); α = exp(lb·σ(e^A·(graw+dt)))
    per t: S ← αS; S += k̂·(β(ṽ − Sᵀk̂))ᵀ; o_t = Sᵀq̂
    out = bf16(bf16(w ⊙ rms(bf16(o))) ⊙ bf16(σ(g)))

`k3::fb_kda_decode` (kernels/fb_kda_decode.py) runs this device code after its GEMM. Work split,
rounding and measurements: docs/kernels.md, kda_decode.

Constraints:
    * q, k, v, g, graw bf16 [B, T, H·K], b bf16 [B, T, H]: last dim contiguous, any other strides;
      1 <= T <= 16; K = 128 (head dim = key dim = value dim).
    * conv_state bf16 [S, 3·H·K, taps-1] (inner dims contiguous), 2 <= taps <= 8; recurrent_state
      fp32 [S, H, K, K] (inner dims contiguous, 16-byte-aligned data and slot stride); slots int64
      [B] (negative slots count from the end, as torch indexing does; two requests sharing a slot
      race, as they do in the reference's index_put).
    * conv weights bf16 [H·K, 1, taps], A_log fp32 [H], dt_bias fp32 [H·K], o_norm_weight bf16
      [K], all contiguous; lower_bound, l2_eps, q_scale, norm_eps are runtime scalars.
    * Output bf16 [B, T, H, K], contiguous.
    * With PDL (settings.KERNELS.pdl) every thread waits first: everything it reads but the
      weights was written by the previous step.
"""

import functools
import math
import operator
from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.kda import kda_decode_ref

from .common.dsl import (
    BUCKETS,
    bucket,
    compile_kernel,
    fake_stream,
    pdl_launch_dependents,
    pdl_wait,
)
from .common.launch import Kernel

OP = "kda_decode"
HEAD_DIM = 128
MAX_TOKENS = 16
MAX_TAPS = 8
VEC = 4  # fp32 state columns per thread: one 16-byte vector of a state row


@dataclass(frozen=True)
class Config:
    cluster_n: int  # C: CTAs per (request, head), each owning K / C value columns
    rows_per_thread: int = 16  # R: state rows per thread (R x 4 fp32 registers)

    @property
    def threads(self) -> int:
        return tile(self).threads


@dataclass(frozen=True)
class Tile:
    """Which state, shared-memory and output elements a thread owns. Pure Python on ints, so the
    kernel (on DSL integers) and the CPU model of the blocking (on ints) share it."""

    K: int
    C: int
    R: int

    @property
    def vc(self) -> int:  # value columns per CTA
        return self.K // self.C

    @property
    def rw(self) -> int:  # lanes (row groups) sharing a column group
        return self.K // self.R

    @property
    def cw(self) -> int:  # column groups per warp
        return 32 // self.rw

    @property
    def warps(self) -> int:
        return self.vc // (VEC * self.cw)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def valid(self) -> bool:
        return (self.R in (4, 8, 16, 32) and self.K % self.C == 0 and self.vc % 8 == 0
                and self.K % self.R == 0 and self.rw <= 32
                and self.vc % (VEC * self.cw) == 0 and 1 <= self.warps <= 32)

    def thread(self, tidx):
        """tidx -> (rg, lc0): the thread's row group (rows rg + rw·i) and first local column."""
        lane = tidx % 32
        return lane // self.cw, (tidx // 32 * self.cw + lane % self.cw) * VEC

    def bfly_offsets(self) -> list[int]:
        """Lane offsets of the butterfly over the row groups of a column group."""
        return [self.cw << s for s in range(int(math.log2(self.rw)))]

    def prologue_items(self):
        """(kind, first item, end): conv of q and k (all K channels), of v (the CTA's columns),
        decay α (all K key channels). Item i of a kind is its channel i (local for v)."""
        K, vc = self.K, self.vc
        return (("q", 0, K), ("k", K, 2 * K), ("v", 2 * K, 2 * K + vc),
                ("alpha", 2 * K + vc, 3 * K + vc))

    def plan(self, items) -> list[tuple[int, int, bool]]:
        """How the CTA's threads sweep work items: pass `it` gives item it·threads + tidx to
        thread tidx. Returns (it, index into items, whether every thread of the pass falls in
        that kind) for each pass and kind that overlap."""
        n, end = self.threads, max(hi for _, _, hi in items)
        return [(it, s, lo <= it * n and hi >= (it + 1) * n)
                for it in range(-(-end // n)) for s, (_, lo, hi) in enumerate(items)
                if lo < (it + 1) * n and hi > it * n]

    def conv_write_items(self):
        """(q|k|v index, first item, end) of the conv-state channels this CTA writes: its
        columns rank·vc + i of each of q, k, v."""
        return tuple((s, s * self.vc, (s + 1) * self.vc) for s in range(3))

    def out_vectors(self, T: int) -> int:
        """Output 16-byte vectors (8 bf16) per CTA: item -> token item // (vc/8), local column
        (item % (vc/8))·8."""
        return T * self.vc // 8


def tile(cfg: Config, K: int = HEAD_DIM) -> Tile:
    return Tile(K, cfg.cluster_n, cfg.rows_per_thread)


def config(tokens: int, n_heads: int, taps: int, batch_bucket: int) -> Config:
    """Clusters of 4 CTAs per (request, head) up to 4 requests, 2 up to 16, 1 above (aiming at
    >= ~100 CTAs while each keeps 64 state registers per thread). Untuned."""
    del tokens, n_heads, taps
    return Config(4 if batch_bucket <= 4 else 2 if batch_bucket <= 16 else 1)


def configs(K: int = HEAD_DIM) -> list[Config]:
    """Every valid config (for sweeps)."""
    return [c for c in (Config(n, r) for n in (1, 2, 4, 8) for r in (8, 16, 32))
            if tile(c, K).valid()]


def can_implement(*args) -> bool:
    return refusal(*args) is None


def refusal(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
            k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, *_) -> str | None:
    """Why the kernel cannot take these inputs, or None. Metadata only (fake tensors work);
    data alignment is checked at launch."""
    bf16, f32 = torch.bfloat16, torch.float32
    if q.dim() != 3 or recurrent_state.dim() != 4 or conv_state.dim() != 3:
        return (f"ranks q {q.dim()}, recurrent_state {recurrent_state.dim()}, conv_state "
                f"{conv_state.dim()} (want 3, 4, 3)")
    B, T, W = q.shape
    S, H, K = recurrent_state.shape[:3]
    if K != HEAD_DIM or recurrent_state.shape[3] != K or W != H * K:
        return f"recurrent_state {tuple(recurrent_state.shape)}, q width {W} (want K = {HEAD_DIM})"
    if not 1 <= T <= MAX_TOKENS:
        return f"{T} tokens per request (want 1..{MAX_TOKENS})"
    for name, t, width in (("q", q, W), ("k", k, W), ("v", v, W), ("g", g, W),
                           ("graw", graw, W), ("b", b, H)):
        if t.dtype != bf16 or tuple(t.shape) != (B, T, width) or t.stride(-1) != 1:
            return (f"{name}: {t.dtype} {tuple(t.shape)} {t.stride()} (want bf16 [{B}, {T}, "
                    f"{width}], last dim contiguous)")
    if recurrent_state.dtype != f32 or recurrent_state.stride()[1:] != (K * K, K, 1) or \
            recurrent_state.stride(0) % 4:
        return (f"recurrent_state: {recurrent_state.dtype} {recurrent_state.stride()} (want fp32, "
                "inner dims contiguous, slot stride a multiple of 4)")
    taps = conv_state.shape[2] + 1
    if not 2 <= taps <= MAX_TAPS:
        return f"{taps} conv taps (want 2..{MAX_TAPS})"
    if conv_state.dtype != bf16 or conv_state.shape[:2] != (S, 3 * W) or \
            conv_state.stride()[1:] != (taps - 1, 1):
        return (f"conv_state: {conv_state.dtype} {tuple(conv_state.shape)} {conv_state.stride()} "
                f"(want bf16 [{S}, {3 * W}, taps-1], inner dims contiguous)")
    if slots.dtype != torch.int64 or tuple(slots.shape) != (B,) or (B and slots.stride(0) != 1):
        return f"slots: {slots.dtype} {tuple(slots.shape)} (want contiguous int64 [{B}])"
    for name, t, dtype, shape in (
            ("q_conv_weight", q_conv_weight, bf16, (W, 1, taps)),
            ("k_conv_weight", k_conv_weight, bf16, (W, 1, taps)),
            ("v_conv_weight", v_conv_weight, bf16, (W, 1, taps)),
            ("A_log", A_log, f32, (H,)), ("dt_bias", dt_bias, f32, (W,)),
            ("o_norm_weight", o_norm_weight, bf16, (K,))):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            return f"{name}: {t.dtype} {tuple(t.shape)} (want contiguous {dtype} {list(shape)})"
    return None


@functools.cache
def _kernel_class():
    import cutlass
    from cutlass import BFloat16, Float32, Int64, const_expr, cute

    from .common.copy import vectors
    from .common.reduce import row_sum

    def sigmoid(x):
        return 1.0 / (1.0 + cute.math.exp(-x))

    def bf16_round(x):
        return x.to(BFloat16).to(Float32)

    class KDADecode:
        def __init__(self, tokens: int, n_heads: int, taps: int, cfg: Config, pdl: bool = False):
            self.T, self.H, self.taps, self.pdl = tokens, n_heads, taps, pdl
            self.K = HEAD_DIM
            self.W = n_heads * HEAD_DIM
            self.tile = tile(cfg)
            self.C, self.R = cfg.cluster_n, cfg.rows_per_thread
            self.threads, self.warps = self.tile.threads, self.tile.warps
            T, K, vc = tokens, HEAD_DIM, self.tile.vc
            # sQ, sK, sA (T, K); sV, sO (T, vc); sBeta (T,); sRed (C·warps, T); 16-byte padding each
            words = 3 * T * K + 2 * T * vc + T + self.C * self.warps * T
            self.smem_bytes = 4 * words + 16 * 7

        @cute.jit
        def __call__(self, mQ, mK, mV, mG, mGraw, mB, mConv, mState, mSlots, mWq, mWk, mWv,
                     mALog, mDt, mWo, mOut, lower_bound: Float32, l2_eps: Float32,
                     q_scale: Float32, norm_eps: Float32, stream):
            # mQ, mK, mV, mG, mGraw: (B, T, W); mB: (B, T, H); mConv: (S, 3W, taps-1);
            # mState: (S, H, K, K); mSlots: (B,); mW*: (W, 1, taps); mALog: (H,); mDt: (W,);
            # mWo: (K,); mOut: (B, T, H, K)
            C = self.C
            self.kernel(mQ, mK, mV, mG, mGraw, mB, mConv, mState, mSlots, mWq, mWk, mWv, mALog,
                        mDt, mWo, mOut, lower_bound, l2_eps, q_scale, norm_eps).launch(
                grid=[C, self.H, mQ.shape[0]], block=[self.threads, 1, 1],
                cluster=[C, 1, 1] if const_expr(C > 1) else None, smem=self.smem_bytes,
                stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mQ, mK, mV, mG, mGraw, mB, mConv, mState, mSlots, mWq, mWk, mWv, mALog,
                   mDt, mWo, mOut, lower_bound: Float32, l2_eps: Float32, q_scale: Float32,
                   norm_eps: Float32):
            pdl_launch_dependents(self.pdl)
            tidx, _, _ = cute.arch.thread_idx()
            rank, h, req = cute.arch.block_idx()
            T, K, R, C, tl = self.T, self.K, self.R, self.C, self.tile
            if const_expr(C > 1):
                cute.arch.cluster_arrive_relaxed()  # matched in row_sum
            pdl_wait(self.pdl)
            slot = mSlots[req]
            slot = Int64(cutlass.select_(slot < 0, slot + Int64(mState.shape[0]), slot))
            smem = cutlass.memory.SmemAllocator()
            sQ = smem.allocate_tensor(Float32, cute.make_layout((T, K), stride=(K, 1)), 16)
            sK = smem.allocate_tensor(Float32, cute.make_layout((T, K), stride=(K, 1)), 16)
            sA = smem.allocate_tensor(Float32, cute.make_layout((T, K), stride=(K, 1)), 16)
            sV = smem.allocate_tensor(Float32, cute.make_layout((T, tl.vc), stride=(tl.vc, 1)), 16)
            sO = smem.allocate_tensor(Float32, cute.make_layout((T, tl.vc), stride=(tl.vc, 1)), 16)
            sBeta = smem.allocate_tensor(Float32, cute.make_layout((T,)), 16)
            sRed = smem.allocate_tensor(Float32, cute.make_layout(
                (C * self.warps, T), stride=(T, 1)), 16)

            # The state first: R 16-byte loads per thread, in flight during the prologue.
            rg, lc0 = tl.thread(tidx)
            vg = (rank * tl.vc + lc0) // VEC
            gS = mState[slot, h, None, None]  # (K, K): key rows, value columns
            rS = cute.make_rmem_tensor(cute.make_layout((VEC, R)), Float32)  # (4 cols, R rows)
            for i in cutlass.range_constexpr(R):
                cute.autovec_copy(vectors(gS[rg + tl.rw * i, None])[None, vg], rS[None, i])

            self.prologue(tidx, rank, h, req, slot, mQ, mK, mV, mGraw, mB, mConv, mWq, mWk,
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
            self.write_conv_state(tidx, rank, h, req, slot, mQ, mK, mV, mConv)

        @cute.jit
        def prologue(self, tidx, rank, h, req, slot, mQ, mK, mV, mGraw, mB, mConv, mWq, mWk,
                     mWv, mALog, mDt, sQ, sK, sV, sA, sBeta, lower_bound: Float32):
            """Conv + SiLU of q, k (all channels), v (own columns); α; β -> shared memory."""
            T, tl, n = self.T, self.tile, self.threads
            items = tl.prologue_items()
            plan = tl.plan(items)
            for p in cutlass.range_constexpr(len(plan)):
                it, s, full = plan[p]
                kind, lo, hi = items[s]
                item = it * n + tidx
                if const_expr(full):
                    self.prologue_item(kind, item - lo, rank, h, req, slot, mQ, mK, mV, mGraw,
                                       mConv, mWq, mWk, mWv, mALog, mDt, sQ, sK, sV, sA,
                                       lower_bound)
                else:
                    if (item >= lo) & (item < hi):
                        self.prologue_item(kind, item - lo, rank, h, req, slot, mQ, mK, mV,
                                           mGraw, mConv, mWq, mWk, mWv, mALog, mDt, sQ, sK, sV,
                                           sA, lower_bound)
            if tidx < T:
                sBeta[tidx] = sigmoid(mB[req, tidx, h].to(Float32))

        def prologue_item(self, kind, c, rank, h, req, slot, mQ, mK, mV, mGraw, mConv, mWq,
                          mWk, mWv, mALog, mDt, sQ, sK, sV, sA, lower_bound):
            T, K, W, taps = self.T, self.K, self.W, self.taps
            if kind == "alpha":
                ch = h * K + c
                e = cute.math.exp(mALog[h])
                dt = mDt[ch]
                for t in range(T):
                    gate = e * (mGraw[req, t, ch].to(Float32) + dt)
                    sA[t, c] = cute.math.exp(lower_bound * sigmoid(gate))
            else:
                s = "qkv".index(kind)
                mX, mW, sX = (mQ, mWq, sQ) if s == 0 else (mK, mWk, sK) if s == 1 else (
                    mV, mWv, sV)
                ch = h * K + (rank * self.tile.vc if s == 2 else 0) + c
                win = [mConv[slot, s * W + ch, j].to(Float32) for j in range(taps - 1)]
                win += [mX[req, t, ch].to(Float32) for t in range(T)]
                w = [mW[ch, 0, j].to(Float32) for j in range(taps)]
                for t in range(T):
                    acc = win[t] * w[0]
                    for j in range(1, taps):
                        acc = acc + win[t + j] * w[j]
                    sX[t, c] = bf16_round(acc / (1.0 + cute.math.exp(-acc)))  # SiLU

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
            """The delta rule over the T tokens on the thread's R x 4 state tile. o' = bf16(o) of
            the owned columns goes to sO; returns each token's Σ o'² over the thread's columns
            (row group 0 only, so the CTA sum counts every column once)."""
            ss = []
            for t in cutlass.range_constexpr(self.T):
                kv = self.state_pass(rS, rg, t, sA, sK, lambda s, a, j: s * a)
                beta = sBeta[t]
                u = [beta * (sV[t, lc0 + j] - kv[j]) for j in range(VEC)]
                o = self.state_pass(rS, rg, t, sK, sQ, lambda s, kk, j, u=u: s + kk * u[j])
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
            """out = bf16(bf16(w·bf16(o'·rstd))·bf16(σ(g))), one 16-byte vector per item."""
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
                y = bf16_round(mWo[col + e].to(Float32) * bf16_round(sO[t, lc + e] * rstd))
                rY[e] = y * bf16_round(sigmoid(mG[req, t, h * K + col + e].to(Float32)))
            rOut = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
            rOut.store(rY.load().to(BFloat16))
            cute.autovec_copy(rOut, vectors(mOut[req, t, h, None])[None, col // 8])

        @cute.jit
        def write_conv_state(self, tidx, rank, h, req, slot, mQ, mK, mV, mConv):
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
                    self.conv_row(s, ch, req, slot, mX, mConv)
                else:
                    if (item >= lo) & (item < hi):
                        self.conv_row(s, ch, req, slot, mX, mConv)

        def conv_row(self, s, ch, req, slot, mX, mConv):
            """Channel ch of q|k|v (s = 0|1|2): window positions T .. T + taps - 2, old inputs
            while below taps - 1. All read before any is written (T < taps - 1 shifts the row)."""
            T, keep, row = self.T, self.taps - 1, s * self.W + ch
            new = [mConv[slot, row, T + j] if T + j < keep else mX[req, T + j - keep, ch]
                   for j in range(keep)]
            for j in range(keep):
                mConv[slot, row, j] = new[j]

    return KDADecode


def prepare(tokens: int, n_heads: int, taps: int = 4, buckets=BUCKETS) -> None:
    """Compile the kernel of every batch bucket for these scalars (call before graph capture)."""
    for b in buckets:
        KERNEL.compiled(tokens, n_heads, taps, config(tokens, n_heads, taps, b), rows=b)


def build(tokens, n_heads, taps, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    T, H, K = tokens, n_heads, HEAD_DIM
    W = H * K
    n = cute.sym_int()

    def act(width):  # [B, T, width] column slices: last dim contiguous, any row strides
        return make_fake_tensor(bf16, (n, T, width), stride=(cute.sym_int64(), cute.sym_int64(),
                                                             1), assumed_align=2)

    def weight(dtype, shape, stride):
        return make_fake_tensor(dtype, shape, stride=stride, assumed_align=dtype.width // 8)

    conv_w = [weight(bf16, (W, 1, taps), (taps, taps, 1)) for _ in range(3)]
    return compile_kernel(
        _kernel_class()(T, H, taps, cfg, pdl), act(W), act(W), act(W), act(W), act(W), act(H),
        make_fake_tensor(bf16, (cute.sym_int(), 3 * W, taps - 1),
                         stride=(cute.sym_int64(), taps - 1, 1), assumed_align=2),
        make_fake_tensor(f32, (cute.sym_int(), H, K, K),
                         stride=(cute.sym_int64(divisibility=4), K * K, K, 1), assumed_align=16),
        make_fake_tensor(cutlass.Int64, (n,), stride=(1,), assumed_align=8), *conv_w,
        weight(f32, (H,), (1,)), weight(f32, (W,), (1,)), weight(bf16, (K,), (1,)),
        make_fake_tensor(bf16, (n, T, H, K), stride=(T * H * K, H * K, K, 1), assumed_align=16),
        f32(-5.0), f32(1e-6), f32(K ** -0.5), f32(1e-5), fake_stream(), arch=arch,
        dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def kda_decode_cuda(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                    k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                    l2_eps, q_scale, norm_eps, *, out=None):
    """CUDA implementation of k3::kda_decode: the kernel, or the reference if refused (reason
    logged). `out` [B, T, H, K] bf16 contiguous is written only when the kernel runs."""
    args = (q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
            k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight)
    B, T = q.shape[:2]

    def call_refusal():
        if reason := refusal(*args):
            return reason
        if not all(t.is_cuda and t.device == q.device for t in args):
            return "inputs not all on one CUDA device"
        if out is not None and (
                out.dtype != torch.bfloat16 or not out.is_contiguous()
                or tuple(out.shape) != (B, T, *recurrent_state.shape[1:3])
                or out.data_ptr() % 16):
            return f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
        return None

    def launch():
        H, K = recurrent_state.shape[1:3]
        o = q.new_empty((B, T, H, K)) if out is None else out
        if B:
            taps = conv_state.shape[2] + 1
            bb = bucket(B)
            KERNEL.compiled(T, H, taps, config(T, H, taps, bb), rows=bb)(
                *args, o, float(lower_bound), float(l2_eps), float(q_scale), float(norm_eps))
        return o

    return KERNEL.run(call_refusal,
                      lambda: kda_decode_ref(*args, lower_bound, l2_eps, q_scale, norm_eps),
                      launch, recurrent_state)


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", kda_decode_cuda)
