"""CuTe DSL kernels for `k3::moe_experts`: the routed MXFP4 experts, read packed (W4A16).

    u[n] = bf16(Σ_j w[n,j]·bf16(SiTU(bf16(z[n]·W1[e]ᵀ), bf16(z[n]·W3[e]ᵀ))·W2[e]ᵀ)), e = ids[n,j]

W = e2m1 · 2^(scale − 127) decoded in registers, fp32 products and sums. Two launches: FC1 +
SiTU, then FC2 + finalize (launched with PDL after FC1); `config` takes FC1 with cp.async at
one row, to registers above. Design, decode and measurements: docs/kernels.md, moe_experts.

Constraints:
    * z bf16 [N, L], last dim contiguous, row stride a multiple of 8, 16-byte aligned; ids
      int64 or int32 and weights fp32 [N, k], last dim contiguous; 1 <= k <= 16; any N (above
      64 rows with the 64-row configs).
    * Experts stacked, contiguous uint8: w1/w3 packed [E, I, L/2] + scales [E, I, L/32], w2
      packed [E, L, I/2] + scales [E, L, I/32]; packed data 16-byte aligned.
    * L % 32 == 0, 32 <= L <= 8192; I % 32 == 0, 32 <= I <= 512, or I % 384 == 0 up to 3072
      (FC2's chunks: I/W at TP W = 16, 8, 4, 2, 1 is 192, 384, 768, 1536, 3072).
    * ids outside [0, E) are clamped (the reference raises); |z| < 2^32; scale bytes <= 224
      (2^97; 255 is E8M0's NaN); scale 0 (2^-127) is exact.
    * The op's own constraints (k3compile.ops.moe `moe_experts_refusal`) are checked first;
      `refusal` holds only these kernels' limits (registered in the op registry).
"""

import functools
import operator
from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.moe import moe_experts_ref, moe_experts_refusal

from .common.dsl import (
    aligned16,
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
    pdl_wait,
    rows_ok,
)
from .common.launch import Kernel

OP = "moe_experts"
MAX_TOP_K = 16
MAX_LATENT = 8192
MAX_INTER = 3072  # TP1 (3072 / W per rank under TP W)
ROW_VECTORS = 16  # FC2 keeps a whole W2 row in registers up to I = 512 (16 vectors) ...
CHUNK_VECTORS = 12  # ... and above, two chunks of 12 (I % 384 == 0): ~105-115 registers
STAGE_VECTORS = 8  # most act vectors per thread in flight while FC2 stages act in shared memory
SMEM_BYTES = 227 * 1024  # per CTA on sm_90
Z_SHIFT = 96  # activations are staged times 2^Z_SHIFT (see the docstring)
SCALE_BIAS = 126 - Z_SHIFT  # fp32 exponent field of a group's factor = scale byte + SCALE_BIAS
PAIR_SHIFT = (12, 8, 4, 0)  # word << PAIR_SHIFT[i] puts inputs i, i + 4 atop the two halves
SIGN_MASK, MAG_MASK = 0x80008000, 0x01C001C0


@dataclass(frozen=True)
class FC1Config:
    warps: int
    rows_per_warp: int  # rows of W1 and of W3 per warp
    # weights by cp.async into shared memory, one group per lane step, the math of a step after
    # its group alone arrived (see the docstring); off: every load to registers, then the math
    cp_async: bool = False

    @property
    def threads(self) -> int:
        return 32 * self.warps


@dataclass(frozen=True)
class FC2Config:
    rows_per_cta: int  # R output columns l per CTA
    threads: int  # R·k threads, whole warps


