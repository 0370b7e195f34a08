"""CuTe DSL kernel for `k3::moe_route`: sigmoid scores, bias-corrected top-k, renormalised weights
(spec §3.3 steps 1-2, `noaux_tc`).

    s = sigmoid(logits); ids = topk(s + bias, k); w = s[ids] / (Σ s[ids] + 1e-20) · scaling

One warp per token row. Each lane holds E/32 experts as order-preserving 32-bit keys of s + bias
and caches its best three (key, expert) in registers; each of the k rounds takes the warp's best
with two `redux.sync` (largest key, then lowest expert among equal keys) and the winning lane
pops its cache, rescanning its slots only when the cache runs dry (rare: a lane rarely holds more
than three of the top 16). Ties in s + bias go to the lower expert index (torch.topk leaves them
unspecified). Each winner's unbiased score travels with it to lane t for the weights. With PDL
(`common.dsl.PDL`) the bias loads before `griddepcontrol.wait` (in every warp, also those past
the last row), the logits after it.

Constraints:
    * logits fp32 [N, E] with contiguous rows, row stride a multiple of 4 elements and 16-byte
      aligned data; bias fp32 [E] contiguous; outputs ids int64 [N, k], weights fp32 [N, k].
    * E % 4 == 0, 4 <= E <= 1024; 1 <= k <= min(32, E); scaling is a runtime scalar.
    * NaN logits are not ordered (their selection is unspecified).
"""

import functools
from dataclasses import dataclass

import torch

from k3compile.ops.moe import moe_route_ref

from .common.dsl import (
    BUCKETS,
    CompileCache,
    aligned16,
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
    fake_vector,
    fallback,
    flat_rows,
    pdl_enabled,
    pdl_launch_dependents,
    pdl_wait,
    rows_ok,
    runtime_refusal,
)

OP = "moe_route"
MAX_EXPERTS = 1024
MAX_TOP_K = 32


@dataclass(frozen=True)
class Config:
    rows_per_cta: int  # one warp per row


def config(n_experts: int, top_k: int, batch_bucket: int) -> Config:
    """Up to 16 rows: one row per CTA (each on its own SM, lowest latency); 32 and 64 rows: 2 and
    4 warps per CTA (the warps run on separate SM sub-partitions, so no row waits)."""
    return Config(1 if batch_bucket <= 16 else 2 if batch_bucket <= 32 else 4)


def can_implement(logits, bias, top_k: int) -> bool:
    return refusal(logits, bias, top_k) is None


def refusal(logits, bias, top_k: int) -> str | None:
    n_experts = logits.shape[-1]
    if n_experts % 4 or not 4 <= n_experts <= MAX_EXPERTS:
        return f"{n_experts} experts (want a multiple of 4 in [4, {MAX_EXPERTS}])"
    if not 1 <= top_k <= min(MAX_TOP_K, n_experts):
        return f"top_k {top_k} (want 1..{min(MAX_TOP_K, n_experts)})"
    if why := rows_ok(logits, n_experts, torch.float32):
        return f"logits: {why}"
    if bias.dtype != torch.float32 or bias.shape != (n_experts,) or not bias.is_contiguous():
        return f"bias: {bias.dtype} {tuple(bias.shape)} (want contiguous fp32 [{n_experts}])"
    return None


