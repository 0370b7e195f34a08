"""`FC1ByExpert`, FC1 + SiTU of kernels/moe_experts.py by expert on CUDA cores (K3_MOE_BY_EXPERT,
with the packed fp16 decode): each weight word decoded once for every token routed to its
expert, every act[p] bit for bit the per-pair fp16 kernel's (`FC1` with `FC1Config.f16`).

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import BFloat16, Float32, Int32, Uint32, const_expr, cute

from ..common.copy import load_vectors, make_frag, row_vectors
from ..common.dsl import pdl_wait
from ..moe_experts import (
    F16_MAG_MASK,
    F16_MAG_SHIFT,
    F16_SCALE_BIAS,
    PAIR_SHIFT,
    SIGN_MASK,
    FC1Config,
    by_expert_smem,
    pair_capacity,
)
from .moe_experts import FC1, f16x2_sum, fma_f16x2, group_factor
from .moe_experts_grouped import GroupedMMA


def decode_dots_f16x2(words, z2s):
    """`decode_dot_f16x2` for several tokens at once: words (4,) Uint32 decoded once, each pair
    view fma'd into every token's fp16x2 lanes in the per-pair order (z2s: one (16,) Uint32
    per token). The tokens' partials, each bit for bit `decode_dot_f16x2(words, z2s[t])`."""
    accs = [Uint32(0) for _ in z2s]
    for w in range(4):
        q = words[w]
        for i in range(4):
            t = q << PAIR_SHIFT[i] if PAIR_SHIFT[i] else q
            bits = (t & Uint32(SIGN_MASK)) | ((t >> F16_MAG_SHIFT) & Uint32(F16_MAG_MASK))
            for k in range(len(z2s)):
                accs[k] = fma_f16x2(bits, z2s[k][4 * w + i], accs[k])
    return [f16x2_sum(a) for a in accs]