def config(stage: str, latent: int, inter: int, top_k: int, batch_bucket: int):
    """FC1: 4 warps; at one row 1 row per warp with cp.async (the H200 sweep of 2026-11-29 at
    the TP16 rank: 11.75 µs per call vs 13.26 for the plain 4 x 2; BENCHMARKS.md session 6),
    above it plain with 2 rows per warp while a lane's loads stay <= 16 vectors (L <= 4096),
    else 1 (the sweep's best or within 1% at 8-64 rows; grouped FC1 lost at 16-64).
    FC2: R·k >= 128 threads where k allows, whole warps (R a multiple of 32 for odd k)."""
    if stage == "fc1":
        if batch_bucket == 1 and fc1_fits(latent, cp := FC1Config(4, 1, cp_async=True)):
            return cp
        return FC1Config(4, 2 if _lane_vectors(latent) <= 4 else 1)
    rows = 64 if top_k <= 2 else 32 if top_k <= 4 or top_k % 2 else 16
    return FC2Config(rows, -(-rows * top_k // 32) * 32)


def _chunk_vectors(n_vec: int) -> int:
    """W2 vectors per FC2 chunk: the whole row up to ROW_VECTORS, else CHUNK_VECTORS. (Chunks of
    8 or 16 left a stack frame or ~180 registers at some I on sm_90a.)"""
    return n_vec if n_vec <= ROW_VECTORS else CHUNK_VECTORS


def _lane_steps(latent: int) -> tuple[int, bool]:
    """FC1's full lane steps M over a row and whether a split step follows (NV % 32 == 16: lanes
    0-15 take the W1 tail, 16-31 the W3 tail)."""
    nv = latent // 32
    return (nv // 32, True) if nv % 32 == 16 else (_lane_vectors(latent), False)


def fc1_smem(latent: int, cfg: FC1Config) -> int:
    """FC1's shared memory per CTA: z as fp32, and with cp.async every lane's 16-byte vector of
    every lane step, row and matrix
    (47 KB at L 3584 with 4 warps of 2 rows)."""
    if not cfg.cp_async:
        return 4 * latent + 64
    m, split = _lane_steps(latent)
    return 4 * latent + 64 + 16 * 32 * 2 * cfg.rows_per_warp * (m + split) * cfg.warps


def fc1_fits(latent: int, cfg: FC1Config) -> bool:
    return 32 <= cfg.threads <= 1024 and fc1_smem(latent, cfg) <= SMEM_BYTES


def _lane_vectors(latent: int) -> int:
    return -(-(latent // 32) // 32)


def refusal(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
            w2_scale, *_) -> str | None:
    """Why the kernels cannot take operands that meet the op's constraints (k3compile.ops.moe
    `moe_experts_refusal`, which the pattern checks first), or None: the kernels' own limits.
    Metadata only (fake tensors work); data alignment is checked at launch."""
    n_exp, inter, latent = w1_packed.shape[0], w1_packed.shape[1], z.shape[-1]
    if not 32 <= latent <= MAX_LATENT or not 32 <= inter <= MAX_INTER:
        return f"latent {latent} / intermediate {inter} (want <= {MAX_LATENT} / {MAX_INTER})"
    if inter > 32 * ROW_VECTORS and inter % (32 * CHUNK_VECTORS):
        return f"intermediate {inter} > {32 * ROW_VECTORS}: want a multiple of {32 * CHUNK_VECTORS}"
    if why := rows_ok(z, latent, torch.bfloat16):
        return f"z: {why}"
    if not 1 <= ids.shape[-1] <= MAX_TOP_K:
        return f"top_k {ids.shape[-1]} (want 1..{MAX_TOP_K})"
    if ids.dtype not in (torch.int64, torch.int32) or ids.stride(-1) != 1:
        return f"ids: {ids.dtype} {ids.stride()} (want int64 or int32, last dim contiguous)"
    if weights.dtype != torch.float32 or weights.stride(-1) != 1:
        return f"weights: {weights.dtype} {weights.stride()} (want fp32, last dim contiguous)"
    for name, t in (("w1_packed", w1_packed), ("w1_scale", w1_scale), ("w3_packed", w3_packed),
                    ("w3_scale", w3_scale), ("w2_packed", w2_packed), ("w2_scale", w2_scale)):
        if t.dtype != torch.uint8 or not t.is_contiguous():
            return f"{name}: {t.dtype} {t.stride()} (want contiguous uint8)"
    if n_exp < 1:
        return "no experts"
    return None


def can_implement(*args) -> bool:
    """Whether the kernels take this call's operands: the op's constraints and their limits."""
    return moe_experts_refusal(*args) is None and refusal(*args) is None


@functools.cache
def _kernels():
    import cutlass
    from cutlass import BFloat16, Float32, Int32, Uint32, const_expr, cute
    from cutlass.cute.nvgpu import cpasync

    from .common.copy import load_vectors, make_frag, row_vectors

    def decode_dot(words, z):
        """Σ of 32 products: words (4,) Uint32 = one packed 16-byte vector, z (32,) fp32 in
        input order (times 2^Z_SHIFT). The result is the partial times 2^(Z_SHIFT - 126)."""
        p = Float32(0.0)
        for w in range(4):
            q = words[w]  # inputs 8w .. 8w + 7, one nibble each from the low end
            for i in range(4):
                t = q << PAIR_SHIFT[i] if PAIR_SHIFT[i] else q
                bits = (t & Uint32(SIGN_MASK)) | ((t >> 6) & Uint32(MAG_MASK))
                p = p + (bits << 16).bitcast(Float32) * z[8 * w + i]
                p = p + (bits & Uint32(0xFFFF0000)).bitcast(Float32) * z[8 * w + i + 4]
        return p

    def group_z(sZ, c, rZ):
        """32-input group c of the staged z (chunk q at 8c + (q ^ (c & 7))) -> (32,) fp32."""
        rZ4 = cute.zipped_divide(rZ, (4,))  # (4, 8)
        for q in range(8):
            cute.autovec_copy(sZ[None, 8 * c + (q ^ (c % 8))], rZ4[None, q])
        return rZ.load()

    def group_factor(scale):
        """2^(scale − 127 + 126 − Z_SHIFT) from an E8M0 byte (as Uint32)."""
        return ((scale + Uint32(SCALE_BIAS)) << Uint32(23)).bitcast(Float32)

    class FC1:
        def __init__(self, latent: int, inter: int, top_k: int, cfg: FC1Config,
                     pdl: bool = False):
            self.latent, self.inter, self.top_k, self.pdl = latent, inter, top_k, pdl
            self.nv = latent // 32  # packed vectors (and scales) per weight row
            # Lane steps over both matrices; with NV % 32 == 16 (L = 3584: 112 vectors) a last
            # step gives lanes 0-15 the W1 tail and lanes 16-31 the W3 tail (no idle lanes).
            self.m, self.split = _lane_steps(latent)
            self.cfg, self.rw, self.warps, self.threads = cfg, cfg.rows_per_warp, cfg.warps, \
                cfg.threads
            self.rows = cfg.warps * cfg.rows_per_warp
            self.cp_async = cfg.cp_async
            self.steps = self.m + self.split  # cp.async groups per lane
            if not fc1_fits(latent, cfg):
                raise ValueError(f"{cfg} at L {latent}: {fc1_smem(latent, cfg)} B of shared memory")

        @cute.jit
        def stage_z(self, rZ8: cute.Tensor, sZ: cute.Tensor, tidx: Int32):
            """rZ8 (8, ZV) bf16 z vectors of this thread -> sZ fp32 times 2^Z_SHIFT, chunk q of
            group c at 8c + (q ^ (c & 7)); then the CTA barrier."""
            rF = cute.make_rmem_tensor(cute.make_layout((8,)), Float32)
            rF4 = cute.zipped_divide(rF, (4,))  # (4, 2)
            for s in cutlass.range_constexpr(cute.size(rZ8, mode=[1])):
                v = s * self.threads + tidx
                if v < self.latent // 8:
                    rF.store(rZ8[None, s].load().to(Float32) * Float32(2.0 ** Z_SHIFT))
                    c, q = v // 4, 2 * (v % 4)
                    cute.autovec_copy(rF4[None, 0], sZ[None, 8 * c + (q ^ (c % 8))])
                    cute.autovec_copy(rF4[None, 1], sZ[None, 8 * c + ((q + 1) ^ (c % 8))])
            cute.arch.barrier()

        @cute.jit
        def finish(self, acc, lane, pair, i0, mAct, beta, linear_beta):
            """Warp sums of the RW (W1, W3) partials; lane r writes bf16(SiTU) of row i0 + r."""
            for r in cutlass.range_constexpr(self.rw):
                hg = cute.arch.warp_reduction(acc[r][0], operator.add)
                hu = cute.arch.warp_reduction(acc[r][1], operator.add)
                if (lane == r) & (i0 + r < self.inter):
                    g = hg.to(BFloat16).to(Float32)  # the reference's einsums round to bf16
                    u = hu.to(BFloat16).to(Float32)
                    sig = 1.0 / (1.0 + cute.math.exp(-g, fastmath=True))
                    gate = beta * cute.math.tanh(g / beta, fastmath=False) * sig
                    lin = linear_beta * cute.math.tanh(u / linear_beta, fastmath=False)
                    mAct[pair, i0 + r] = (gate * lin).to(BFloat16)

        @cute.jit
        def __call__(self, mZ: cute.Tensor, mIdx: cute.Tensor, mW1: cute.Tensor,
                     mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mAct: cute.Tensor,
                     beta: Float32, linear_beta: Float32, stream):
            # mZ: (N, L) bf16; mIdx: ids (N, k); mW1, mW3: (E·I, L/8) int32 words of packed
            # nibbles; mS1, mS3: (E·I, L/32) uint8; mAct: (N·k, I) bf16
            kernel = self.kernel_async if const_expr(self.cp_async) else self.kernel
            kernel(mZ, mIdx, mW1, mS1, mW3, mS3, mAct, beta, linear_beta).launch(
                grid=[mZ.shape[0] * self.top_k, -(-self.inter // self.rows), 1],
                block=[self.threads, 1, 1], smem=fc1_smem(self.latent, self.cfg), stream=stream,
                use_pdl=self.pdl)

        def weight_frags(self):
            """Registers of a lane's weights: RW rows x (W1, W3) x M vectors (4, M) and their
            scales (M,), the split step's vector (4, 1) per row and its scales (RW,)."""
            M, RW = max(self.m, 1), self.rw
            rW = [[make_frag(Int32, M) for _ in range(2)] for _ in range(RW)]
            rS = [[cute.make_rmem_tensor(cute.make_layout((M,)), Uint32) for _ in range(2)]
                  for _ in range(RW)]
            rT = [make_frag(Int32, 1) for _ in range(RW)]
            return rW, rS, rT, cute.make_rmem_tensor(cute.make_layout((RW,)), Uint32)

        @cute.jit
        def load_weights(self, w, mW1, mS1, mW3, mS3, e: Int32, i0: Int32, lane: Int32):
            """Every weight load of a lane into `w` (`weight_frags`): RW rows x (W1, W3) x M
            vectors and the scales (a lane's columns past NV load zeros, their scale column is
            clamped), then the split step's vector and scale."""
            rW, rS, rT, rST = w
            I, NV, M = self.inter, self.nv, self.m
            for r in cutlass.range_constexpr(self.rw):
                row = e * I + cutlass.min(i0 + r, I - 1)
                for mat, (mW, mS) in enumerate(((mW1, mS1), (mW3, mS3))):
                    if const_expr(M):
                        load_vectors(row_vectors(mW, row), rW[r][mat], lane, 32, min(NV, 32 * M))
                    for mm in cutlass.range_constexpr(M):
                        col = lane + 32 * mm
                        if const_expr(32 * (mm + 1) > NV):
                            col = cutlass.min(col, NV - 1)
                        rS[r][mat][mm] = Uint32(mS[row, col])
                if const_expr(self.split):
                    col = 32 * M + lane % 16
                    if lane < 16:
                        cute.autovec_copy(row_vectors(mW1, row)[None, col], rT[r][None, 0])
                    else:
                        cute.autovec_copy(row_vectors(mW3, row)[None, col], rT[r][None, 0])
                    rST[r] = Uint32(cutlass.select_(lane < 16, Uint32(mS1[row, col]),
                                                    Uint32(mS3[row, col])))

        @cute.jit
        def dot_finish(self, w, sZ: cute.Tensor, lane: Int32, pair: Int32, i0: Int32,
                       mAct: cute.Tensor, beta: Float32, linear_beta: Float32):
            """One pair: the lane's dots of its weights `w` with the staged z (`stage_z`), per
            row and matrix in order mm = 0 .. M - 1 then the split step; then `finish`."""
            rW, rS, rT, rST = w
            NV, M = self.nv, self.m
            acc = [[Float32(0.0), Float32(0.0)] for _ in range(self.rw)]
            rZ = cute.make_rmem_tensor(cute.make_layout((32,)), Float32)  # one 32-input group
            for mm in cutlass.range_constexpr(M):
                c = lane + 32 * mm
                if const_expr(32 * (mm + 1) > NV):
                    c = cutlass.min(c, NV - 1)  # zero weights there: any finite z will do
                z = group_z(sZ, c, rZ)
                for r in cutlass.range_constexpr(self.rw):
                    for mat in cutlass.range_constexpr(2):
                        words = rW[r][mat][None, mm].load().bitcast(Uint32)
                        acc[r][mat] = acc[r][mat] + decode_dot(words, z) * group_factor(
                            rS[r][mat][mm])
            if const_expr(self.split):
                z = group_z(sZ, 32 * M + lane % 16, rZ)
                first = lane < 16
                for r in cutlass.range_constexpr(self.rw):
                    t = decode_dot(rT[r][None, 0].load().bitcast(Uint32), z) * group_factor(
                        rST[r])
                    acc[r][0] = acc[r][0] + Float32(cutlass.select_(first, t, Float32(0.0)))
                    acc[r][1] = acc[r][1] + Float32(cutlass.select_(first, Float32(0.0), t))
            self.finish(acc, lane, pair, i0, mAct, beta, linear_beta)

        @cute.kernel
        def kernel(self, mZ: cute.Tensor, mIds: cute.Tensor, mW1: cute.Tensor,
                   mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mAct: cute.Tensor,
                   beta: Float32, linear_beta: Float32):
            # with PDL (settings.KERNELS.pdl) no weight load can go first: the ids that pick the
            # experts are the route kernel's output
            pdl_wait(self.pdl)
            tidx, _, _ = cute.arch.thread_idx()
            pair, blk, _ = cute.arch.block_idx()
            lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
            n, j = pair // self.top_k, pair % self.top_k
            n_exp = mW1.shape[0] // self.inter
            e = cutlass.max(cutlass.min(Int32(mIds[n, j]), n_exp - 1), 0)
            i0 = blk * self.rows + warp * self.rw
            smem = cutlass.memory.SmemAllocator()
            sZ = smem.allocate_tensor(Float32, cute.make_layout((4, 8 * self.nv)), 16)  # chunks

            w = self.weight_frags()  # every weight load first
            self.load_weights(w, mW1, mS1, mW3, mS3, e, i0, lane)
            # z[n] -> shared fp32 times 2^Z_SHIFT; chunk q of group c at 8c + (q ^ (c & 7)).
            rZ8 = make_frag(BFloat16, -(-(self.latent // 8) // self.threads))  # (8, ZV)
            load_vectors(row_vectors(mZ, n), rZ8, tidx, self.threads, self.latent // 8)
            cute.arch.griddepcontrol_launch_dependents()
            self.stage_z(rZ8, sZ, tidx)
            self.dot_finish(w, sZ, lane, pair, i0, mAct, beta, linear_beta)

        @cute.kernel
        def kernel_async(self, mZ: cute.Tensor, mIds: cute.Tensor, mW1: cute.Tensor,
                         mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                         mAct: cute.Tensor, beta: Float32, linear_beta: Float32):
            """`kernel` with the weights streamed by cp.async: same math, same order."""
            pdl_wait(self.pdl)
            tidx, _, _ = cute.arch.thread_idx()
            pair, blk, _ = cute.arch.block_idx()
            lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
            I, NV, M, RW, S = self.inter, self.nv, self.m, self.rw, self.steps
            n, j = pair // self.top_k, pair % self.top_k
            # z first: it does not depend on the ids, and no math starts before it is staged
            rZ8 = make_frag(BFloat16, -(-(self.latent // 8) // self.threads))  # (8, ZV)
            load_vectors(row_vectors(mZ, n), rZ8, tidx, self.threads, self.latent // 8)
            n_exp = mW1.shape[0] // I
            e = cutlass.max(cutlass.min(Int32(mIds[n, j]), n_exp - 1), 0)
            i0 = blk * self.rows + warp * RW
            smem = cutlass.memory.SmemAllocator()
            sZ = smem.allocate_tensor(Float32, cute.make_layout((4, 8 * NV)), 16)  # chunks
            # slot (s·RW + r)·2 + mat of a lane: its vector of lane step s, row r, W1 or W3
            sW = smem.allocate_tensor(Int32, cute.make_layout(
                (4, 32, 2 * RW * S, self.warps), stride=(1, 4, 128, 256 * RW * S)), 16)
            rows = [e * I + cutlass.min(i0 + r, I - 1) for r in range(RW)]

            # The scales (byte loads) first, then one cp.async group per lane step s: the RW rows
            # x (W1, W3) vectors lane + 32s (a lane's columns past NV are zeros in shared memory,
            # their scale column clamped); the split step's vector in slot mat = 0.
            rS = [[cute.make_rmem_tensor(cute.make_layout((max(M, 1),)), Uint32)
                   for _ in range(2)] for _ in range(RW)]
            rST = cute.make_rmem_tensor(cute.make_layout((RW,)), Uint32)
            for r in cutlass.range_constexpr(RW):
                for mat, mS in enumerate((mS1, mS3)):
                    for mm in cutlass.range_constexpr(M):
                        rS[r][mat][mm] = Uint32(mS[rows[r], cutlass.min(lane + 32 * mm, NV - 1)])
                if const_expr(self.split):
                    col = 32 * M + lane % 16
                    rST[r] = Uint32(cutlass.select_(lane < 16, Uint32(mS1[rows[r], col]),
                                                    Uint32(mS3[rows[r], col])))
            # (ptxas would sink the z and scale loads below the copies: the warp barrier, a
            # memory fence, keeps them first, so that waiting for them waits for no weight)
            cute.arch.sync_warp()
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL), Int32,
                                       num_bits_per_copy=128)
            for mm in cutlass.range_constexpr(M):
                col = lane + 32 * mm
                for r in cutlass.range_constexpr(RW):
                    for mat, mW in enumerate((mW1, mW3)):
                        dst = sW[None, lane, (mm * RW + r) * 2 + mat, warp]
                        src = row_vectors(mW, rows[r])[None, col]
                        if const_expr(32 * (mm + 1) <= NV):
                            cute.copy(atom, src, dst)
                        else:
                            if col < NV:
                                cute.copy(atom, src, dst)
                            else:
                                dst.fill(0)
                cute.arch.cp_async_commit_group()
            if const_expr(self.split):
                col = 32 * M + lane % 16
                for r in cutlass.range_constexpr(RW):
                    dst = sW[None, lane, (M * RW + r) * 2, warp]
                    if lane < 16:
                        cute.copy(atom, row_vectors(mW1, rows[r])[None, col], dst)
                    else:
                        cute.copy(atom, row_vectors(mW3, rows[r])[None, col], dst)
                cute.arch.cp_async_commit_group()
            cute.arch.griddepcontrol_launch_dependents()
            self.stage_z(rZ8, sZ, tidx)

            # Step s waits only for its own group (S - 1 - s groups may still be in flight).
            acc = [[Float32(0.0), Float32(0.0)] for _ in range(RW)]
            rZ = cute.make_rmem_tensor(cute.make_layout((32,)), Float32)  # one 32-input group
            rW = [[make_frag(Int32, 1) for _ in range(2)] for _ in range(RW)]  # (4, 1)
            for mm in cutlass.range_constexpr(M):
                cute.arch.cp_async_wait_group(S - 1 - mm)
                z = group_z(sZ, cutlass.min(lane + 32 * mm, NV - 1), rZ)
                for r in cutlass.range_constexpr(RW):
                    for mat in cutlass.range_constexpr(2):
                        cute.autovec_copy(sW[None, lane, (mm * RW + r) * 2 + mat, warp],
                                          rW[r][mat][None, 0])
                        words = rW[r][mat][None, 0].load().bitcast(Uint32)
                        acc[r][mat] = acc[r][mat] + decode_dot(words, z) * group_factor(
                            rS[r][mat][mm])
            if const_expr(self.split):
                cute.arch.cp_async_wait_group(0)
                z = group_z(sZ, 32 * M + lane % 16, rZ)
                first = lane < 16
                for r in cutlass.range_constexpr(RW):
                    cute.autovec_copy(sW[None, lane, (M * RW + r) * 2, warp], rW[r][0][None, 0])
                    t = decode_dot(rW[r][0][None, 0].load().bitcast(Uint32), z) * group_factor(
                        rST[r])
                    acc[r][0] = acc[r][0] + Float32(cutlass.select_(first, t, Float32(0.0)))
                    acc[r][1] = acc[r][1] + Float32(cutlass.select_(first, Float32(0.0), t))
            self.finish(acc, lane, pair, i0, mAct, beta, linear_beta)

    class FC2:
        def __init__(self, latent: int, inter: int, top_k: int, cfg: FC2Config):
            self.latent, self.inter, self.top_k = latent, inter, top_k
            self.nvi = inter // 32  # packed vectors (and scales) per W2 row
            self.rows, self.threads = cfg.rows_per_cta, cfg.threads
            self.pitch = inter + 4  # act row pitch in smem (fp32): rows j, j+1 on other banks
            # W2 vectors (and scales) per chunk: the whole row for I <= 512, else two buffers of
            # `chunk` that take turns (loads of one in flight during the math of the other)
            self.chunk = _chunk_vectors(self.nvi)
            self.n_chunks = self.nvi // self.chunk

        def load_chunk(self, gW, mS2, row, rW, rS, first):
            """W2 row vectors first .. first + chunk - 1 and their scales -> rW (4, chunk), rS
            (chunk,); `first` may be a runtime value."""
            for c in range(self.chunk):
                cute.autovec_copy(gW[None, first + c], rW[None, c])
            for c in range(self.chunk):
                rS[c] = Uint32(mS2[row, first + c])

        def chunk_dot(self, acc, sRow, rZ, rW, rS, first):
            """acc + the chunk's 32-input partials times their factors, added in order c."""
            rZ4 = cute.zipped_divide(rZ, (4,))  # (4, 8)
            for c in range(self.chunk):
                for q in range(8):
                    cute.autovec_copy(sRow[None, 8 * (first + c) + q], rZ4[None, q])
                words = rW[None, c].load().bitcast(Uint32)
                acc = acc + decode_dot(words, rZ.load()) * group_factor(rS[c])
            return acc

        @cute.jit
        def __call__(self, mActRows: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor,
                     mW2: cute.Tensor, mS2: cute.Tensor, mY: cute.Tensor, stream):
            # mActRows: (N, k·I) bf16 (act, one row per token); mIds, mWt: (N, k);
            # mW2: (E·L, I/8) int32 words; mS2: (E·L, I/32) uint8; mY: (N, L) bf16
            smem = 4 * self.top_k * (self.pitch + self.rows) + 64
            self.kernel(mActRows, mIds, mWt, mW2, mS2, mY).launch(
                grid=[mY.shape[0], -(-self.latent // self.rows), 1],
                block=[self.threads, 1, 1], smem=smem, stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, mActRows: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor,
                   mW2: cute.Tensor, mS2: cute.Tensor, mY: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            n, blk, _ = cute.arch.block_idx()
            L, K, R, NVI = self.latent, self.top_k, self.rows, self.nvi
            smem = cutlass.memory.SmemAllocator()
            sAct = smem.allocate_tensor(Float32, cute.make_layout(
                (K, self.pitch), stride=(self.pitch, 1)), 16)
            sRed = smem.allocate_tensor(Float32, cute.make_layout((K, R), stride=(R, 1)), 16)

            # Thread (l, j): row l of W2[ids[n, j]]; its first chunk (the whole row for I <= 512)
            # loads before the wait. Threads past R·k (odd k) mirror the last one, write nothing.
            t = cutlass.min(tidx, R * K - 1)
            j, l = t // R, blk * R + t % R
            n_exp = mW2.shape[0] // L
            e = cutlass.max(cutlass.min(Int32(mIds[n, j]), n_exp - 1), 0)
            row = e * L + cutlass.min(l, L - 1)
            gW = row_vectors(mW2, row)  # (4, I/32)
            C, NC = self.chunk, self.n_chunks
            rW = [make_frag(Int32, C) for _ in range(min(NC, 2))]  # (4, C) each
            rS = [cute.make_rmem_tensor(cute.make_layout((C,)), Uint32) for _ in range(min(NC, 2))]
            self.load_chunk(gW, mS2, row, rW[0], rS[0], 0)
            wt = mWt[n, j]

            # act rows of token n (written by FC1) -> shared fp32 times 2^Z_SHIFT
            cute.arch.griddepcontrol_wait()
            per_row = self.inter // 8
            AV = -(-(K * per_row) // self.threads)
            rF = cute.make_rmem_tensor(cute.make_layout((8,)), Float32)
            rF4 = cute.zipped_divide(rF, (4,))  # (4, 2)
            for s0 in cutlass.range_constexpr(0, AV, STAGE_VECTORS):
                rA8 = make_frag(BFloat16, min(AV - s0, STAGE_VECTORS))  # (8, <= STAGE_VECTORS)
                load_vectors(row_vectors(mActRows, n), rA8, tidx, self.threads,
                             K * per_row - s0 * self.threads, s0 * self.threads)
                for s in cutlass.range_constexpr(s0, min(AV, s0 + STAGE_VECTORS)):
                    v = s * self.threads + tidx
                    if v < K * per_row:
                        ja, q = v // per_row, v % per_row
                        rF.store(rA8[None, s - s0].load().to(Float32) * Float32(2.0 ** Z_SHIFT))
                        sRow = cute.zipped_divide(sAct[ja, None], (4,))  # (4, pitch/4)
                        cute.autovec_copy(rF4[None, 0], sRow[None, 2 * q])
                        cute.autovec_copy(rF4[None, 1], sRow[None, 2 * q + 1])
            cute.arch.barrier()

            acc = Float32(0.0)  # one fp32 sum over c = 0 .. I/32 - 1 in order, whatever the chunks
            sRow = cute.zipped_divide(sAct[j, None], (4,))
            rZ = cute.make_rmem_tensor(cute.make_layout((32,)), Float32)
            if const_expr(NC > 1):
                # chunks 2p, 2p + 1 in buffers 0, 1; a loop kept rolled, its count hidden from
                # the compiler (mW2 has E·L >= 1 rows, so 1 - E·L <= 0), so that no later chunk's
                # loads (registers) are hoisted above an earlier chunk's math
                for p in cutlass.range(cutlass.max(Int32(NC // 2), 1 - mW2.shape[0]), unroll=1):
                    first = 2 * C * p
                    self.load_chunk(gW, mS2, row, rW[1], rS[1], first + C)
                    acc = self.chunk_dot(acc, sRow, rZ, rW[0], rS[0], first)
                    if first + 2 * C < NVI:
                        self.load_chunk(gW, mS2, row, rW[0], rS[0], first + 2 * C)
                    acc = self.chunk_dot(acc, sRow, rZ, rW[1], rS[1], first + C)
            if const_expr(NC % 2):  # the last chunk in buffer 0 (the whole row for I <= 512)
                acc = self.chunk_dot(acc, sRow, rZ, rW[0], rS[0], (NC - 1) * C)
            y = acc.to(BFloat16).to(Float32)  # the reference's FC2 einsum rounds to bf16
            if tidx < R * K:
                sRed[j, t % R] = wt * y
            cute.arch.barrier()
            if (tidx < R) & (blk * R + tidx < L):
                total = sRed[0, tidx]
                for jj in cutlass.range_constexpr(1, K):
                    total = total + sRed[jj, tidx]
                mY[n, blk * R + tidx] = total.to(BFloat16)

    return FC1, FC2


def prepare(latent: int, inter: int, top_k: int, buckets=(1, 2, 4, 8, 16, 32, 64),
            ids_dtype=torch.int64) -> None:
    """Compile both stages for every batch bucket (call before graph capture)."""
    for b in buckets:
        for stage in ("fc1", "fc2"):
            KERNEL.compiled(stage, latent, inter, top_k, ids_dtype == torch.int64,
                            config(stage, latent, inter, top_k, b), rows=b,
                            pdl=None if stage == "fc1" else False)


def build(stage, latent, inter, top_k, ids64, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile one stage now, uncached (`dump_dir` keeps the cubin; `pdl`: FC1 launched with
    PDL after the previous kernel)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    bf16, i32, u8 = cutlass.BFloat16, cutlass.Int32, cutlass.Uint8
    n, pairs, rows = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def dense(dtype, n_rows, width, align, row_stride=None):
        stride = (width if row_stride is None else row_stride, 1)
        return make_fake_tensor(dtype, (n_rows, width), stride=stride, assumed_align=align)

    ids = dense(cutlass.Int64 if ids64 else i32, n, top_k, 8 if ids64 else 4, cute.sym_int())
    FC1, FC2 = _kernels()
    if stage == "fc1":  # act as (N·k, I) rows
        w, s = dense(i32, rows, latent // 8, 16), dense(u8, rows, latent // 32, 1)
        return compile_kernel(FC1(latent, inter, top_k, cfg, pdl), fake_rows(bf16, n, latent), ids,
                              w, s, w, s, dense(bf16, pairs, inter, 16), cutlass.Float32(4.0),
                              cutlass.Float32(25.0), fake_stream(), arch=arch, dump_dir=dump_dir)
    return compile_kernel(FC2(latent, inter, top_k, cfg), dense(bf16, n, top_k * inter, 16),
                          ids, dense(cutlass.Float32, n, top_k, 4, cute.sym_int()),
                          dense(i32, rows, inter // 8, 16), dense(u8, rows, inter // 32, 1),
                          fake_rows(bf16, n, latent), fake_stream(), arch=arch,
                          dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def _words(packed: torch.Tensor) -> torch.Tensor:
    """[E, O, W] uint8 -> [E·O, W/4] int32 (a view)."""
    return packed.view(torch.int32).view(-1, packed.shape[-1] // 4)


def moe_experts_cuda(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                     w2_scale, beta, linear_beta, *, out=None):
    """k3::moe_experts with the two kernels, or the reference (reason logged) when they refuse
    the inputs. `out` [N, L] bf16 (last dim contiguous) is written only when the kernels run."""
    args = (z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)

    def call_refusal():
        if reason := moe_experts_refusal(*args) or refusal(*args) or (None if all(t.is_cuda for t in args)
                                        else "not on a CUDA device"):
            return reason
        if out is not None and (
                out.dtype != torch.bfloat16 or out.shape != z.shape or out.stride(-1) != 1
                or out.stride(0) % 8 or not aligned16(out)):
            return f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
        return None

    return KERNEL.run(call_refusal, lambda: moe_experts_ref(*args, beta, linear_beta),
                      lambda: _launch(args, beta, linear_beta, out),
                      z, w1_packed, w3_packed, w2_packed)


def _launch(args, beta, linear_beta, out):
    z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale = args
    (n, latent), top_k, inter = z.shape, ids.shape[-1], w1_packed.shape[1]
    y = z.new_empty((n, latent)) if out is None else out
    if n:
        b, ids64 = bucket(n), ids.dtype == torch.int64
        act = z.new_empty((n * top_k, inter))
        fc1 = config("fc1", latent, inter, top_k, b)
        KERNEL.compiled("fc1", latent, inter, top_k, ids64, fc1, rows=b)(
            z, ids, _words(w1_packed), w1_scale.view(-1, latent // 32), _words(w3_packed),
            w3_scale.view(-1, latent // 32), act, float(beta), float(linear_beta))
        # FC2 always follows FC1 with PDL (its own build has no switch)
        KERNEL.compiled("fc2", latent, inter, top_k, ids64,
                        config("fc2", latent, inter, top_k, b), pdl=False)(
            act.view(n, top_k * inter), ids, weights, _words(w2_packed),
            w2_scale.view(-1, inter // 32), y)
    return y


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", moe_experts_cuda)
