"""CuTe DSL kernel for `k3::mla_decode`: the latent-cache write of the T new rows and absorbed MLA
decode attention, split-KV, in two launches of one compiled function (`mla_decode_ref` in
k3compile/ops/mla.py is the math and the rounding it follows).

    cache[slot, pos+t] <- [c_kv_t | k_pe_t];  o_lat[t, h] = bf16(Σ_{i<=pos+t} softmax_i(s)·c_kv_i)
    s = bf16(bf16(q_lat·c_kv) + bf16(q_pe·k_pe))·scale

Opt-in (not in kernels.KERNELS; K3_KERNELS_EXTRA=mla_decode registers it). Work split,
rounding, cost and measurements: docs/kernels.md, mla_decode.

Constraints:
    * q_lat bf16 [B, T, H, C], q_pe bf16 [B, T, H, R], c_kv bf16 [B, T, C], k_pe bf16 [B, T, R]:
      last dim contiguous, other strides multiples of 8 elements, 16-byte-aligned data;
      1 <= T <= 16; C in (256, 512), R in (32, 64).
    * kv_cache bf16 [S, L, C + R]: last dim contiguous, other strides multiples of 8, 16-byte-
      aligned data. slots, positions contiguous int64 [B] (negative slots count from the end, as
      torch indexing does; two requests on one slot race, as in the reference's index_put).
      positions + T <= L is the caller's precondition (the reference raises): rows at or past L
      are neither written nor attended.
    * Output bf16 [B, T, H, C], contiguous. p is rounded to bf16 before p·c_kv (flash-attention
      style): o_lat agrees with the reference to ~3e-3 relative in norm.
"""

import functools
from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.mla import mla_decode_ref

from .common.dsl import (
    bucket,
    compile_kernel,
    fake_stream,
)
from .common.launch import Kernel

OP = "mla_decode"
MAX_TOKENS = 16
TILE = 32  # cache rows per shared-memory tile: one per lane in the softmax step
SMS = 132  # H200
LATENT = (256, 512)
ROPE = (32, 64)
MAX_SPLITS = 128
COMBINE_UNROLL = 8  # splits the merge launch reads at once
GROUP = 4  # tile rows whose warp sums are scattered together (one row per 8 lanes)


def reduce_scatter(vals, lane_bit, shfl_xor, select):
    """Warp sums of GROUP = 4 per-lane partials (rows 0..3 of a row group) in 6 shuffles instead
    of 20: two halving steps, each lane keeping the half its lane bit names and adding its
    partner's, then a butterfly over the 8 lanes left sharing a row. Lane l gets the total of
    row (l >> 3) & 3. The ops are injected, so the kernel (DSL values) and the CPU test (32
    emulated lanes) run this same code."""
    for off in (16, 8):
        n, bit = len(vals) // 2, lane_bit(off)
        vals = [select(bit, vals[k + n], vals[k]) + shfl_xor(select(bit, vals[k], vals[k + n]),
                                                             off) for k in range(n)]
    total = vals[0]
    for off in (4, 2, 1):
        total = total + shfl_xor(total, off)
    return total


def lane_row(lane):
    """The tile row whose score lane `lane` keeps: it takes row group lane & 7's total."""
    return GROUP * (lane & 7) + ((lane >> 3) & 3)


