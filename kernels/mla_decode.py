"""CuTe DSL kernel for `k3::mla_decode`: the latent-cache write of the T new rows and absorbed MLA
decode attention, split-KV, in two launches of one compiled function (`mla_decode_ref` in
k3compile/ops/mla_decode.py is the math and the rounding it follows). Two compute paths
(`Config.mma`): tensor cores (mma.sync, kernels/device/mla_decode_mma.py; the default) and
CUDA-core FMAs (kernels/device/mla_decode.py).

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
    * Tensor cores: C a multiple of 64, C + R of 32 (all the allowed sizes are).
    * With PDL (settings.KERNELS.pdl, at most pdl_max_rows requests) the attention launch waits
      first (the cache rows are state an earlier step wrote; the merge launch always uses PDL).
"""

from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.mla_decode import mla_decode_ref

from .common.dsl import (
    BUCKETS,
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
STAGES = 2  # tiles in shared memory: the next tile's copies fly while this one is used
RESIDENT = 2  # CTAs per SM that `splits` counts on (96 KB of shared memory on tensor cores)
COMBINE_COLS = 64  # o_lat columns per merge CTA
COMBINE_LANES = 16  # threads per column vector in the merge, each taking every 16th split
COMBINE_UNROLL = 8  # splits a merge thread reads at once (MAX_SPLITS: one round at 16 lanes)
GROUP = 4  # tile rows whose warp sums are scattered together (one row per 8 lanes)
MMA = True  # config()'s default: scores and p·c_kv on tensor cores (`Config.mma`)
MMA_QUERIES = 16  # queries per CTA on tensor cores: the m of mma.sync m16n8k16


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


def ldsm_rows(lane, warp, col):
    """Scores (mma): the (tile row, column) of the 16 bytes lane `lane` addresses in the
    ldmatrix of its warp's 8 rows: matrix i = lane // 8 is rows 8·warp .. + 7 at columns
    col + 8i, the B fragments of the k-steps at col and col + 16."""
    return 8 * warp + lane % 8, col + 8 * (lane // 8)


def ldsm_queries(lane, col):
    """Scores (mma): the (query, column) lane `lane` addresses in the ldmatrix of the A
    fragment of the k-step at col: matrix i is queries 8(i % 2) .. + 7 at columns col + 8(i // 2)."""
    return lane % 8 + 8 * (lane // 8 % 2), col + 8 * (lane // 16)


def ldsm_values(lane, k0, c0):
    """p·c_kv (mma): the (tile row, column) lane `lane` addresses in the ldmatrix.trans of the
    B fragments of n-blocks c0 and c0 + 8 for the k-step of rows k0 .. k0 + 15: matrix i is
    rows k0 + 8(i % 2) .. + 7 at columns c0 + 8(i // 2)."""
    return k0 + 8 * (lane // 8 % 2) + lane % 8, c0 + 8 * (lane // 16)


def frag_c(lane, e):
    """(row, column) of element e of lane `lane`'s m16n8 accumulator fragment."""
    return lane // 4 + 8 * (e // 2), 2 * (lane % 4) + e % 2


def p_rows(t):
    """The 8 tile rows of the p values lane t of a quad holds (for its queries g, g + 8), in
    A-fragment order: k-step ks, half hi, pair element e -> 16ks + 8hi + 2t + e."""
    return [16 * ks + 8 * hi + 2 * t + e for ks in range(2) for hi in range(2) for e in range(2)]


@dataclass(frozen=True)
class Config:
    queries_per_warp: int  # QW: queries (t, h) per warp, in registers (mma: all 16 of the CTA)
    warps: int  # per CTA; a CTA serves QW·warps queries, H·T / (QW·warps) query groups
    mma: bool = False  # tensor cores: 16 queries (a query group) and 4 warps a CTA

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def groups(self, tokens: int, n_heads: int) -> int:
        if self.mma:
            return -(-tokens * n_heads // MMA_QUERIES)
        return tokens * n_heads // (self.queries_per_warp * self.warps)


def config(tokens: int, n_heads: int, latent: int = 512, rope: int = 64,
           batch_bucket: int = 1, mma: bool | None = None) -> Config:
    """Tensor cores (`MMA`, default): 16 queries and 4 warps a CTA, ⌈H·T / 16⌉ query groups.
    CUDA cores: up to 4 queries per warp (≈ 200 registers at C = 512), at most 8 warps per
    CTA; the rest of the H·T queries go to more query groups (CTAs reading the same rows,
    through the L2). The compile does not depend on the batch: `splits` picks the split
    count at launch."""
    del latent, rope, batch_bucket
    if MMA if mma is None else mma:
        return Config(MMA_QUERIES, 4, True)
    n = tokens * n_heads
    most = 1 if n <= 8 else 2 if n <= 16 else 4
    qw = next(q for q in (4, 2, 1) if q <= most and n % q == 0)
    warps = max(w for w in range(1, 9) if (n // qw) % w == 0)
    return Config(qw, warps)


def splits(batch: int, tokens: int, n_heads: int, max_len: int, latent: int = 512,
           rope: int = 64) -> int:
    """CTAs per (request, query group) along the context: the fewest splits whose grid takes
    at most 5% more tile steps than the best count, steps = rounds x tiles (rounds of
    RESIDENT·SMS CTAs at once, a CTA's tiles of a max_len context; fewer splits: less to
    merge, more tiles per CTA to pipeline); at most MAX_SPLITS and one per tile, and no more
    partials (fp32 H·T x C per split) than the cache bytes a request can read."""
    groups = config(tokens, n_heads, latent, rope).groups(tokens, n_heads)
    ctas = bucket(batch) * groups
    by_bytes = max_len * (latent + rope) * 2 // (tokens * n_heads * latent * 4)
    most = max(1, min(MAX_SPLITS, -(-max_len // TILE), by_bytes))

    def steps(n):
        rows = -(-max_len // n)
        return -(-n * ctas // (RESIDENT * SMS)) * -(-rows // TILE)

    best = min(steps(n) for n in range(1, most + 1))
    return next(n for n in range(1, most + 1) if steps(n) <= 1.05 * best)


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


def prepare(tokens: int, n_heads: int, latent: int = 512, rope: int = 64,
            buckets=BUCKETS) -> None:
    """Compile the kernel for these scalars (call before graph capture): one build for every
    bucket but for PDL, which the bucket's rows switch (`pdl_enabled`)."""
    for b in buckets:
        KERNEL.compiled(tokens, n_heads, latent, rope, config(tokens, n_heads, latent, rope),
                        rows=b)


def build(tokens, n_heads, latent, rope, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin; `pdl`: the attention launch with
    PDL, waiting first)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from .device.mla_decode import MLADecode
    from .device.mla_decode_mma import MLADecodeMMA

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    T, H, C, R = tokens, n_heads, latent, rope
    n, ns = cute.sym_int(), cute.sym_int()

    def act(*shape):  # last dim contiguous, other strides multiples of 8, 16-byte-aligned data
        strides = tuple(cute.sym_int64(divisibility=8) for _ in shape)
        return make_fake_tensor(bf16, (n, *shape), stride=(*strides, 1), assumed_align=16)

    def ws(width):  # contiguous fp32 workspace: partials in 16-byte, (m, l) in 8-byte vectors
        vec = 4 if width % 4 == 0 else 2
        return make_fake_tensor(f32, (n, ns, H * T, width),
                                stride=(cute.sym_int64(divisibility=vec), H * T * width, width, 1),
                                assumed_align=4 * vec)

    return compile_kernel(
        (MLADecodeMMA if cfg.mma else MLADecode)(T, H, C, R, cfg, pdl), act(T, H, C),
        act(T, H, R), act(T, C), act(T, R),
        make_fake_tensor(bf16, (cute.sym_int(), cute.sym_int(), C + R),
                         stride=(cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8),
                                 1), assumed_align=16),
        make_fake_tensor(cutlass.Int64, (n,), stride=(1,), assumed_align=8),
        make_fake_tensor(cutlass.Int64, (n,), stride=(1,), assumed_align=8),
        ws(C), ws(2),
        make_fake_tensor(bf16, (n, T, H, C), stride=(T * H * C, H * C, C, 1), assumed_align=16),
        f32((C + R) ** -0.5), fake_stream(), arch=arch, dump_dir=dump_dir)


KERNEL = Kernel(OP, build)  # PDL: the attention launch's (the merge launch always has it)


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
            KERNEL.compiled(T, H, C, R, cfg, rows=bucket(B))(*args, ws_o, ws_ml, o,
                                                             float(scale))
        return o

    return KERNEL.run(call_refusal, lambda: mla_decode_ref(*args, scale).contiguous(), launch)


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", mla_decode_cuda)