@functools.cache
def _kernel_class():
    import cutlass
    from cutlass import Float32, Int32, Int64, Uint32, const_expr, cute

    from .common.copy import load_vectors, make_frag, row_vectors, vectors

    def sigmoid(x):
        return 1.0 / (1.0 + cute.math.exp(-x))

    NONE = 0xFFFFFFFF  # expert id of an empty cache entry (its key is 0, below any real key)

    class MoERoute:
        def __init__(self, n_experts: int, top_k: int, cfg: Config, pdl: bool = False):
            self.n_experts, self.top_k, self.rows = n_experts, top_k, cfg.rows_per_cta
            self.pdl = pdl
            self.n_vec = n_experts // 4
            self.v = -(-self.n_vec // 32)  # float4 vectors per lane

        @cute.jit
        def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                     mW: cute.Tensor, scaling: Float32, stream):
            # mLogits: (N, E) fp32; mBias: (E,); mIds: (N, k) int64; mW: (N, k) fp32
            self.kernel(mLogits, mBias, mIds, mW, scaling).launch(
                grid=[cute.ceil_div(mLogits.shape[0], self.rows), 1, 1],
                block=[32 * self.rows, 1, 1], stream=stream, use_pdl=self.pdl)

        def gidx(self, lane, slot: int):
            """Expert held in register slot (element e of vector j): vector j·32 + lane."""
            return Uint32((slot // 4 * 32 + lane) * 4 + slot % 4)

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

        @cute.kernel
        def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                   mW: cute.Tensor, scaling: Float32):
            pdl_launch_dependents(self.pdl)
            lane = cute.arch.lane_idx()
            row = cute.arch.block_idx()[0] * self.rows + cute.arch.warp_idx()
            rB = make_frag(Float32, self.v)  # (4, V)
            if const_expr(self.pdl):  # the bias first: it loads while the router GEMM ends
                load_vectors(vectors(mBias), rB, lane, 32, self.n_vec)
            pdl_wait(self.pdl)
            if row < mLogits.shape[0]:
                rL = make_frag(Float32, self.v)  # (4, V)
                load_vectors(row_vectors(mLogits, row), rL, lane, 32, self.n_vec)
                if const_expr(not self.pdl):
                    load_vectors(vectors(mBias), rB, lane, 32, self.n_vec)
                rScore = make_frag(Float32, self.v)  # (4, V), read by linear slot below
                rScore.store(sigmoid(rL.load()))
                bits = (rScore.load() + rB.load()).bitcast(Uint32)  # (4·V,)
                rKey = cute.make_rmem_tensor(cute.make_layout((4 * self.v,)), Uint32)
                for s in cutlass.range_constexpr(4 * self.v):
                    u = bits[s]
                    # Order-preserving float bits: flip all bits of negatives, the sign of others.
                    k = u ^ (Uint32(Int32(u) >> 31) | Uint32(0x80000000))
                    if const_expr(s // 4 * 32 + 31 >= self.n_vec):  # padding slots never win
                        k = Uint32(cutlass.select_(s // 4 * 32 + lane < self.n_vec, k, Uint32(0)))
                    rKey[s] = k
                k1, i1, s1, k2, i2, s2, k3, i3, s3 = self.best3(rKey, rScore, lane)
                chosen, score = Uint32(0), Float32(0.0)  # lane t keeps the t-th winner
                # A rolled loop: the rare rescan is emitted once, not once per round.
                for t in cutlass.range(self.top_k, unroll=1):
                    top = Uint32(cute.arch.warp_redux_sync(k1, "umax"))
                    win = Uint32(cute.arch.warp_redux_sync(
                        Uint32(cutlass.select_(k1 == top, i1, Uint32(NONE))), "umin"))
                    win_score = cute.arch.shuffle_sync(s1, Int32((win >> 2) & Uint32(31)))
                    if lane == t:
                        chosen, score = win, win_score
                    if i1 == win:  # the owner pops its cache
                        last_k, last_i = k1, i1
                        k1, i1, s1, k2, i2, s2 = k2, i2, s2, k3, i3, s3
                        k3, i3 = Uint32(0), Uint32(NONE)
                        if k1 == Uint32(0):
                            k1, i1, s1, k2, i2, s2, k3, i3, s3 = self.best3(
                                rKey, rScore, lane, (last_k, last_i))
                total = cute.arch.warp_reduction(score, lambda a, b: a + b)
                if lane < self.top_k:
                    mIds[row, lane] = Int64(chosen)
                    mW[row, lane] = score / (total + 1e-20) * scaling

    return MoERoute


_cache = CompileCache(OP)


def compiled(n_experts: int, top_k: int, cfg: Config, arch: str | None = None):
    pdl = pdl_enabled()
    return _cache.get((n_experts, top_k, cfg, arch, pdl),
                      lambda: build(n_experts, top_k, cfg, arch, pdl=pdl))


def prepare(n_experts: int, top_k: int, buckets=BUCKETS) -> None:
    """Compile the kernel of every batch bucket for these sizes (call before graph capture)."""
    for b in buckets:
        compiled(n_experts, top_k, config(n_experts, top_k, b))


def build(n_experts, top_k, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    n = cute.sym_int()
    f32 = cutlass.Float32
    return compile_kernel(
        _kernel_class()(n_experts, top_k, cfg, pdl), fake_rows(f32, n, n_experts),
        fake_vector(f32, n_experts),
        make_fake_tensor(cutlass.Int64, (n, top_k), stride=(top_k, 1), assumed_align=8),
        make_fake_tensor(f32, (n, top_k), stride=(top_k, 1), assumed_align=4),
        f32(1.0), fake_stream(), arch=arch, dump_dir=dump_dir)


def moe_route_cuda(logits, bias, top_k, scaling, *, out=None):
    """CUDA implementation of k3::moe_route: the kernel, or the reference if refused."""
    reason = (runtime_refusal() or refusal(logits, bias, top_k)
              or (None if aligned16(logits, bias) else "data not 16-byte aligned"))
    if reason:
        fallback(OP, reason)
        return moe_route_ref(logits, bias, top_k, scaling)
    n, n_experts = logits.shape
    ids, weights = out if out is not None else (
        logits.new_empty((n, top_k), dtype=torch.int64), logits.new_empty((n, top_k)))
    if n:
        compiled(n_experts, top_k, config(n_experts, top_k, bucket(n)))(
            logits, bias, ids, weights, float(scaling))
    return ids, weights


def register() -> None:
    torch.library.register_kernel(f"k3::{OP}", "cuda", flat_rows(moe_route_cuda))