def row_lane(row):
    """Inverse of lane_row: the lane holding tile row `row`'s score and p."""
    return (row // GROUP) | ((row % GROUP) << 3)


@dataclass(frozen=True)
class Config:
    queries_per_warp: int  # QW: queries (t, h) per warp, in registers
    warps: int  # per CTA; a CTA serves QW·warps queries, H·T / (QW·warps) query groups

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def groups(self, tokens: int, n_heads: int) -> int:
        return tokens * n_heads // (self.queries_per_warp * self.warps)


def config(tokens: int, n_heads: int, latent: int = 512, rope: int = 64,
           batch_bucket: int = 1) -> Config:
    """Up to 4 queries per warp (≈ 200 registers at C = 512), at most 8 warps per CTA; the rest
    of the H·T queries go to more query groups (CTAs reading the same rows, through the L2).
    The compile does not depend on the batch: `splits` picks the split count at launch."""
    del latent, rope, batch_bucket
    n = tokens * n_heads
    most = 1 if n <= 8 else 2 if n <= 16 else 4
    qw = next(q for q in (4, 2, 1) if q <= most and n % q == 0)
    warps = max(w for w in range(1, 9) if (n // qw) % w == 0)
    return Config(qw, warps)


def splits(batch: int, tokens: int, n_heads: int, max_len: int, latent: int = 512,
           rope: int = 64) -> int:
    """CTAs per (request, query group) along the context: about two CTAs per SM over the grid,
    at most MAX_SPLITS and one per tile of the cache's rows, and no more partials (fp32 H·T x C
    per split) than the cache bytes a request can read."""
    groups = config(tokens, n_heads, latent, rope).groups(tokens, n_heads)
    want = -(-2 * SMS // (bucket(batch) * groups))
    by_bytes = max_len * (latent + rope) * 2 // (tokens * n_heads * latent * 4)
    return max(1, min(want, MAX_SPLITS, -(-max_len // TILE), by_bytes))


def can_implement(*args) -> bool:
    return refusal(*args) is None


def refusal(q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions, *_) -> str | None:
    """Why the kernel cannot take these inputs, or None. Metadata only (fake tensors work);
    data alignment is checked at launch."""
    bf16 = torch.bfloat16
    if q_lat.dim() != 4 or q_pe.dim() != 4 or c_kv.dim() != 3 or k_pe.dim() != 3 or \
            kv_cache.dim() != 3:
        return "ranks (want q_lat, q_pe 4; c_kv, k_pe, kv_cache 3)"
    B, T, H, C = q_lat.shape
    R = q_pe.shape[-1]
    if C not in LATENT or R not in ROPE:
        return f"latent {C}, rope {R} (want C in {LATENT}, R in {ROPE})"
    if not 1 <= T <= MAX_TOKENS:
        return f"{T} tokens per request (want 1..{MAX_TOKENS})"
    for name, t, shape in (("q_lat", q_lat, (B, T, H, C)), ("q_pe", q_pe, (B, T, H, R)),
                           ("c_kv", c_kv, (B, T, C)), ("k_pe", k_pe, (B, T, R)),
                           ("kv_cache", kv_cache, (*kv_cache.shape[:2], C + R))):
        if t.dtype != bf16 or tuple(t.shape) != shape or t.stride(-1) != 1 or \
                any(s % 8 for s in t.stride()[:-1]):
            return (f"{name}: {t.dtype} {tuple(t.shape)} {t.stride()} (want bf16 {list(shape)}, "
                    "last dim contiguous, other strides multiples of 8)")
    for name, t in (("slots", slots), ("positions", positions)):
        if t.dtype != torch.int64 or tuple(t.shape) != (B,) or (B and t.stride(0) != 1):
            return f"{name}: {t.dtype} {tuple(t.shape)} (want contiguous int64 [{B}])"
    return None


@functools.cache
def _kernel_class():
    import cutlass
    from cutlass import BFloat16, Float32, Int32, Int64, const_expr, cute

    from .common.copy import vectors

    NEG_INF = float("-inf")

    def bf16_round(x):
        return x.to(BFloat16).to(Float32)

    class MLADecode:
        def __init__(self, tokens: int, n_heads: int, latent: int, rope: int, cfg: Config):
            self.T, self.H, self.C, self.R = tokens, n_heads, latent, rope
            self.QW, self.warps, self.threads = cfg.queries_per_warp, cfg.warps, cfg.threads
            self.Q = self.QW * self.warps  # queries per CTA
            self.groups = cfg.groups(tokens, n_heads)
            self.NV = latent // 256  # latent 16-byte vectors per lane: lane + 32·k
            self.NP = rope // 32  # rope columns per lane: C + NP·lane + e
            self.VR = (latent + rope) // 8  # 16-byte vectors per cache row
            self.smem_bytes = TILE * (latent + rope) * 2 + 64

        @cute.jit
        def __call__(self, mQ, mQpe, mCkv, mKpe, mKV, mSlots, mPos, mWsO, mWsML, mOut,
                     scale: Float32, stream):
            # mQ: (B, T, H, C); mQpe: (B, T, H, R); mCkv: (B, T, C); mKpe: (B, T, R);
            # mKV: (S, L, C + R); mSlots, mPos: (B,); mWsO: (B, splits, H·T, C) fp32;
            # mWsML: (B, splits, H·T, 2) fp32; mOut: (B, T, H, C)
            B, n_splits = mQ.shape[0], mWsO.shape[1]
            self.attend(mQ, mQpe, mCkv, mKpe, mKV, mSlots, mPos, mWsO, mWsML, scale).launch(
                grid=[n_splits, self.groups, B], block=[self.threads, 1, 1],
                smem=self.smem_bytes, stream=stream)
            self.combine(mWsO, mWsML, mOut).launch(
                grid=[self.H * self.T, B, 1], block=[self.C // 8, 1, 1], stream=stream,
                use_pdl=True)

        @cute.kernel
        def attend(self, mQ, mQpe, mCkv, mKpe, mKV, mSlots, mPos, mWsO, mWsML, scale: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            split, group, b = cute.arch.block_idx()
            lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
            cute.arch.griddepcontrol_launch_dependents()  # combine waits for our completion
            T, H, QW, NV, NP, C = self.T, self.H, self.QW, self.NV, self.NP, self.C
            slot = mSlots[b]
            slot = Int64(cutlass.select_(slot < 0, slot + Int64(mKV.shape[0]), slot))
            pos = Int32(mPos[b])
            n_vis = cutlass.min(pos + T, Int32(mKV.shape[1]))
            n_splits = Int32(mWsO.shape[1])
            length = ((n_vis + n_splits - 1) // n_splits + TILE - 1) // TILE * TILE
            lo = split * length
            hi = cutlass.min(lo + length, n_vis)
            n_tiles = cutlass.max(hi - lo + TILE - 1, 0) // TILE

            smem = cutlass.memory.SmemAllocator()
            sKV = smem.allocate_tensor(BFloat16, cute.make_layout(
                (TILE, C + self.R), stride=(C + self.R, 1)), 16)  # (32 rows, C + R)

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
                self.load_tile(tidx, b, group, slot, pos, base, hi, mCkv, mKpe, mKV, sKV)
                cute.arch.barrier()
                for g in cutlass.range(TILE // GROUP, unroll=1):
                    self.group_scores(sKV, g, lane, rQ, rK, rS, scale)
                i = base + lane_row(lane)
                for j in cutlass.range_constexpr(QW):
                    rS[j] = Float32(cutlass.select_((i < hi) & (i <= limit[j]), rS[j],
                                                    Float32(NEG_INF)))
                for j in cutlass.range_constexpr(QW):
                    self.softmax_step(j, rS, rM, rL, rP, rAcc)
                for r in cutlass.range(TILE, unroll=2):
                    self.row_values(sKV, r, lane, rK, False)
                    for j in cutlass.range_constexpr(QW):
                        p = cute.arch.shuffle_sync(rP[j], row_lane(r))
                        for e in cutlass.range_constexpr(8 * NV):
                            rAcc[j, e] = rAcc[j, e] + p * rK[e]
                cute.arch.barrier()  # the tile is read before the next load overwrites it

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
        def load_tile(self, tidx, b, group, slot, pos, base, hi, mCkv, mKpe, mKV, sKV):
            """Cache rows base .. base + 31 -> sKV (rows at or past hi zero-filled); the new rows
            (>= pos) come from c_kv | k_pe and are written to the cache here (by query group 0
            only: the other groups' CTAs load the same tile)."""
            VR, n = self.VR, self.threads
            rV = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
            total = TILE * VR
            for it in cutlass.range_constexpr(-(-total // n)):
                item = it * n + tidx
                if const_expr((it + 1) * n <= total):
                    self.load_vector(item, b, group, slot, pos, base, hi, mCkv, mKpe, mKV, sKV,
                                     rV)
                else:
                    if item < total:
                        self.load_vector(item, b, group, slot, pos, base, hi, mCkv, mKpe, mKV,
                                         sKV, rV)

        @cute.jit
        def load_vector(self, item, b, group, slot, pos, base, hi, mCkv, mKpe, mKV, sKV, rV):
            VR, CV = self.VR, self.C // 8
            r, v = item // VR, item % VR
            i = base + r
            rV.fill(0.0)
            if i < hi:
                gRow = vectors(mKV[slot, i, None])
                if i >= pos:
                    if v < CV:
                        cute.autovec_copy(vectors(mCkv[b, i - pos, None])[None, v], rV)
                    else:
                        cute.autovec_copy(vectors(mKpe[b, i - pos, None])[None, v - CV], rV)
                    if group == 0:
                        cute.autovec_copy(rV, gRow[None, v])
                else:
                    cute.autovec_copy(gRow[None, v], rV)
            cute.autovec_copy(rV, vectors(sKV[r, None])[None, v])

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
            """o_lat[b, t, h, 8·tidx ..] from every split's partial, in split order."""
            tidx, _, _ = cute.arch.thread_idx()
            q, b, _ = cute.arch.block_idx()
            t, h = q // self.H, q % self.H
            n_splits = mWsO.shape[1]
            cute.arch.griddepcontrol_wait()  # PDL: every attend CTA has finished and flushed
            # both loops unrolled by COMBINE_UNROLL: their loads do not depend on each other, so
            # that many are in flight at once. One at a time, the 2 x 128 L2 round trips of B1
            # (128 splits) would take tens of µs: the likely bulk of the op's 62.7 µs there
            # (BENCHMARKS.md session 4; not yet re-measured). The sums keep split order.
            m_all = Float32(NEG_INF)
            for s in cutlass.range(n_splits, unroll=COMBINE_UNROLL):
                m_all = cute.arch.fmax(m_all, mWsML[b, s, q, 0])
            total = Float32(0.0)
            rAcc = cute.make_rmem_tensor(cute.make_layout((8,)), Float32)
            rAcc.fill(0.0)
            rO = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
            for s in cutlass.range(n_splits, unroll=COMBINE_UNROLL):
                w = cute.math.exp(mWsML[b, s, q, 0] - m_all)  # 0 for an empty split (m = -inf)
                total = total + mWsML[b, s, q, 1] * w
                for half in cutlass.range_constexpr(2):
                    cute.autovec_copy(vectors4(mWsO[b, s, q, None])[None, 2 * tidx + half], rO)
                    for e in cutlass.range_constexpr(4):
                        rAcc[4 * half + e] = rAcc[4 * half + e] + rO[e] * w
            inv = 1.0 / total
            rOut = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
            for e in cutlass.range_constexpr(8):
                rOut[e] = (rAcc[e] * inv).to(BFloat16)
            cute.autovec_copy(rOut, vectors(mOut[b, t, h, None])[None, tidx])

    def vectors4(mX):
        """fp32 row (dim,) -> (4, dim / 4): 16-byte vectors."""
        return cute.zipped_divide(mX, (4,))

    return MLADecode


def prepare(tokens: int, n_heads: int, latent: int = 512, rope: int = 64) -> None:
    """Compile the kernel for these scalars (call before graph capture; every batch shares it)."""
    KERNEL.compiled(tokens, n_heads, latent, rope, config(tokens, n_heads, latent, rope))


def build(tokens, n_heads, latent, rope, cfg, arch=None, dump_dir=None):
    """Compile now, uncached (`dump_dir` keeps the cubin)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    T, H, C, R = tokens, n_heads, latent, rope
    n, ns = cute.sym_int(), cute.sym_int()

    def act(*shape):  # last dim contiguous, other strides multiples of 8, 16-byte-aligned data
        strides = tuple(cute.sym_int64(divisibility=8) for _ in shape)
        return make_fake_tensor(bf16, (n, *shape), stride=(*strides, 1), assumed_align=16)

    def ws(width):  # contiguous fp32 workspace; (m, l) pairs are read as scalars
        vec = width % 4 == 0
        return make_fake_tensor(f32, (n, ns, H * T, width),
                                stride=(cute.sym_int64(divisibility=4 if vec else 1),
                                        H * T * width, width, 1),
                                assumed_align=16 if vec else 4)

    return compile_kernel(
        _kernel_class()(T, H, C, R, cfg), act(T, H, C), act(T, H, R), act(T, C), act(T, R),
        make_fake_tensor(bf16, (cute.sym_int(), cute.sym_int(), C + R),
                         stride=(cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8),
                                 1), assumed_align=16),
        make_fake_tensor(cutlass.Int64, (n,), stride=(1,), assumed_align=8),
        make_fake_tensor(cutlass.Int64, (n,), stride=(1,), assumed_align=8),
        ws(C), ws(2),
        make_fake_tensor(bf16, (n, T, H, C), stride=(T * H * C, H * C, C, 1), assumed_align=16),
        f32((C + R) ** -0.5), fake_stream(), arch=arch, dump_dir=dump_dir)


KERNEL = Kernel(OP, build, pdl=False)  # no PDL build: it runs between its own launches


def mla_decode_cuda(q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions, scale, *, out=None):
    """CUDA implementation of k3::mla_decode: the kernel, or the reference if refused (reason
    logged). `out` [B, T, H, C] bf16 contiguous is written only when the kernel runs."""
    args = (q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions)

    def call_refusal():
        if reason := refusal(*args):
            return reason
        if not all(t.is_cuda and t.device == q_lat.device for t in args):
            return "inputs not all on one CUDA device"
        if any(t.data_ptr() % 16 for t in args[:5]):
            return "q_lat, q_pe, c_kv, k_pe or kv_cache data not 16-byte aligned"
        if out is not None and (out.dtype != torch.bfloat16 or not out.is_contiguous()
                                or out.shape != q_lat.shape or out.data_ptr() % 16):
            return f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
        return None

    def launch():
        B, T, H, C = q_lat.shape
        R = q_pe.shape[-1]
        o = torch.empty_like(q_lat, memory_format=torch.contiguous_format) if out is None else out
        if B:
            cfg = config(T, H, C, R)
            n = splits(B, T, H, kv_cache.shape[1], C, R)
            ws_o = q_lat.new_empty((B, n, H * T, C), dtype=torch.float32)
            ws_ml = q_lat.new_empty((B, n, H * T, 2), dtype=torch.float32)
            KERNEL.compiled(T, H, C, R, cfg)(*args, ws_o, ws_ml, o, float(scale))
        return o

    return KERNEL.run(call_refusal, lambda: mla_decode_ref(*args, scale).contiguous(), launch)


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", mla_decode_cuda)
