"""`MoERoute`, the CuTe DSL kernel of kernels/moe_route.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import Float32, Int32, Int64, Uint32, Uint64, const_expr, cute

from ..common.copy import load_vectors, make_frag, row_vectors, store_vectors, vectors
from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..moe_route import CAP, MAX_EXPERTS, Config


def sigmoid(x):
    return 1.0 / (1.0 + cute.math.exp(-x))

def tree(vals: list, op):
    while len(vals) > 1:
        vals = [op(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i]
                for i in range(0, len(vals), 2)]
    return vals[0]

def umax(a, b):
    return Uint32(cutlass.select_(a > b, a, b))

def flag(pred):
    return Int32(cutlass.select_(pred, Int32(1), Int32(0)))

NONE = 0xFFFFFFFF  # expert id of an empty cache entry (its key is 0, below any real key)
LOW = MAX_EXPERTS - 1  # a candidate's low word: LOW - expert

class MoERoute:
    def __init__(self, n_experts: int, top_k: int, cfg: Config, pdl: bool = False):
        self.n_experts, self.top_k, self.pdl = n_experts, top_k, pdl
        self.threads, self.j = cfg.threads, cfg.vec_per_thread
        self.n_vec = n_experts // 4
        self.v = -(-self.n_vec // 32)  # float4 vectors per lane of the selecting warp
        # sKey, sScore (E,); sCand (CAP,) 64-bit; sMax (32,); sWinId, sWinScore (k,)
        self.smem_bytes = 8 * n_experts + 8 * CAP + 128 + 8 * top_k + 5 * 16

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                 mW: cute.Tensor, scaling: Float32, stream):
        # mLogits: (N, E) fp32; mBias: (E,) fp32 or bf16; mIds: (N, k) int64; mW: (N, k) fp32
        self.kernel(mLogits, mBias, mIds, mW, scaling).launch(
            grid=[mLogits.shape[0], 1, 1], block=[self.threads, 1, 1],
            smem=self.smem_bytes, stream=stream, use_pdl=self.pdl)

    def gidx(self, lane, slot: int):
        """Expert held in register slot (element e of vector j): vector j·32 + lane."""
        return Uint32((slot // 4 * 32 + lane) * 4 + slot % 4)

    def allocate(self, smem):
        """One row's selection buffers: (sKey, sScore, sCand, sMax, sWinId, sWinScore)."""
        E, k = self.n_experts, self.top_k
        return (smem.allocate_tensor(Uint32, cute.make_layout((E,)), 16),  # sKey (E,)
                smem.allocate_tensor(Float32, cute.make_layout((E,)), 16),  # sScore (E,)
                smem.allocate_tensor(Uint64, cute.make_layout((CAP,)), 16),  # sCand (CAP,)
                smem.allocate_tensor(Uint32, cute.make_layout((32,)), 16),  # sMax (32,)
                smem.allocate_tensor(Uint32, cute.make_layout((k,)), 16),  # sWinId (k,)
                smem.allocate_tensor(Float32, cute.make_layout((k,)), 16))  # sWinScore (k,)

    def load_bias(self, mBias: cute.Tensor, tidx):
        """The bias in its own dtype (fp32, or bf16 in 8-byte vectors), split as the logits'
        float4s: rB (4, J)."""
        rB = make_frag(mBias.element_type, self.j, 4)  # (4, J)
        load_vectors(vectors(mBias, 4), rB, tidx, self.threads, self.n_vec)
        return rB

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
               mW: cute.Tensor, scaling: Float32):
        pdl_launch_dependents(self.pdl)
        tidx = cute.arch.thread_idx()[0]
        row = cute.arch.block_idx()[0]
        buffers = self.allocate(cutlass.memory.SmemAllocator())
        rB = None
        if const_expr(self.pdl):  # the bias first: it loads while the router GEMM ends
            rB = self.load_bias(mBias, tidx)
        pdl_wait(self.pdl)
        if const_expr(not self.pdl):
            rB = self.load_bias(mBias, tidx)
        self.route_row(mLogits, rB, mIds, mW, scaling, row, tidx, buffers)

    @cute.jit
    def route_row(self, mLogits: cute.Tensor, rB: cute.Tensor, mIds: cute.Tensor,
                  mW: cute.Tensor, scaling: Float32, row, tidx, buffers):
        """Row `row` of the logits -> its ids and weights: every thread's sigmoid scores and
        keys to shared memory, then warp 0 selects (also k3::moe_front_route's last CTA, once
        per row; a barrier between rows before the buffers are written again)."""
        sKey, sScore, sCand, sMax, sWinId, sWinScore = buffers
        k, T, nv = self.top_k, self.threads, self.n_vec
        rL = make_frag(Float32, self.j)  # (4, J)
        load_vectors(row_vectors(mLogits, row), rL, tidx, T, nv)
        rS = make_frag(Float32, self.j)  # (4, J)
        rS.store(sigmoid(rL.load()))
        bits = (rS.load() + rB.load().to(Float32)).bitcast(Uint32)  # (4·J,); bf16: exact
        rK = make_frag(Uint32, self.j)  # (4, J)
        for s in cutlass.range_constexpr(4 * self.j):
            u = bits[s]
            # Order-preserving float bits: flip all bits of negatives, the sign of others.
            rK[s] = u ^ (Uint32(Int32(u) >> 31) | Uint32(0x80000000))
        store_vectors(rS, vectors(sScore), tidx, T, nv)
        store_vectors(rK, vectors(sKey), tidx, T, nv)
        cute.arch.barrier()

        if cute.arch.warp_idx() == 0:
            lane = cute.arch.lane_idx()
            rKey = make_frag(Uint32, self.v)  # (4, V); vectors past the row read as key 0
            load_vectors(vectors(sKey), rKey, lane, 32, nv)
            bound = self.candidate_bound(rKey, sMax, lane)
            n_mine = tree([flag(rKey[s] >= bound) for s in range(4 * self.v)],
                          lambda a, b: a + b)
            first, n_cand = self.warp_scan(n_mine, 4 * self.v)
            if n_cand <= CAP:
                self.ranked_topk(rKey, bound, first, n_cand, sCand, sScore, sWinId,
                                 sWinScore, lane)
            else:
                self.serial_topk(rKey, sScore, sWinId, sWinScore, lane)
            cute.arch.sync_warp()
            # Σ of the winners' scores: every lane reads them all (broadcasts), no shuffles
            total = tree([sWinScore[t] for t in range(k)], lambda a, b: a + b)
            if lane < k:
                mIds[row, lane] = Int64(sWinId[lane])
                mW[row, lane] = sWinScore[lane] / (total + 1e-20) * scaling

    def candidate_bound(self, rKey, sMax, lane):
        """The k-th largest lane maximum (at least 1: padding keys 0 never qualify)."""
        m = tree([rKey[s] for s in range(4 * self.v)], umax)
        sMax[lane] = m
        cute.arch.sync_warp()
        rMax = make_frag(Uint32, 8)  # (4, 8): all 32 maxima, broadcast reads
        load_vectors(vectors(sMax), rMax, 0, 1, 8)
        at_or_above = tree([flag(rMax[i] >= m) for i in range(32)], lambda a, b: a + b)
        bound = Uint32(cute.arch.warp_redux_sync(
            Uint32(cutlass.select_(at_or_above >= self.top_k, m, Uint32(0))), "umax"))
        return umax(bound, Uint32(1))

    def warp_scan(self, n, most: int):
        """(Σ of n over the lanes below, Σ over the warp) for 0 <= n <= most: one ballot per
        bit of n, all independent."""
        below = lanes = Int32(0)
        lt = cute.arch.lanemask_lt()
        for b in range(most.bit_length()):
            ballot = Uint32(cute.arch.vote_ballot_sync(((n >> b) & 1) != 0))
            below = below + (Int32(cute.arch.popc(ballot & lt)) << b)
            lanes = lanes + (Int32(cute.arch.popc(ballot)) << b)
        return below, lanes

    @cute.jit
    def ranked_topk(self, rKey: cute.Tensor, bound: Uint32, first: Int32, n_cand: Int32,
                    sCand: cute.Tensor, sScore: cute.Tensor, sWinId: cute.Tensor,
                    sWinScore: cute.Tensor, lane: Int32):
        """Candidates to sCand, then each counts the larger ones: that is its output slot."""
        at = first
        for s in cutlass.range_constexpr(4 * self.v):
            if rKey[s] >= bound:
                sCand[at] = (Uint64(rKey[s]) << 32) | Uint64(LOW - self.gidx(lane, s))
            at = at + flag(rKey[s] >= bound)
        cute.arch.sync_warp()
        mine0, mine1 = sCand[lane], sCand[lane + 32]  # past n_cand: stale, never used
        rank0, rank1 = Int32(0), Int32(0)
        if n_cand <= 32:
            for y in cutlass.range(n_cand, unroll=4):
                rank0 = rank0 + flag(sCand[y] > mine0)
        else:
            for y in cutlass.range(n_cand, unroll=4):
                other = sCand[y]
                rank0 = rank0 + flag(other > mine0)
                rank1 = rank1 + flag(other > mine1)
        for c in cutlass.range_constexpr(2):
            mine, rank = (mine0, rank0) if const_expr(c == 0) else (mine1, rank1)
            if (lane + 32 * c < n_cand) & (rank < self.top_k):
                expert = Uint32(LOW) - Uint32(mine & Uint64(LOW))
                sWinId[rank] = expert
                sWinScore[rank] = sScore[expert]

    @cute.jit
    def serial_topk(self, rKey: cute.Tensor, sScore: cute.Tensor, sWinId: cute.Tensor,
                    sWinScore: cute.Tensor, lane: Int32):
        """The exact fallback: k rounds, each the warp's best by two `redux.sync` (largest
        key, then lowest expert among equal keys); every lane caches its best three (key,
        expert, score) and the winning lane pops its cache, rescanning only when it runs dry."""
        rScore = make_frag(Float32, self.v)  # (4, V), read by linear slot
        load_vectors(vectors(sScore), rScore, lane, 32, self.n_vec)
        k1, i1, s1, k2, i2, s2, k3, i3, s3 = self.best3(rKey, rScore, lane)
        # A rolled loop: the rare rescan is emitted once, not once per round.
        for t in cutlass.range(self.top_k, unroll=1):
            top = Uint32(cute.arch.warp_redux_sync(k1, "umax"))
            win = Uint32(cute.arch.warp_redux_sync(
                Uint32(cutlass.select_(k1 == top, i1, Uint32(NONE))), "umin"))
            if i1 == win:  # the owner records the winner and pops its cache
                sWinId[t] = win
                sWinScore[t] = s1
                last_k, last_i = k1, i1
                k1, i1, s1, k2, i2, s2 = k2, i2, s2, k3, i3, s3
                k3, i3 = Uint32(0), Uint32(NONE)
                if k1 == Uint32(0):
                    k1, i1, s1, k2, i2, s2, k3, i3, s3 = self.best3(
                        rKey, rScore, lane, (last_k, last_i))

    def best3(self, rKey, rScore, lane, below=None):
        """The lane's three best (key, expert, score), best first, ties to the lower expert;
        only entries ranked after `below` = (key, expert) when given."""
        k1 = k2 = k3 = Uint32(0)
        i1 = i2 = i3 = Uint32(NONE)
        s1 = s2 = s3 = Float32(0.0)
        for s in range(4 * self.v):  # ascending expert id: a later equal key ranks lower
            k, g, sc = rKey[s], self.gidx(lane, s), rScore[s]
            if below is not None:
                after = (k < below[0]) | ((k == below[0]) & (g > below[1]))
                k = Uint32(cutlass.select_(after, k, Uint32(0)))
            c1, c2, c3 = k > k1, k > k2, k > k3
            k3 = Uint32(cutlass.select_(c2, k2, cutlass.select_(c3, k, k3)))
            i3 = Uint32(cutlass.select_(c2, i2, cutlass.select_(c3, g, i3)))
            s3 = Float32(cutlass.select_(c2, s2, cutlass.select_(c3, sc, s3)))
            k2 = Uint32(cutlass.select_(c1, k1, cutlass.select_(c2, k, k2)))
            i2 = Uint32(cutlass.select_(c1, i1, cutlass.select_(c2, g, i2)))
            s2 = Float32(cutlass.select_(c1, s1, cutlass.select_(c2, sc, s2)))
            k1 = Uint32(cutlass.select_(c1, k, k1))
            i1 = Uint32(cutlass.select_(c1, g, i1))
            s1 = Float32(cutlass.select_(c1, sc, s1))
        return k1, i1, s1, k2, i2, s2, k3, i3, s3
