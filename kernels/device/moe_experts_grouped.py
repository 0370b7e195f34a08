"""`GroupedMMA` and `Finalize`, the CuTe DSL kernels of kernels/moe_experts.py's grouped path
(FC1 + SiTU and FC2 by expert on bf16 mma.sync, then the weighted sum over k per token).

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import BFloat16, Float32, Int32, Uint32, const_expr, cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..common.copy import make_frag, row_vectors, vectors
from ..common.dsl import pdl_wait
from ..common.mma import mma_16816
from ..moe_experts import (
    G_SHIFT,
    MAG_MASK,
    PAIR_SHIFT,
    SIGN_MASK,
    TILE_TOKENS,
    GroupedConfig,
    grouped_smem,
    grouped_steps,
    pair_capacity,
    step_groups,
)
from .moe_experts import pairs_i_i4

# vectors a thread loads in `stage_tokens` before it uses any (registers: 4 per vector)
STAGE_BATCH = 8
# a row's steps above which `GroupedMMA.tile` runs them in a rolled loop
ROLL_STEPS = 4


@dsl_user_op
def mul_bf16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """Two bf16 products in one instruction (mul.rn.bf16x2; subnormals kept, no .ftz)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def decode_pair(word, i):
    """Inputs i and i + 4 of a packed word as bf16x2 (low half input i), times 2^-126."""
    t = word << PAIR_SHIFT[i] if PAIR_SHIFT[i] else word
    return (t & Uint32(SIGN_MASK)) | ((t >> 6) & Uint32(MAG_MASK))


def scale_factor(scale):
    """bf16x2 2^(scale - 1 - G_SHIFT) in both halves from an E8M0 byte (as Uint32): a decoded
    pair times it is W · 2^-G_SHIFT, exact in bf16 for scale bytes 50..176."""
    f = (scale + Uint32(126 - G_SHIFT)) << Uint32(7)
    return f | (f << Uint32(16))