class FC1ByExpert(FC1):
    """CTA (x, g): experts x, x + X, ... (grid X = E / experts_per_cta) and rows g·R .. (R =
    warps x rows per warp, as `FC1`). The ids loaded once; per expert the pairs p with ids[p]
    == e, in order of p (the grouped kernels' ballot scan: an unselected expert costs it, no
    CTA); the lane's W1 / W3 loads issued, the first chunk's z rows staged while they are in
    flight, the vectors kept in shared memory; then the pairs in chunks of `tokens` (the last
    count % tokens as one smaller chunk): each chunk's z rows staged (`stage_z2` per token: its
    own 2^c), the dots of every token of the chunk from one decode, `finish` per pair. `rows` is
    the batch bucket (the pair list's capacity rows·k). `min_blocks`: CTAs per SM ptxas caps the
    registers for (0: no cap; see `__call__`)."""

    def __init__(self, latent: int, inter: int, top_k: int, cfg: FC1Config, rows: int,
                 tokens: int, min_blocks: int, experts_per_cta: int = 1, pdl: bool = False,
                 expert_rows: int = 0):
        if not cfg.f16 or cfg.cp_async:
            raise ValueError(f"{cfg}: FC1ByExpert takes the fp16 decode to registers only")
        super().__init__(latent, inter, top_k, cfg, pdl, expert_rows)
        self.tokens, self.cap, self.min_blocks = tokens, pair_capacity(rows, top_k), min_blocks
        self.experts_per_cta = experts_per_cta
        self.smem = by_expert_smem(latent, top_k, rows, cfg, tokens)
        self.carveout = -1 if min_blocks > 1 else None

    # the grouped kernels' pair scan (they read top_k, cap, threads, warps)
    load_ids = GroupedMMA.load_ids
    collect_pairs = GroupedMMA.collect_pairs

    @cute.jit
    def __call__(self, mZ: cute.Tensor, mIdx: cute.Tensor, mW1: cute.Tensor,
                 mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mAct: cute.Tensor,
                 beta: Float32, linear_beta: Float32, stream):
        # as `FC1.__call__`; the grid is (E / experts_per_cta, I / R)
        n_exp, ep = self.experts(mW1), self.experts_per_cta
        self.kernel(mZ, mIdx, mW1, mS1, mW3, mS3, mAct, beta, linear_beta).launch(
            grid=[(n_exp + ep - 1) // ep, -(-self.inter // self.rows), 1],
            block=[self.threads, 1, 1], smem=self.smem, stream=stream, use_pdl=self.pdl,
            # with min_blocks, registers capped for that many CTAs per SM (spills at 2; the
            # default 0 caps nothing); then carveout -1, the driver's default (else the DSL
            # asks a GPU for one)
            min_blocks_per_mp=self.min_blocks, preferred_smem_carveout=self.carveout)

    @cute.jit
    def dots(self, w, sW: cute.Tensor, sZs, lane: Int32, warp: Int32):
        """The lane's (W1, W3) partials of every row for each staged token (sZs), in `FC1`'s
        order (mm = 0 .. M - 1, then the split step): acc[t][r][mat]. The weight words from
        sW (`keep_weights`), the scales from `w`."""
        _, rS, _, rST = w
        rV = make_frag(Int32, 1)  # (4, 1): one vector at a time
        NV, M, T = self.nv, self.m, len(sZs)
        acc = [[[Float32(0.0), Float32(0.0)] for _ in range(self.rw)] for _ in range(T)]
        rZ = [self.z_regs() for _ in range(T)]
        for mm in cutlass.range_constexpr(M):
            c = lane + 32 * mm
            if const_expr(32 * (mm + 1) > NV):
                c = cutlass.min(c, NV - 1)  # zero weights there: any finite z will do
            z = [self.group(sZs[t], c, rZ[t]) for t in range(T)]
            for r in cutlass.range_constexpr(self.rw):
                for mat in cutlass.range_constexpr(2):
                    cute.autovec_copy(sW[None, lane, (mm * self.rw + r) * 2 + mat, warp],
                                      rV[None, 0])
                    words = rV[None, 0].load().bitcast(Uint32)
                    factor = group_factor(rS[r][mat][mm], F16_SCALE_BIAS)
                    parts = decode_dots_f16x2(words, z)
                    for t in cutlass.range_constexpr(T):
                        acc[t][r][mat] = acc[t][r][mat] + parts[t] * factor
        if const_expr(self.split):
            z = [self.group(sZs[t], 32 * M + lane % 16, rZ[t]) for t in range(T)]
            first = lane < 16
            for r in cutlass.range_constexpr(self.rw):
                factor = group_factor(rST[r], F16_SCALE_BIAS)
                cute.autovec_copy(sW[None, lane, (M * self.rw + r) * 2, warp], rV[None, 0])
                parts = decode_dots_f16x2(rV[None, 0].load().bitcast(Uint32), z)
                for t in cutlass.range_constexpr(T):
                    part = parts[t] * factor
                    acc[t][r][0] = acc[t][r][0] + Float32(cutlass.select_(first, part,
                                                                          Float32(0.0)))
                    acc[t][r][1] = acc[t][r][1] + Float32(cutlass.select_(first, Float32(0.0),
                                                                          part))
        return acc

    def alloc_weights(self, smem):
        """Every lane's weight vectors in shared memory, (4, 32, slots, warps) Int32: slot
        (s·RW + r)·2 + mat holds lane step s, row r, W1 or W3 (the split step's in mat 0), as
        `FC1.body_async`'s; a lane's 16-byte vectors are consecutive across lanes (LDS.128
        without conflicts)."""
        slots = 2 * self.rw * self.steps
        return smem.allocate_tensor(Int32, cute.make_layout(
            (4, 32, slots, self.warps), stride=(1, 4, 128, 128 * slots)), 16)

    @cute.jit
    def keep_weights(self, w, sW: cute.Tensor, lane: Int32, warp: Int32):
        """The lane's loaded weight vectors (`FC1.load_weights`) -> its own slots of sW, read back
        per chunk by the same lane: in registers across the chunk loop, ptxas keeps every
        decoded pair view instead (112 at L 3584: 182-255 registers, or spills when capped)."""
        rW, _, rT, _ = w
        for mm in cutlass.range_constexpr(self.m):
            for r in cutlass.range_constexpr(self.rw):
                for mat in cutlass.range_constexpr(2):
                    cute.autovec_copy(rW[r][mat][None, mm],
                                      sW[None, lane, (mm * self.rw + r) * 2 + mat, warp])
        if const_expr(self.split):
            for r in cutlass.range_constexpr(self.rw):
                cute.autovec_copy(rT[r][None, 0], sW[None, lane, (self.m * self.rw + r) * 2, warp])

    @cute.kernel
    def kernel(self, mZ: cute.Tensor, mIds: cute.Tensor, mW1: cute.Tensor,
               mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mAct: cute.Tensor,
               beta: Float32, linear_beta: Float32):
        pdl_wait(self.pdl)  # the ids are the route kernel's output
        first_e, blk, _ = cute.arch.block_idx()
        n_blocks, _, _ = cute.arch.grid_dim()
        tidx, _, _ = cute.arch.thread_idx()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        n_exp = self.experts(mW1)
        smem = cutlass.memory.SmemAllocator()
        sPairs = smem.allocate_tensor(Int32, cute.make_layout((self.cap,)), 16)
        V = -(-self.cap // self.threads)
        sCnt = smem.allocate_tensor(Int32, cute.make_layout((V * self.warps,)), 16)
        sZs = [smem.allocate_tensor(Uint32, cute.make_layout((4, 4 * self.nv)), 16)
               for _ in range(self.tokens)]
        sMax = smem.allocate_tensor(Uint32, cute.make_layout((self.warps,)), 4)
        sW = self.alloc_weights(smem)
        rDown = cute.make_rmem_tensor(cute.make_layout((self.tokens,)), Float32)

        rIds = self.load_ids(mIds, n_exp, tidx)
        cute.arch.griddepcontrol_launch_dependents()
        i0 = blk * self.rows + warp * self.rw
        # experts first_e, first_e + grid x, ...: an unselected one costs a ballot, no CTA
        for i in cutlass.range(self.experts_per_cta, unroll=1):
            e = first_e + i * n_blocks
            if e < n_exp:
                count = self.collect_pairs(rIds, e, sPairs, sCnt, tidx)
                if count > 0:
                    self.expert(e, count, mZ, mW1, mS1, mW3, mS3, mAct, beta, linear_beta,
                                sPairs, sZs, sMax, sW, rDown, tidx, lane, warp, i0)

    @cute.jit
    def expert(self, e: Int32, count: Int32, mZ: cute.Tensor, mW1: cute.Tensor,
               mS1: cute.Tensor, mW3: cute.Tensor, mS3: cute.Tensor, mAct: cute.Tensor,
               beta: Float32, linear_beta: Float32, sPairs: cute.Tensor, sZs, sMax: cute.Tensor,
               sW: cute.Tensor, rDown: cute.Tensor, tidx: Int32, lane: Int32, warp: Int32,
               i0: Int32):
        """Expert e's `count` pairs (sPairs): the weight loads issued, the first chunk's z
        staged while they are in flight, the vectors kept (`keep_weights`), then the chunks
        (full ones of `tokens`, then the rest as one: no token's math repeated)."""
        T = self.tokens
        w = self.weight_frags()
        self.load_weights(w, mW1, mS1, mW3, mS3, e, i0, lane)
        full = count // T
        rest = count - full * T
        stage = (mZ, sPairs, sZs, sMax, rDown, tidx)
        if full > 0:
            self.stage_chunk(0, T, *stage, True)
        else:
            for size in cutlass.range_constexpr(1, T):
                if rest == size:
                    self.stage_chunk(0, size, *stage, True)
        self.keep_weights(w, sW, lane, warp)
        where = (w, sW, sPairs, sZs, rDown, lane, warp, i0, mAct, beta, linear_beta)
        for ch in cutlass.range(full, unroll=1):
            if ch > 0:
                self.stage_chunk(ch * T, T, *stage)
            self.chunk(ch * T, T, *where)
        for size in cutlass.range_constexpr(1, T):
            if rest == size:
                if full > 0:
                    self.stage_chunk(full * T, size, *stage)
                self.chunk(full * T, size, *where)

    @cute.jit
    def stage_chunk(self, first: Int32, size: cutlass.Constexpr[int], mZ: cute.Tensor,
                    sPairs: cute.Tensor, sZs, sMax: cute.Tensor, rDown: cute.Tensor,
                    tidx: Int32, one_by_one: cutlass.Constexpr[bool] = False):
        """The z rows of pairs sPairs[first .. first + size - 1] -> sZs[0 .. size - 1]
        (`stage_z2`: its barriers also keep the previous chunk's reads before these writes),
        their factors 2^(13 - c) -> rDown."""
        ZV = -(-(self.latent // 8) // self.threads)
        rZ8 = [make_frag(BFloat16, ZV) for _ in range(size)]  # (8, ZV) each
        for t in cutlass.range_constexpr(size):
            load_vectors(row_vectors(mZ, sPairs[first + t] // self.top_k), rZ8[t], tidx,
                         self.threads, self.latent // 8)
            if const_expr(one_by_one):
                rDown[t] = self.stage_z2(rZ8[t], sZs[t], sMax, tidx)
        for t in cutlass.range_constexpr(0 if one_by_one else size):
            rDown[t] = self.stage_z2(rZ8[t], sZs[t], sMax, tidx)

    @cute.jit
    def chunk(self, first: Int32, size: cutlass.Constexpr[int], w, sW: cute.Tensor,
              sPairs: cute.Tensor, sZs, rDown: cute.Tensor, lane: Int32, warp: Int32,
              i0: Int32, mAct: cute.Tensor, beta: Float32, linear_beta: Float32):
        """Pairs sPairs[first .. first + size - 1], their z staged (`stage_chunk`): the dots
        from one decode, `finish` per pair."""
        acc = self.dots(w, sW, sZs[:size], lane, warp)
        for t in cutlass.range_constexpr(size):
            self.finish(acc[t], lane, sPairs[first + t], i0, mAct, beta, linear_beta,
                        rDown[t])
