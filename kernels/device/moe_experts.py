"""`FC1` and `FC2`, the CuTe DSL kernels of kernels/moe_experts.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import operator

import cutlass
from cutlass import BFloat16, Float16, Float32, Int32, Uint32, const_expr, cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from ..common.copy import load_vectors, make_frag, row_vectors
from ..common.dsl import pdl_wait
from ..moe_experts import (
    F16_C_RANGE,
    F16_MAG_MASK,
    F16_MAG_SHIFT,
    F16_SCALE_BIAS,
    F16_Z_TOP,
    MAG_MASK,
    PAIR_SHIFT,
    SCALE_BIAS,
    SIGN_MASK,
    STAGE_VECTORS,
    Z_SHIFT,
    FC1Config,
    FC2Config,
    _chunk_vectors,
    _lane_steps,
    fc1_fits,
    fc1_smem,
    fc2_smem,
)
from .last_cta import wait_count


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

@dsl_user_op
def fma_f16x2(a, b, c, *, loc=None, ip=None) -> Uint32:
    """a·b + c on two fp16 lanes in one instruction (fma.rn.f16x2, subnormals kept)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c)],
        "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def f16x2_sum(a, *, loc=None, ip=None) -> Float32:
    """The two fp16 lanes of a, widened to fp32 and added."""
    lanes = [Float32(llvm.inline_asm(
        T.f32(), [Uint32(a).ir_value(loc=loc, ip=ip)],
        f"{{.reg .f16 l, h; mov.b32 {{l, h}}, $1; cvt.f32.f16 $0, {half};}}", "=f,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)) for half in ("l", "h")]
    return lanes[0] + lanes[1]


def decode_dot_f16x2(words, z2):
    """The packed decode (K3_MOE_F16): words (4,) Uint32 as `decode_dot`, each pair view in
    fp16 bits (sign at 15, e1 e0 m at 11..9: E2M1 times 2^-14, 0.5 a subnormal), one
    fma.rn.f16x2 per pair into two fp16 lanes, widened once. z2 (16,) Uint32: z as fp16x2
    pairs (inputs 8w + i, 8w + i + 4) at 4w + i, times 2^c. The result is the partial times
    2^(c - 14)."""
    acc = Uint32(0)
    for w in range(4):
        q = words[w]
        for i in range(4):
            t = q << PAIR_SHIFT[i] if PAIR_SHIFT[i] else q
            bits = (t & Uint32(SIGN_MASK)) | ((t >> F16_MAG_SHIFT) & Uint32(F16_MAG_MASK))
            acc = fma_f16x2(bits, z2[4 * w + i], acc)
    return f16x2_sum(acc)


def pairs_i_i4(x):
    """(4,) Uint32 of 16-bit values 0..7 in order (two per word, low half first) -> the pairs
    (i, i + 4), i = 0..3, low half i: the pair views' order (`decode_pair`)."""
    return ((x[0] & Uint32(0xFFFF)) | (x[2] << Uint32(16)),
            (x[0] >> Uint32(16)) | (x[2] & Uint32(0xFFFF0000)),
            (x[1] & Uint32(0xFFFF)) | (x[3] << Uint32(16)),
            (x[1] >> Uint32(16)) | (x[3] & Uint32(0xFFFF0000)))


def group_z(sZ, c, rZ):
    """32-input group c of the staged z (chunk q at 8c + (q ^ (c & 7))) -> (32,) fp32."""
    rZ4 = cute.zipped_divide(rZ, (4,))  # (4, 8)
    for q in range(8):
        cute.autovec_copy(sZ[None, 8 * c + (q ^ (c % 8))], rZ4[None, q])
    return rZ.load()


def group_z2(sZ2, c, rZ2):
    """Group c of z staged as fp16 pairs (`FC1.stage_z2`: word w's chunk at
    4c + (w ^ ((c >> 1) & 3)); 8 lanes of consecutive c hit 8 distinct 16-byte bank slots)
    -> (16,) Uint32."""
    rZ4 = cute.zipped_divide(rZ2, (4,))  # (4, 4)
    for w in range(4):
        cute.autovec_copy(sZ2[None, 4 * c + (w ^ ((c // 2) % 4))], rZ4[None, w])
    return rZ2.load()


def abs_top(words, top):
    """max(top, the largest |x| as bits of the 8 bf16 in words (4,) Uint32): a NaN or inf
    ranks above every finite value."""
    hi, lo = Uint32(0), Uint32(0)
    for k in range(4):
        hi = cutlass.max(hi, words[k] & Uint32(0x7FFF0000))
        lo = cutlass.max(lo, words[k] & Uint32(0x7FFF))
    return cutlass.max(top, cutlass.max(hi >> Uint32(16), lo))


def f16_exponent(top):
    """c of the fp16 staging from the largest |x| as bf16 bits (`abs_top`): F16_Z_TOP - its
    exponent field, clamped to F16_C_RANGE (a NaN or inf gives the least: finite values then
    stage as 0, the NaN or inf as itself)."""
    return cutlass.min(cutlass.max(Int32(F16_Z_TOP) - Int32(top >> Uint32(7)),
                                   Int32(F16_C_RANGE[0])), Int32(F16_C_RANGE[1]))


def pow2(e):
    """2^e as fp32 from its exponent field (e a normal exponent, Int32)."""
    return (Uint32(e + 127) << Uint32(23)).bitcast(Float32)


def f16_pairs(x, up, rH, rP):
    """8 bf16 x (TensorSSA) times `up`, rounded to fp16 (rH (8,) scratch), -> rP (4,) Uint32
    as the pairs (i, i + 4) of `pairs_i_i4`."""
    rH.store((x.to(Float32) * up).to(Float16))
    pairs = pairs_i_i4(rH.load().bitcast(Uint32))
    for k in range(4):
        rP[k] = pairs[k]


def group_factor(scale, bias=SCALE_BIAS):
    """2^(scale − 127 + 126 − Z_SHIFT) from an E8M0 byte (as Uint32); with `bias`
    F16_SCALE_BIAS, 2^(scale - 126)."""
    return ((scale + Uint32(bias)) << Uint32(23)).bitcast(Float32)

class FC1:
    def __init__(self, latent: int, inter: int, top_k: int, cfg: FC1Config,
                 pdl: bool = False, expert_rows: int = 0):
        self.latent, self.inter, self.top_k, self.pdl = latent, inter, top_k, pdl
        # rows of mW1 / mS1 / mW3 / mS3 from one expert's first row to the next's: I, or 2I
        # where W1 and W3 are the halves of one fused gate_up [E, 2I, L/2] (the words then
        # start at each half's first row, `expert_words` of kernels/moe_experts.py)
        self.expert_rows = expert_rows or inter
        self.nv = latent // 32  # packed vectors (and scales) per weight row
        # Lane steps over both matrices; with NV % 32 == 16 (L = 3584: 112 vectors) a last
        # step gives lanes 0-15 the W1 tail and lanes 16-31 the W3 tail (no idle lanes).
        self.m, self.split = _lane_steps(latent)
        self.cfg, self.rw, self.warps, self.threads = cfg, cfg.rows_per_warp, cfg.warps, \
            cfg.threads
        self.rows = cfg.warps * cfg.rows_per_warp
        self.cp_async, self.f16 = cfg.cp_async, cfg.f16
        self.steps = self.m + self.split  # cp.async groups per lane
        if not fc1_fits(latent, cfg):
            raise ValueError(f"{cfg} at L {latent}: {fc1_smem(latent, cfg)} B of shared memory")

    def experts(self, mW: cute.Tensor):
        """E from the rows of W1's words: (E - 1)·expert_rows + I."""
        return (mW.shape[0] + (self.expert_rows - self.inter)) // self.expert_rows

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
    def stage_z2(self, rZ8: cute.Tensor, sZ2: cute.Tensor, sMax: cute.Tensor,
                 tidx: Int32) -> Float32:
        """`f16`: rZ8 (8, ZV) bf16 z vectors of this thread (zeros past L) -> sZ2 as fp16
        pairs (`pairs_i_i4`) times 2^c, c = F16_Z_TOP - the exponent field of the row's max |z|
        (bits: a NaN or inf gives c's least, and stays NaN or inf), clamped to F16_C_RANGE;
        word w of group g at chunk 4g + (w ^ ((g >> 1) & 3)). Two CTA barriers (the max, the
        staging). Returns 2^(13 - c), the warp sums' factor."""
        ZV = cute.size(rZ8, mode=[1])
        top = Uint32(0)
        for s in cutlass.range_constexpr(ZV):
            top = abs_top(rZ8[None, s].load().bitcast(Uint32), top)
        top = cute.arch.warp_reduction(top, lambda a, b: cutlass.max(a, b))
        warp = cute.arch.warp_idx()  # a full-warp shuffle here: every lane must run it
        if cute.arch.lane_idx() == 0:
            sMax[warp] = top
        cute.arch.barrier()
        for w in cutlass.range_constexpr(self.warps):
            top = cutlass.max(top, sMax[w])
        c = f16_exponent(top)
        up = pow2(c)
        rH = cute.make_rmem_tensor(cute.make_layout((8,)), Float16)
        rP = cute.make_rmem_tensor(cute.make_layout((4,)), Uint32)
        for s in cutlass.range_constexpr(ZV):
            v = s * self.threads + tidx
            if v < self.latent // 8:
                f16_pairs(rZ8[None, s].load(), up, rH, rP)
                g, w = v // 4, v % 4
                cute.autovec_copy(rP, sZ2[None, 4 * g + (w ^ ((g // 2) % 4))])
        cute.arch.barrier()
        return pow2(13 - c)

    def alloc_z(self, smem):
        """The staged z in shared memory: (4, 8·NV) fp32 chunks, or with `f16` (4, 4·NV)
        Uint32 chunks of fp16 pairs and the warps' maxima (warps,)."""
        if const_expr(self.f16):
            return (smem.allocate_tensor(Uint32, cute.make_layout((4, 4 * self.nv)), 16),
                    smem.allocate_tensor(Uint32, cute.make_layout((self.warps,)), 4))
        return smem.allocate_tensor(Float32, cute.make_layout((4, 8 * self.nv)), 16), None

    def stage(self, rZ8, sZ, sMax, tidx):
        """Stage z (`stage_z` or `stage_z2`); the warp sums' factor (None: 1)."""
        if const_expr(self.f16):
            return self.stage_z2(rZ8, sZ, sMax, tidx)
        self.stage_z(rZ8, sZ, tidx)
        return None

    def z_regs(self):
        """Registers of one staged 32-input group: (32,) fp32, or (16,) fp16 pairs."""
        if const_expr(self.f16):
            return cute.make_rmem_tensor(cute.make_layout((16,)), Uint32)
        return cute.make_rmem_tensor(cute.make_layout((32,)), Float32)

    def group(self, sZ, c, rZ):
        return group_z2(sZ, c, rZ) if const_expr(self.f16) else group_z(sZ, c, rZ)

    def dot(self, words, z, scale):
        """One 32-input group's partial times its factor (times 2^(c - 13) with `f16`)."""
        if const_expr(self.f16):
            return decode_dot_f16x2(words, z) * group_factor(scale, F16_SCALE_BIAS)
        return decode_dot(words, z) * group_factor(scale)

    @cute.jit
    def finish(self, acc, lane, pair, i0, mAct, beta, linear_beta, down):
        """Warp sums of the RW (W1, W3) partials (times `down` unless None); lane r writes
        bf16(SiTU) of row i0 + r."""
        for r in cutlass.range_constexpr(self.rw):
            hg = cute.arch.warp_reduction(acc[r][0], operator.add)
            hu = cute.arch.warp_reduction(acc[r][1], operator.add)
            if const_expr(down is not None):
                hg, hu = hg * down, hu * down
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
        # mZ: (N, L) bf16; mIdx: ids (N, k); mW1, mW3: ((E - 1)·expert_rows + I, L/8) int32
        # words of packed nibbles; mS1, mS3: (the same rows, L/32) uint8; mAct: (N·k, I) bf16
        self.kernel(mZ, mIdx, mW1, mS1, mW3, mS3, mAct, beta, linear_beta).launch(
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
            row = e * self.expert_rows + cutlass.min(i0 + r, I - 1)
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
                   mAct: cute.Tensor, beta: Float32, linear_beta: Float32, down):
        """One pair: the lane's dots of its weights `w` with the staged z (`stage_z`), per
        row and matrix in order mm = 0 .. M - 1 then the split step; then `finish`."""
        rW, rS, rT, rST = w
        NV, M = self.nv, self.m
        acc = [[Float32(0.0), Float32(0.0)] for _ in range(self.rw)]
        rZ = self.z_regs()  # one 32-input group
        for mm in cutlass.range_constexpr(M):
            c = lane + 32 * mm
            if const_expr(32 * (mm + 1) > NV):
                c = cutlass.min(c, NV - 1)  # zero weights there: any finite z will do
            z = self.group(sZ, c, rZ)
            for r in cutlass.range_constexpr(self.rw):
                for mat in cutlass.range_constexpr(2):
                    words = rW[r][mat][None, mm].load().bitcast(Uint32)
                    acc[r][mat] = acc[r][mat] + self.dot(words, z, rS[r][mat][mm])
        if const_expr(self.split):
            z = self.group(sZ, 32 * M + lane % 16, rZ)
            first = lane < 16
            for r in cutlass.range_constexpr(self.rw):
                t = self.dot(rT[r][None, 0].load().bitcast(Uint32), z, rST[r])
                acc[r][0] = acc[r][0] + Float32(cutlass.select_(first, t, Float32(0.0)))
                acc[r][1] = acc[r][1] + Float32(cutlass.select_(first, Float32(0.0), t))
        self.finish(acc, lane, pair, i0, mAct, beta, linear_beta, down)

    @cute.kernel
    def kernel(self, mZ: cute.Tensor, mIds: cute.Tensor, mW1: cute.Tensor,
               mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mAct: cute.Tensor,
               beta: Float32, linear_beta: Float32):
        # with PDL (settings.KERNELS.pdl) no weight load can go first: the ids that pick the
        # experts are the route kernel's output
        pdl_wait(self.pdl)
        pair, blk, _ = cute.arch.block_idx()
        body = self.body_async if const_expr(self.cp_async) else self.body
        body(pair, blk, mZ, mIds, mW1, mS1, mW3, mS3, mAct, beta, linear_beta)

    @cute.jit
    def body(self, pair: Int32, blk: Int32, mZ: cute.Tensor, mIds: cute.Tensor,
             mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
             mAct: cute.Tensor, beta: Float32, linear_beta: Float32):
        """Pair `pair` (n·k + j), row block `blk`: every weight load, then z, then the math."""
        tidx, _, _ = cute.arch.thread_idx()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        n, j = pair // self.top_k, pair % self.top_k
        n_exp = self.experts(mW1)
        e = cutlass.max(cutlass.min(Int32(mIds[n, j]), n_exp - 1), 0)
        i0 = blk * self.rows + warp * self.rw
        smem = cutlass.memory.SmemAllocator()
        sZ, sMax = self.alloc_z(smem)  # chunks

        w = self.weight_frags()  # every weight load first
        self.load_weights(w, mW1, mS1, mW3, mS3, e, i0, lane)
        # z[n] -> shared fp32 times 2^Z_SHIFT; chunk q of group c at 8c + (q ^ (c & 7)).
        rZ8 = make_frag(BFloat16, -(-(self.latent // 8) // self.threads))  # (8, ZV)
        load_vectors(row_vectors(mZ, n), rZ8, tidx, self.threads, self.latent // 8)
        cute.arch.griddepcontrol_launch_dependents()
        down = self.stage(rZ8, sZ, sMax, tidx)
        self.dot_finish(w, sZ, lane, pair, i0, mAct, beta, linear_beta, down)

    @cute.jit
    def body_async(self, pair: Int32, blk: Int32, mZ: cute.Tensor, mIds: cute.Tensor,
                   mW1: cute.Tensor, mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor,
                   mAct: cute.Tensor, beta: Float32, linear_beta: Float32):
        """`body` with the weights streamed by cp.async: same math, same order."""
        tidx, _, _ = cute.arch.thread_idx()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        I, NV, M, RW, S = self.inter, self.nv, self.m, self.rw, self.steps
        n, j = pair // self.top_k, pair % self.top_k
        # z first: it does not depend on the ids, and no math starts before it is staged
        rZ8 = make_frag(BFloat16, -(-(self.latent // 8) // self.threads))  # (8, ZV)
        load_vectors(row_vectors(mZ, n), rZ8, tidx, self.threads, self.latent // 8)
        n_exp = self.experts(mW1)
        e = cutlass.max(cutlass.min(Int32(mIds[n, j]), n_exp - 1), 0)
        i0 = blk * self.rows + warp * RW
        smem = cutlass.memory.SmemAllocator()
        sZ, sMax = self.alloc_z(smem)  # chunks
        # slot (s·RW + r)·2 + mat of a lane: its vector of lane step s, row r, W1 or W3
        sW = smem.allocate_tensor(Int32, cute.make_layout(
            (4, 32, 2 * RW * S, self.warps), stride=(1, 4, 128, 256 * RW * S)), 16)
        rows = [e * self.expert_rows + cutlass.min(i0 + r, I - 1) for r in range(RW)]

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
        down = self.stage(rZ8, sZ, sMax, tidx)

        # Step s waits only for its own group (S - 1 - s groups may still be in flight).
        acc = [[Float32(0.0), Float32(0.0)] for _ in range(RW)]
        rZ = self.z_regs()  # one 32-input group
        rW = [[make_frag(Int32, 1) for _ in range(2)] for _ in range(RW)]  # (4, 1)
        for mm in cutlass.range_constexpr(M):
            cute.arch.cp_async_wait_group(S - 1 - mm)
            z = self.group(sZ, cutlass.min(lane + 32 * mm, NV - 1), rZ)
            for r in cutlass.range_constexpr(RW):
                for mat in cutlass.range_constexpr(2):
                    cute.autovec_copy(sW[None, lane, (mm * RW + r) * 2 + mat, warp],
                                      rW[r][mat][None, 0])
                    words = rW[r][mat][None, 0].load().bitcast(Uint32)
                    acc[r][mat] = acc[r][mat] + self.dot(words, z, rS[r][mat][mm])
        if const_expr(self.split):
            cute.arch.cp_async_wait_group(0)
            z = self.group(sZ, 32 * M + lane % 16, rZ)
            first = lane < 16
            for r in cutlass.range_constexpr(RW):
                cute.autovec_copy(sW[None, lane, (M * RW + r) * 2, warp], rW[r][0][None, 0])
                t = self.dot(rW[r][0][None, 0].load().bitcast(Uint32), z, rST[r])
                acc[r][0] = acc[r][0] + Float32(cutlass.select_(first, t, Float32(0.0)))
                acc[r][1] = acc[r][1] + Float32(cutlass.select_(first, Float32(0.0), t))
        self.finish(acc, lane, pair, i0, mAct, beta, linear_beta, down)

class FC2:
    def __init__(self, latent: int, inter: int, top_k: int, cfg: FC2Config):
        self.latent, self.inter, self.top_k = latent, inter, top_k
        self.nvi = inter // 32  # packed vectors (and scales) per W2 row
        self.cfg, self.rows, self.threads, self.f16 = cfg, cfg.rows_per_cta, cfg.threads, cfg.f16
        # act row pitch in smem, 4-byte words of fp32 (`f16`: of fp16 pairs): rows j, j + 1
        # 16 bytes apart in the banks
        self.pitch = (inter // 2 if cfg.f16 else inter) + 4
        # W2 vectors (and scales) per chunk: the whole row for I <= 512, else two buffers of
        # `chunk` that take turns (loads of one in flight during the math of the other)
        self.chunk = _chunk_vectors(self.nvi)
        self.n_chunks = self.nvi // self.chunk
        if cfg.f16 and self.n_chunks > 1:
            raise ValueError(f"{cfg} at I {inter}: the fp16 FC2 takes I <= 512")
        # `split` 2: a thread's chunk is half the row
        self.split = cfg.split
        if self.split not in (1, 2) or self.split == 2 and (self.n_chunks > 1 or self.nvi % 2):
            raise ValueError(f"{cfg} at I {inter}: split 2 takes I <= 512, I/32 even")
        self.chunk //= self.split

    def load_chunk(self, gW, mS2, row, rW, rS, first):
        """W2 row vectors first .. first + chunk - 1 and their scales -> rW (4, chunk), rS
        (chunk,); `first` may be a runtime value."""
        for c in range(self.chunk):
            cute.autovec_copy(gW[None, first + c], rW[None, c])
        for c in range(self.chunk):
            rS[c] = Uint32(mS2[row, first + c])

    def group_parts(self, sRow, rZ, rW, rS, first, c):
        """Group first + c of the row: its 32-input partial and its factor (`f16`: times
        2^(c_j - 13))."""
        q_n = 4 if self.f16 else 8  # 16-byte chunks of staged act per group
        rZ4 = cute.zipped_divide(rZ, (4,))  # (4, q_n)
        for q in range(q_n):
            cute.autovec_copy(sRow[None, q_n * (first + c) + q], rZ4[None, q])
        words = rW[None, c].load().bitcast(Uint32)
        if const_expr(self.f16):
            return decode_dot_f16x2(words, rZ.load()), group_factor(rS[c], F16_SCALE_BIAS)
        return decode_dot(words, rZ.load()), group_factor(rS[c])

    def chunk_dot(self, acc, sRow, rZ, rW, rS, first):
        """acc + the chunk's partials times their factors, added in order c."""
        for c in range(self.chunk):
            p, f = self.group_parts(sRow, rZ, rW, rS, first, c)
            acc = acc + p * f
        return acc

    def split_dot(self, sRow, rZ, rW, rS, first):
        """`split` 2: this lane's half of the row (groups first ..), then in the first lane of
        the pair the second's partials and factors (a shuffle) added after its own: the sum of
        `chunk_dot` over the whole row, term for term."""
        parts = [self.group_parts(sRow, rZ, rW, rS, first, c) for c in range(self.chunk)]
        acc = Float32(0.0)
        for p, f in parts:
            acc = acc + p * f
        for p, f in parts:
            acc = acc + cute.arch.shuffle_sync_bfly(p, 1) * cute.arch.shuffle_sync_bfly(f, 1)
        return acc

    @cute.jit
    def stage_act(self, mActRows: cute.Tensor, sAct: cute.Tensor, n: Int32, tidx: Int32):
        """act rows of token n (written by FC1) -> sAct fp32 times 2^Z_SHIFT, STAGE_VECTORS
        vectors per thread in flight at a time; then the CTA barrier."""
        K, per_row = self.top_k, self.inter // 8
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

    @cute.jit
    def stage_act_f16(self, mActRows: cute.Tensor, sAct: cute.Tensor, sMax: cute.Tensor,
                      n: Int32, tidx: Int32, j: Int32) -> Float32:
        """`f16` (I <= 512: every act vector of a thread in registers at once): act row (n, j')
        -> sAct as fp16 pairs times 2^c_j' (`f16_exponent` of its max |act|, an atomic max
        per row in sMax, zeroed before), vector q of a row at chunk q; three CTA barriers.
        Returns 2^(13 - c_j), the factor of thread row j's sum."""
        K, per_row = self.top_k, self.inter // 8
        AV = -(-(K * per_row) // self.threads)
        rA8 = make_frag(BFloat16, AV)  # (8, AV)
        load_vectors(row_vectors(mActRows, n), rA8, tidx, self.threads, K * per_row)
        cute.arch.barrier()  # sMax zeroed
        for s in cutlass.range_constexpr(AV):
            v = s * self.threads + tidx
            if v < K * per_row:
                top = abs_top(rA8[None, s].load().bitcast(Uint32), Uint32(0))
                cute.arch.atomic_max(sMax.iterator + v // per_row, Int32(top))
        cute.arch.barrier()
        rH = cute.make_rmem_tensor(cute.make_layout((8,)), Float16)
        rP = cute.make_rmem_tensor(cute.make_layout((4,)), Uint32)
        for s in cutlass.range_constexpr(AV):
            v = s * self.threads + tidx
            if v < K * per_row:
                ja, q = v // per_row, v % per_row
                f16_pairs(rA8[None, s].load(), pow2(f16_exponent(Uint32(sMax[ja]))), rH, rP)
                cute.autovec_copy(rP, cute.zipped_divide(sAct[ja, None], (4,))[None, q])
        cute.arch.barrier()
        return pow2(13 - f16_exponent(Uint32(sMax[j])))

    @cute.jit
    def __call__(self, mActRows: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor,
                 mW2: cute.Tensor, mS2: cute.Tensor, mY: cute.Tensor, stream):
        # mActRows: (N, k·I) bf16 (act, one row per token); mIds, mWt: (N, k);
        # mW2: (E·L, I/8) int32 words; mS2: (E·L, I/32) uint8; mY: (N, L) bf16 or fp32
        self.kernel(mActRows, mIds, mWt, mW2, mS2, mY).launch(
            grid=[mY.shape[0], -(-self.latent // self.rows), 1],
            block=[self.threads, 1, 1], smem=fc2_smem(self.inter, self.top_k, self.cfg),
            stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mActRows: cute.Tensor, mIds: cute.Tensor, mWt: cute.Tensor,
               mW2: cute.Tensor, mS2: cute.Tensor, mY: cute.Tensor):
        n, blk, _ = cute.arch.block_idx()
        self.body(n, blk, mActRows, mIds, mWt, mW2, mS2, mY, None, 0)

    @cute.jit
    def wait_act(self, mDone, target):
        """Until token n's act is written: the PDL wait for FC1's grid, or (one launch,
        kernels/device/moe_one_launch.py) token n's count of finished FC1 CTAs."""
        if const_expr(mDone is None):
            cute.arch.griddepcontrol_wait()
        else:
            wait_count(mDone, target)

    @cute.jit
    def body(self, n: Int32, blk: Int32, mActRows: cute.Tensor, mIds: cute.Tensor,
             mWt: cute.Tensor, mW2: cute.Tensor, mS2: cute.Tensor, mY: cute.Tensor, mDone,
             target):
        """Token n, output rows blk·R ..: the first W2 chunk, `wait_act` (mDone, target), act
        staged, the dots, the weighted sum over k."""
        tidx, _, _ = cute.arch.thread_idx()
        L, K, R, NVI = self.latent, self.top_k, self.rows, self.nvi
        smem = cutlass.memory.SmemAllocator()
        sAct = smem.allocate_tensor(Uint32 if const_expr(self.f16) else Float32,
                                    cute.make_layout((K, self.pitch), stride=(self.pitch, 1)), 16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout((K, R), stride=(R, 1)), 16)

        # Thread (l, j): row l of W2[ids[n, j]]; its first chunk (the whole row for I <= 512,
        # `split` 2: half of it, lane h = t % 2 the half h) loads before the wait. Threads past
        # R·k·S (odd k) mirror the last one, write nothing.
        S = self.split
        t = cutlass.min(tidx, R * K * S - 1)
        u, h = t // S, t % S
        j, l = u // R, blk * R + u % R
        n_exp = mW2.shape[0] // L
        e = cutlass.max(cutlass.min(Int32(mIds[n, j]), n_exp - 1), 0)
        row = e * L + cutlass.min(l, L - 1)
        gW = row_vectors(mW2, row)  # (4, I/32)
        C, NC = self.chunk, self.n_chunks
        rW = [make_frag(Int32, C) for _ in range(min(NC, 2))]  # (4, C) each
        rS = [cute.make_rmem_tensor(cute.make_layout((C,)), Uint32) for _ in range(min(NC, 2))]
        self.load_chunk(gW, mS2, row, rW[0], rS[0], h * C)
        wt = mWt[n, j]

        # act rows of token n (written by FC1) -> shared memory
        down = None
        if const_expr(self.f16):
            sMax = smem.allocate_tensor(Int32, cute.make_layout((K,)), 4)
            if tidx < K:
                sMax[tidx] = Int32(0)
            self.wait_act(mDone, target)
            down = self.stage_act_f16(mActRows, sAct, sMax, n, tidx, j)
        else:
            self.wait_act(mDone, target)
            self.stage_act(mActRows, sAct, n, tidx)

        acc = Float32(0.0)  # one fp32 sum over c = 0 .. I/32 - 1 in order, whatever the chunks
        sRow = cute.zipped_divide(sAct[j, None], (4,))
        rZ = cute.make_rmem_tensor(cute.make_layout((16 if self.f16 else 32,)),
                                   Uint32 if const_expr(self.f16) else Float32)
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
        if const_expr(S > 1):
            acc = self.split_dot(sRow, rZ, rW[0], rS[0], h * C)
        elif const_expr(NC % 2):  # the last chunk in buffer 0 (the whole row for I <= 512)
            acc = self.chunk_dot(acc, sRow, rZ, rW[0], rS[0], (NC - 1) * C)
        if const_expr(self.f16):
            acc = acc * down
        y = acc.to(BFloat16).to(Float32)  # the reference's FC2 einsum rounds to bf16
        if (tidx < R * K * S) & (h == 0):
            sRed[j, u % R] = wt * y
        cute.arch.barrier()
        if (tidx < R) & (blk * R + tidx < L):
            total = sRed[0, tidx]
            for jj in cutlass.range_constexpr(1, K):
                total = total + sRed[jj, tidx]
            mY[n, blk * R + tidx] = total.to(mY.element_type)  # bf16, or fp32 (`out_fp32`)