class GroupedMMA:
    """One CTA: experts x, x + X, ... (grid X, experts_per_cta of them) and a tile of rows of
    their matrices (grid y); the pairs routed to each in tiles of TILE_TOKENS tokens (the MMA's
    N). `fc1`: W1 and W3 over z, output
    bf16 SiTU act [N·k, I]; else W2 over act, output bf16 y [N·k, L]."""

    def __init__(self, fc1: bool, latent: int, inter: int, top_k: int, rows: int,
                 cfg: GroupedConfig, pdl: bool = False, expert_rows: int = 0):
        self.fc1, self.top_k, self.cfg, self.pdl = fc1, top_k, cfg, pdl
        self.depth = latent if fc1 else inter  # K of the GEMMs
        self.out_rows = inter if fc1 else latent  # weight rows per expert
        # rows from one expert's first weight row to the next's (FC1's `expert_rows`)
        self.expert_rows = expert_rows or self.out_rows
        self.mats = 2 if fc1 else 1
        self.warps, self.threads = cfg.warps, 32 * cfg.warps
        self.cta_rows = 16 * cfg.warps * cfg.row_blocks
        self.ng = self.depth // 32  # 32-input groups (one E8M0 scale, one 16-byte vector)
        self.q, self.pitch = grouped_steps(self.depth)
        self.cap = pair_capacity(rows, top_k)
        self.smem = grouped_smem(self.depth, rows, top_k, cfg)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mIds: cute.Tensor, mWa: cute.Tensor,
                 mSa: cute.Tensor, mWb: cute.Tensor, mSb: cute.Tensor, mOut: cute.Tensor,
                 beta: Float32, linear_beta: Float32, stream):
        # mX: fc1 z (N, L), fc2 act (N·k, I) bf16; mIds: (N, k); mWa, mWb: (E·R, D/8) int32
        # words (fc2: mWb = mWa, unused); mSa, mSb: (E·R, D/32) uint8; mOut: (N·k, R) bf16
        n_exp = (mWa.shape[0] + (self.expert_rows - self.out_rows)) // self.expert_rows
        ep = self.cfg.experts_per_cta
        self.kernel(mX, mIds, mWa, mSa, mWb, mSb, mOut, beta, linear_beta).launch(
            grid=[(n_exp + ep - 1) // ep, -(-self.out_rows // self.cta_rows), 1], block=[self.threads, 1, 1],
            smem=self.smem, stream=stream, use_pdl=self.pdl or not self.fc1)

    @cute.jit
    def load_ids(self, mIds: cute.Tensor, n_exp: Int32, tidx: Int32) -> cute.Tensor:
        """Ids of pairs p = v·threads + tidx (p = n·k + j), clamped to [0, E); -1 past N·k."""
        K = self.top_k
        n_pairs = mIds.shape[0] * K
        rIds = cute.make_rmem_tensor(cute.make_layout((-(-self.cap // self.threads),)), Int32)
        for v in cutlass.range_constexpr(cute.size(rIds)):
            p = v * self.threads + tidx
            pc = cutlass.min(p, n_pairs - 1)
            ident = cutlass.max(cutlass.min(Int32(mIds[pc // K, pc % K]), n_exp - 1), 0)
            rIds[v] = cutlass.select_(p < n_pairs, ident, Int32(-1))
        return rIds

    @cute.jit
    def collect_pairs(self, rIds: cute.Tensor, e: Int32, sPairs: cute.Tensor,
                      sCnt: cute.Tensor, tidx: Int32) -> Int32:
        """The pairs p with id e (`load_ids`), in order of p, -> sPairs; their count. A ballot
        per warp and id register, each (register, warp)'s offset from the counts before it."""
        W, V = self.warps, cute.size(rIds)
        lane, warp = tidx % 32, tidx // 32
        cute.arch.barrier()  # the previous expert's reads of sPairs and sCnt are done
        masks = []
        for v in cutlass.range_constexpr(V):
            masks.append(Uint32(cute.arch.vote_ballot_sync(rIds[v] == e)))
            if lane == 0:
                sCnt[v * W + warp] = Int32(cute.arch.popc(masks[v]))
        cute.arch.barrier()
        total = Int32(0)
        bases = [Int32(0) for _ in range(V)]
        for v in cutlass.range_constexpr(V):
            for w in cutlass.range_constexpr(W):
                bases[v] = cutlass.select_(warp == w, total, bases[v])
                total = total + sCnt[v * W + w]
        below = cute.arch.lanemask_lt()
        for v in cutlass.range_constexpr(V):
            if rIds[v] == e:
                sPairs[bases[v] + Int32(cute.arch.popc(masks[v] & below))] = \
                    v * self.threads + tidx
        cute.arch.barrier()
        return total

    @cute.jit
    def stage_tokens(self, mX: cute.Tensor, sPairs: cute.Tensor, sX: cute.Tensor,
                     first: Int32, count: Int32, tidx: Int32):
        """Rows of the tile's TILE_TOKENS pairs (z[n] for fc1, act[p] for fc2) -> sX as bf16
        times 2^G_SHIFT, each 8-input vector as the pairs (i, i + 4) the A fragments hold;
        slot s, group G, word w at chunk s·pitch + 4G + (w ^ 2·(G/2 % 2)) (conflict-free LDS.128
        in `mma_steps`); slots past the count and groups past the depth are zeros.

        A thread's vectors go in batches of STAGE_BATCH loads, all issued before any is used
        (one L2 round trip per batch, not per vector): every load reads a valid address (a slot
        past the count the tile's last pair, a vector past the depth the row's last) and the
        value is replaced by zeros after it."""
        per_slot = 4 * 4 * self.q  # chunks of a slot (groups padded to whole steps)
        total = TILE_TOKENS * per_slot
        iters = -(-total // self.threads)
        last_vec = 4 * self.ng - 1  # the row's last 8-input vector
        rF = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
        rP = cute.make_rmem_tensor(cute.make_layout((4,)), Uint32)
        for b0 in cutlass.range_constexpr(0, iters, STAGE_BATCH):
            batch = list(range(b0, min(b0 + STAGE_BATCH, iters)))
            rXs = []
            for s in batch:
                idx = s * self.threads + tidx
                slot, v = idx // per_slot, idx % per_slot
                pair = sPairs[cutlass.min(first + slot, count - 1)]
                row = pair // self.top_k if const_expr(self.fc1) else pair
                rX = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
                cute.autovec_copy(row_vectors(mX, row)[None, cutlass.min(v, last_vec)], rX)
                rXs.append(rX)
            for s, rX in zip(batch, rXs):
                idx = s * self.threads + tidx
                slot, v = idx // per_slot, idx % per_slot
                grp, w = v // 4, v % 4
                keep = (first + slot < count) & (grp < self.ng)
                rF.store((rX.load().to(Float32) * Float32(2.0 ** G_SHIFT)).to(BFloat16))
                pairs = pairs_i_i4(rF.load().bitcast(Uint32))
                for k in cutlass.range_constexpr(4):
                    rP[k] = cutlass.select_(keep, pairs[k], Uint32(0))
                chunk = slot * self.pitch + 4 * grp + (w ^ (2 * ((grp // 2) % 2)))
                if const_expr(total % self.threads == 0 or s < iters - 1):
                    cute.autovec_copy(rP, sX[None, chunk])
                else:  # the last round's threads past the tile
                    if idx < total:
                        cute.autovec_copy(rP, sX[None, chunk])

    def load_step(self, mats, rows, grp, rW, rS):
        """A lane's weights of one step: group `grp` of each matrix and row -> rW (4, mats·2)
        words and rS (mats·2,) scale bytes, column 2m + r."""
        for m, (mW, mS) in enumerate(mats):
            for r, row in enumerate(rows):
                cute.autovec_copy(row_vectors(mW, row)[None, grp], rW[None, 2 * m + r])
                rS[2 * m + r] = Uint32(mS[row, grp])

    def mma_step(self, acc, rW, rS, sX, slot_chunk):
        """One step (128 inputs per row: group 4q + c of lane c's rows g, g + 8) for every
        matrix: 8 MMAs each, k slots 2c, 2c + 1 <- pair (w, 2h), 2c + 8, 2c + 9 <- (w, 2h + 1).
        acc: (4·mats,) fp32 C fragments, matrix m at 4m.., updated in place."""
        rB = cute.make_rmem_tensor(cute.make_layout((4,)), Uint32)
        for w in range(4):
            cute.autovec_copy(sX[None, slot_chunk(w)], rB)
            b = rB.load()
            for m in range(self.mats):
                fa, fb = scale_factor(rS[2 * m]), scale_factor(rS[2 * m + 1])
                wa = rW[None, 2 * m].load().bitcast(Uint32)
                wb = rW[None, 2 * m + 1].load().bitcast(Uint32)
                for h in range(2):
                    a = (mul_bf16x2(decode_pair(wa[w], 2 * h), fa),
                         mul_bf16x2(decode_pair(wb[w], 2 * h), fb),
                         mul_bf16x2(decode_pair(wa[w], 2 * h + 1), fa),
                         mul_bf16x2(decode_pair(wb[w], 2 * h + 1), fb))
                    d = mma_16816(a, (b[2 * h], b[2 * h + 1]),
                                  [acc[4 * m + i] for i in range(4)])
                    for i in range(4):
                        acc[4 * m + i] = d[i]

    @cute.jit
    def epilogue(self, acc, sPairs, mOut, first, count, row_a, lane, beta, linear_beta):
        """Thread (g, c) holds rows row_a, row_a + 8 x slots 2c, 2c + 1: fc1 bf16(SiTU) of the
        bf16-rounded W1 and W3 sums, fc2 the bf16-rounded W2 sum, to mOut[pair, row]."""
        c = lane % 4
        for half in cutlass.range_constexpr(2):
            row = row_a + 8 * half
            for col in cutlass.range_constexpr(2):
                slot = first + 2 * c + col
                if (slot < count) & (row < self.out_rows):
                    pair = sPairs[slot]
                    g = acc[0][2 * half + col].to(BFloat16).to(Float32)
                    if const_expr(self.fc1):
                        u = acc[1][2 * half + col].to(BFloat16).to(Float32)
                        sig = 1.0 / (1.0 + cute.math.exp(-g, fastmath=True))
                        gate = beta * cute.math.tanh(g / beta, fastmath=False) * sig
                        lin = linear_beta * cute.math.tanh(u / linear_beta, fastmath=False)
                        mOut[pair, row] = (gate * lin).to(BFloat16)
                    else:
                        mOut[pair, row] = g.to(BFloat16)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mIds: cute.Tensor, mWa: cute.Tensor, mSa: cute.Tensor,
               mWb: cute.Tensor, mSb: cute.Tensor, mOut: cute.Tensor, beta: Float32,
               linear_beta: Float32):
        pdl_wait(self.pdl)  # fc1: the ids are the previous kernel's output
        tidx, _, _ = cute.arch.thread_idx()
        first_e, blk, _ = cute.arch.block_idx()
        n_blocks, _, _ = cute.arch.grid_dim()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        n_exp = (mWa.shape[0] + (self.expert_rows - self.out_rows)) // self.expert_rows
        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(Uint32, cute.make_layout((4, TILE_TOKENS * self.pitch)), 16)
        sPairs = smem.allocate_tensor(Int32, cute.make_layout((self.cap,)), 16)
        sCnt = smem.allocate_tensor(
            Int32, cute.make_layout((-(-self.cap // self.threads) * self.warps,)), 16)
        rIds = self.load_ids(mIds, n_exp, tidx)
        cute.arch.griddepcontrol_launch_dependents()
        if const_expr(not self.fc1 and not self.carries()):
            cute.arch.griddepcontrol_wait()  # act is FC1's output
        # experts first_e, first_e + grid x, ...: an unselected one costs a ballot, no launch
        for i in cutlass.range(self.cfg.experts_per_cta, unroll=1):
            e = first_e + i * n_blocks
            if e < n_exp:
                count = self.collect_pairs(rIds, e, sPairs, sCnt, tidx)
                mats = mats_of(mWa, mSa, mWb, mSb, self.mats)
                ring = None
                if const_expr(self.carries()):  # the first steps' loads before the staging
                    ring = self.buffers(self.ring_size())
                    if count > 0:
                        for j in cutlass.range_constexpr(len(ring)):
                            self.load_ring(mats, ring[j], e, blk, warp, lane, j)
                    if const_expr(not self.fc1):  # act is FC1's output: the ballot and the
                        cute.arch.griddepcontrol_wait()  # first weights ran ahead of FC1's end
                for t in cutlass.range((count + TILE_TOKENS - 1) // TILE_TOKENS, unroll=1):
                    cute.arch.barrier()  # the previous tile's reads of sX are done
                    self.stage_tokens(mX, sPairs, sX, t * TILE_TOKENS, count, tidx)
                    cute.arch.barrier()
                    self.tile(mats, sX, sPairs, mOut, e, blk, t * TILE_TOKENS, count, lane,
                              warp, beta, linear_beta, ring)

    def carries(self) -> bool:
        """Whether `GroupedConfig.carry` applies: a ring of `ring_size` buffers over the CTA's
        steps of a token tile (one row block where the steps are rolled) that divides them."""
        if not self.cfg.carry:
            return False
        if self.q > ROLL_STEPS:
            return self.cfg.row_blocks == 1 and self.q % self.ring_size() == 0
        return (self.cfg.row_blocks * self.q) % self.ring_size() == 0

    def ring_size(self) -> int:
        steps = self.q if self.q > ROLL_STEPS else self.cfg.row_blocks * self.q
        return min(self.cfg.prefetch, steps)

    def buffers(self, n):
        """n step buffers (rW (4, mats·2) words, rS (mats·2,) scale bytes: `load_step`)."""
        return [(make_frag(Int32, 2 * self.mats),
                 cute.make_rmem_tensor(cute.make_layout((2 * self.mats,)), Uint32))
                for _ in range(n)]

    def step_rows(self, e, blk, rb, warp, g):
        """A lane's two weight rows (g, g + 8 of its warp's 16) in row block rb, clamped."""
        row_a = blk * self.cta_rows + (rb * self.warps + warp) * 16 + g
        return row_a, [e * self.expert_rows + cutlass.min(row_a + 8 * h, self.out_rows - 1)
                       for h in range(2)]

    def load_ring(self, mats, buf, e, blk, warp, lane, i):
        """Step i of a tile (row block i // Q, step i % Q; i static) -> buffer buf."""
        rb, q = divmod(i, self.q)
        self.load_step(mats, self.step_rows(e, blk, rb, warp, lane // 4)[1],
                       self.group(q, lane % 4), *buf)

    def group(self, q, c):
        """Lane c's weight group at step q (`step_groups`)."""
        return step_groups(q, c, self.ng, cutlass.min)[0]

    def step(self, acc, rW, rS, sX, g, c, q):
        """Step q's MMAs from the loaded buffer (rW, rS) into acc, the tokens staged at lane c's
        staged group (`step_groups`: never clamped, zeros past the depth)."""
        _, grp = step_groups(q, c, self.ng, cutlass.min)
        base, sw = g * self.pitch + 4 * grp, 2 * ((grp // 2) % 2)
        self.mma_step(acc, rW, rS, sX, lambda w: base + (w ^ sw))

    def tile(self, mats, sX, sPairs, mOut, e, blk, first, count, lane, warp, beta,
             linear_beta, ring):
        """One token tile over the CTA's rows: rolled over the steps where a row has more than
        ROLL_STEPS of them (FC1: 28 at L 3584), else unrolled (FC2: 2 per row at I 192, the
        loads running ahead across row blocks). `ring`: the carried buffers (`carries`), or
        None."""
        if const_expr(self.q > ROLL_STEPS):
            self.tile_rolled(mats, sX, sPairs, mOut, e, blk, first, count, lane, warp, beta,
                             linear_beta, ring)
        else:
            self.tile_unrolled(mats, sX, sPairs, mOut, e, blk, first, count, lane, warp, beta,
                               linear_beta, ring)

    def tile_unrolled(self, mats, sX, sPairs, mOut, e, blk, first, count, lane, warp, beta,
                      linear_beta, ring):
        """The steps (row block, q) in order, unrolled, each step's weights loaded `prefetch`
        steps ahead (with a ring: from the previous tile, or the kernel for the first, and the
        last steps load the next tile's first); a row block's epilogue after its last."""
        g, c = lane // 4, lane % 4
        steps = [(rb, q) for rb in range(self.cfg.row_blocks) for q in range(self.q)]
        D = len(ring) if ring is not None else self.cfg.prefetch
        loads = {}

        def issue(i):
            loads[i] = self.buffers(1)[0]
            self.load_ring(mats, loads[i], e, blk, warp, lane, i)

        if const_expr(ring is None):
            for i in range(min(D, len(steps))):
                issue(i)
        acc = None
        for i, (rb, q) in enumerate(steps):
            if const_expr(ring is None and i + D < len(steps)):
                issue(i + D)
            if q == 0:
                acc = cute.make_rmem_tensor(cute.make_layout((4 * self.mats,)), Float32)
                acc.fill(0.0)
            rW, rS = ring[i % D] if ring is not None else loads.pop(i)
            self.step(acc, rW, rS, sX, g, c, q)
            if const_expr(ring is not None):  # refill: step i + D, wrapping to the next tile
                self.load_ring(mats, ring[i % D], e, blk, warp, lane, (i + D) % len(steps))
            if q == self.q - 1:
                self.epilogue([[acc[4 * m + i] for i in range(4)] for m in range(self.mats)],
                              sPairs, mOut, first, count, self.step_rows(e, blk, rb, warp, g)[0],
                              lane, beta, linear_beta)

    @cute.jit
    def tile_rolled(self, mats, sX, sPairs, mOut, e, blk, first, count, lane, warp, beta,
                    linear_beta, ring):
        """Per row block its steps q = 0..Q-1 in a rolled loop (the code of `prefetch` = D
        steps, not of all Q: FC1's 28 unrolled steps, ~190 KB of SASS, left its warps waiting
        on instruction fetch 73% of their cycles, ncu 2026-12-07), D register buffers taking
        turns: step q's buffer is refilled with step q + D after its MMAs (clamped to the last
        step: the final rounds reload it, D loads of fc1g's 28 a row); a row block's epilogue
        after its last step. Skipping those reloads costs more than they do (sm_90a builds of
        fc1g, 2026-12-08): a runtime `q + D < Q` guard spills (255 registers, 16-byte frame);
        peeling the last round takes 137 -> 178 registers (3 -> 2 CTAs an SM) and 66 -> 87 KB
        of cubin."""
        Q = self.q
        D = min(self.cfg.prefetch, Q)
        g, c = lane // 4, lane % 4
        for rb in cutlass.range_constexpr(self.cfg.row_blocks):
            row_a, rows = self.step_rows(e, blk, rb, warp, g)
            bufs = ring
            if const_expr(ring is None):
                bufs = self.buffers(D)
                for j in cutlass.range_constexpr(D):
                    self.load_step(mats, rows, self.group(j, c), *bufs[j])
            acc = cute.make_rmem_tensor(cute.make_layout((4 * self.mats,)), Float32)
            acc.fill(0.0)
            for it in cutlass.range(Q // D, unroll=1):
                for j in cutlass.range_constexpr(D):
                    q = it * D + j
                    self.step(acc, *bufs[j], sX, g, c, q)
                    nxt = cutlass.min(q + D, Q - 1)  # the final rounds reload the last step
                    if const_expr(ring is not None):  # ... or wrap to the next tile's first
                        nxt = cutlass.select_(q + D < Q, q + D, q + D - Q)
                    self.load_step(mats, rows, self.group(nxt, c), *bufs[j])
            for j in cutlass.range_constexpr(Q % D):  # loaded into buffer j by the last round
                self.step(acc, *bufs[j], sX, g, c, (Q // D) * D + j)
            self.epilogue([[acc[4 * m + i] for i in range(4)] for m in range(self.mats)],
                          sPairs, mOut, first, count, row_a, lane, beta, linear_beta)


def mats_of(mWa, mSa, mWb, mSb, n):
    return ((mWa, mSa), (mWb, mSb))[:n]


class Finalize:
    """u[n] = bf16(Σ_j w[n, j] · y[n·k + j]) in order j = 0..k-1, fp32; one thread per
    8-column vector of u."""

    THREADS = 128

    def __init__(self, latent: int, top_k: int):
        self.latent, self.top_k = latent, top_k

    @cute.jit
    def __call__(self, mY: cute.Tensor, mWt: cute.Tensor, mU: cute.Tensor, stream):
        # mY: (N·k, L) bf16; mWt: (N, k) fp32; mU: (N, L) bf16 or fp32 (`out_fp32`)
        self.kernel(mY, mWt, mU).launch(
            grid=[mU.shape[0], -(-(self.latent // 8) // self.THREADS), 1],
            block=[self.THREADS, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mWt: cute.Tensor, mU: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        n, blk, _ = cute.arch.block_idx()
        v = blk * self.THREADS + tidx
        cute.arch.griddepcontrol_wait()
        if v < self.latent // 8:
            rY = cute.make_rmem_tensor(cute.make_layout((8,)), BFloat16)
            total = cute.make_rmem_tensor(cute.make_layout((8,)), Float32)
            for j in cutlass.range_constexpr(self.top_k):
                cute.autovec_copy(row_vectors(mY, n * self.top_k + j)[None, v], rY)
                term = rY.load().to(Float32) * mWt[n, j]
                if const_expr(j == 0):
                    total.store(term)
                else:
                    total.store(total.load() + term)
            rU = cute.make_rmem_tensor(cute.make_layout((8,)), mU.element_type)
            rU.store(total.load().to(mU.element_type))
            # 8 values: one 16-byte vector of bf16, two of fp32 (`out_fp32`)
            cute.autovec_copy(rU, vectors(mU[n, None], 8)[None, v])
