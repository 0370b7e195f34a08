"""CuTe DSL kernels for `k3::moe_experts`: the routed MXFP4 experts, read packed (W4A16).

    u[n] = bf16(Σ_j w[n,j]·bf16(SiTU(bf16(z[n]·W1[e]ᵀ), bf16(z[n]·W3[e]ᵀ))·W2[e]ᵀ)), e = ids[n,j]

(`out_fp32`: the sum stored in fp32, unrounded: the finalize's store, FC2's or the grouped sum's.)

W = e2m1 · 2^(scale − 127) decoded in registers, fp32 products and sums. Two launches: FC1 +
SiTU, then FC2 + finalize (launched with PDL after FC1); `config` takes FC1 with cp.async at
one row, to registers above, and FC2 with two threads per W2 row at one row
(`FC2Config.split`). With K3_MOE_GROUPED at 8-64 rows (`grouped`): by expert instead, three
launches (kernels/device/moe_experts_grouped.py): FC1 + SiTU and FC2 per (expert, row tile)
on bf16 mma.sync, each expert's weights streamed once per 8 of its tokens, then the weighted sum
over k. With K3_MOE_F16 (`FC1Config.f16`, `FC2Config.f16`) FC1 and FC2 (I <= 512) decode into
fma.rn.f16x2: z (act) staged as fp16 pairs times 2^c per row, fp16 sums of 16 products, fp32
above; with K3_MOE_BY_EXPERT too (`by_expert`), FC1 runs by expert (stage `fc1e`,
kernels/device/moe_experts_by_expert.py): each weight word decoded once per chunk of the
expert's tokens, act the same bits. Design, decode and measurements: docs/kernels.md, moe_experts.

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
    * K3_MOE_F16: any z (c from the row's max |z|); scale bytes >= 24 keep a group's fp32
      partial normal; ~1 extra bf16 rounding of the output against the reference, more where
      |hg| >> beta (docs/kernels.md, 2026-12-03).
    * Grouped (K3_MOE_GROUPED): scale bytes 50..176 (a weight is exact in bf16 times
      2^-G_SHIFT there; outside, subnormal or infinite), |z| and |act| < 2^79.
    * The op's own constraints (k3compile.ops.moe_experts `moe_experts_refusal`) are checked first;
      `refusal` holds only these kernels' limits (registered in the op registry).
"""

from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.moe_experts import moe_experts_ref, moe_experts_refusal
from k3compile.settings import KERNELS

from .common.dsl import (
    aligned16,
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
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
# K3_MOE_F16=auto: the packed fp16 decode from this bucket up. On the H100 yardstick (2026-12-05,
# BENCHMARKS.md session 27) it gained 6.6% at B32 and 9-11% at B64; with FC1 at 8 warps x 1 row
# (F16_SWEPT_ROWS), 8.6% at B16 and 1.3% at B8 (2026-12-06, session 30): B8 stays under the 5% a
# tuned choice must win by.
F16_AUTO_ROWS = 16
# with the fp16 decode (auto or K3_MOE_F16=1), FC1 takes 8 warps x 1 row from this bucket up (the
# sweeps at 8-64 rows: B8 -7.9%, B16 -10.4% against the fp32 decode in the microbenchmark, H100,
# 2026-12-06)
F16_SWEPT_ROWS = 8
Z_SHIFT = 96  # activations are staged times 2^Z_SHIFT (see the docstring)
SCALE_BIAS = 126 - Z_SHIFT  # fp32 exponent field of a group's factor = scale byte + SCALE_BIAS
PAIR_SHIFT = (12, 8, 4, 0)  # word << PAIR_SHIFT[i] puts inputs i, i + 4 atop the two halves
SIGN_MASK, MAG_MASK = 0x80008000, 0x01C001C0
# FC1 with K3_MOE_F16 (`FC1Config.f16`): the pair view in fp16 bits, (t & SIGN_MASK) |
# ((t >> 3) & F16_MAG_MASK), is E2M1 times 2^-14; z is staged as fp16 pairs times 2^c,
# c = F16_Z_TOP - (the exponent field of the row's max |z|), clamped to F16_C_RANGE (both 2^c
# and the final 2^(13 - c) normal fp32); a group's factor 2^(scale - 126) has the field
# scale + F16_SCALE_BIAS. Bounds: docs/kernels.md, moe_experts, 2026-12-03 (hmoe2).
F16_MAG_MASK, F16_MAG_SHIFT = 0x0E000E00, 3
F16_Z_TOP = 141  # max |z| times 2^c in [2^14, 2^15): bf16 z times E2M1 exact in fp16
F16_C_RANGE = (-114, 127)
F16_SCALE_BIAS = 1
# the grouped kernels (K3_MOE_GROUPED): tokens per MMA tile (the N of m16n8k16), the rows they
# take, and the power of two their B operand is staged times (bf16 weights stay normal for
# scale bytes 50..176: the decoded pair times 2^(scale - 1 - G_SHIFT))
TILE_TOKENS = 8
GROUPED_ROWS = (8, 64)
G_SHIFT = 48
# FC1 by expert (K3_MOE_BY_EXPERT, fp16 decode, buckets up to BY_EXPERT_MAX_ROWS): tokens per chunk
# (each weight word decoded once per chunk; kernels/device/moe_experts_by_expert.py)
BY_EXPERT_TOKENS = 2
BY_EXPERT_MAX_ROWS = 64
# ... and experts per CTA (grid E / that x I / R; each CTA loads the ids once and scans them per
# expert). 1, session 30's grid: on the H100 (2026-12-06, session 31) 4, 8 or 16 were no
# faster (BENCHMARKS.md, session 31, helper moev2)
BY_EXPERT_EXPERTS = 1
# ... with registers capped for 3 CTAs of 256 threads per SM (80; uncapped, ptxas takes 88-98 with
# the first chunk's z staged while the weight loads are in flight: 2 CTAs per SM); 2 (8 experts per
# CTA: 6) loop-invariant words spilled, reloaded once per expert
BY_EXPERT_MIN_BLOCKS = 3


@dataclass(frozen=True)
class FC1Config:
    warps: int
    rows_per_warp: int  # rows of W1 and of W3 per warp
    # weights by cp.async into shared memory, one group per lane step, the math of a step after
    # its group alone arrived (see the docstring); off: every load to registers, then the math
    cp_async: bool = False
    # packed fp16 decode (K3_MOE_F16): z staged as fp16 pairs, fma.rn.f16x2 per pair of weights
    f16: bool = False

    @property
    def threads(self) -> int:
        return 32 * self.warps


@dataclass(frozen=True)
class FC2Config:
    rows_per_cta: int  # R output columns l per CTA
    threads: int  # R·k·split threads, whole warps
    # packed fp16 decode (K3_MOE_F16, I <= 512: the whole W2 row in registers): act staged as
    # fp16 pairs times 2^c per row (n, j)
    f16: bool = False
    # threads per W2 row, 1 or 2 (2: I <= 512 with I/32 even): lanes 2u, 2u + 1 load and decode
    # the first and second half of the row's groups; the first adds the second's partials
    # after its own (a shuffle): the same sum in the same order
    split: int = 1


@dataclass(frozen=True)
class ByExpertConfig:
    """FC1 by expert (`by_expert`): the per-pair fp16 FC1's config, the batch bucket (the pair
    list's capacity), the tokens per chunk and the experts per CTA (`by_expert_config`)."""

    fc1: FC1Config
    rows: int
    tokens: int = BY_EXPERT_TOKENS
    min_blocks: int = 0  # CTAs per SM the registers are capped for (0: no cap)
    experts_per_cta: int = 1


@dataclass(frozen=True)
class GroupedConfig:
    """A grouped stage (`fc1g`, `fc2g`): warps of 16 weight rows (the MMA's M) per row block,
    row blocks per warp one after another, steps (128 inputs per row) loaded ahead, the batch
    bucket (the shared memory of the pair list), and experts per CTA (E / that CTAs per row
    tile, each taking every (E / that)-th expert: an unselected expert costs a ballot, not a
    CTA)."""

    warps: int
    row_blocks: int
    prefetch: int
    rows: int
    experts_per_cta: int = 1
    # the weight loads as a ring of `prefetch` buffers running across a selected expert's token
    # tiles: its first steps issued right after the pair list, before the tokens are staged (the
    # DRAM round trip beside the staging's L2 one; fc2g waits for FC1 only after them, so under
    # PDL its ballot and first weights overlap FC1's end), each tile's last loads the next
    # tile's first steps (the last tile's are spare). Where the CTA's steps are a multiple of
    # `prefetch` (and fc1g's row blocks are 1), else ignored.
    carry: bool = False


def grouped(n_rows: int) -> bool:
    """Whether a call of n_rows takes the grouped kernels: K3_MOE_GROUPED at 8-64 rows, or from
    its number of rows (`KERNELS.moe_grouped`: 0 never, 1 / True from GROUPED_ROWS[0])."""
    first = int(KERNELS.moe_grouped)
    return bool(first) and max(first, GROUPED_ROWS[0]) <= n_rows <= GROUPED_ROWS[1]


def by_expert(n_rows: int, latent: int) -> bool:
    """Whether a call of n_rows takes FC1 by expert: K3_MOE_BY_EXPERT with the fp16 decode, FC1
    to registers (not the one-row cp.async config), up to BY_EXPERT_MAX_ROWS rows; the grouped
    kernels (`grouped`) go first."""
    if not KERNELS.moe_by_expert or grouped(n_rows) or n_rows > BY_EXPERT_MAX_ROWS:
        return False
    b = bucket(n_rows)
    return f16_decode(b) and not config("fc1", latent, 0, 0, b).cp_async


def by_expert_config(fc1: FC1Config, batch_bucket: int) -> ByExpertConfig:
    """The by-expert FC1's config at a bucket: BY_EXPERT_EXPERTS experts per CTA (read at each
    call: benchmarks/moe_experts.py's variants `kernel_by_expert_xX` time others)."""
    return ByExpertConfig(fc1, batch_bucket, min_blocks=BY_EXPERT_MIN_BLOCKS,
                          experts_per_cta=BY_EXPERT_EXPERTS)


def by_expert_smem(latent: int, top_k: int, rows: int, cfg: FC1Config, tokens: int) -> int:
    """Shared memory of a by-expert FC1 CTA: the pair list and the ballot counts (as the grouped
    kernels'), `tokens` staged z rows (fp16 pairs), the warps' maxima, every lane's weight
    vectors (as FC1's cp.async ones), 16 bytes of alignment per buffer."""
    cap = pair_capacity(rows, top_k)
    counts = -(-cap // cfg.threads) * cfg.warps
    m, split = _lane_steps(latent)
    weights = 16 * 32 * 2 * cfg.rows_per_warp * (m + split) * cfg.warps
    return 4 * cap + 4 * counts + tokens * 2 * latent + 4 * cfg.warps + weights + 16 * (tokens + 4)


def grouped_steps(depth: int) -> tuple[int, int]:
    """(steps Q of 128 inputs over a row of `depth` inputs, the pitch in 16-byte chunks of a
    token's staged row: 16 Q + 1, so that rows g, g + 1 start 16 bytes apart in the banks)."""
    q = -(-depth // 128)
    return q, 16 * q + 1


def step_groups(q, c, groups: int, clamp=min):
    """Lane c's 32-input groups at step q of a grouped kernel (`groups` = depth / 32): (the
    weights' group, the staged tokens' group). Past the depth (groups not a multiple of 4) the
    weights' group is clamped to the last one, since any finite weight will do where the staged
    slots hold zeros; the staged group never is. `clamp`: `min`, or `cutlass.min` in a kernel."""
    staged = 4 * q + c
    return (clamp(staged, groups - 1) if groups % 4 else staged), staged


def pair_capacity(rows: int, top_k: int) -> int:
    return rows * top_k


def grouped_smem(depth: int, rows: int, top_k: int, cfg: GroupedConfig) -> int:
    """Shared memory of a grouped CTA: the staged tile, the pair list, the ballot counts."""
    _, pitch = grouped_steps(depth)
    cap = pair_capacity(rows, top_k)
    counts = -(-cap // (32 * cfg.warps)) * cfg.warps
    return 16 * TILE_TOKENS * pitch + 4 * cap + 4 * counts + 64


def config(stage: str, latent: int, inter: int, top_k: int, batch_bucket: int):
    """FC1: 4 warps; at one row 1 row per warp with cp.async (the H200 sweep of 2026-11-29 at
    the TP16 rank: 11.75 µs per call vs 13.26 for the plain 4 x 2; BENCHMARKS.md session 6),
    above it plain with 2 rows per warp while a lane's loads stay <= 16 vectors (L <= 4096),
    else 1 (the sweep's best or within 1% at 8-64 rows; grouped FC1 lost at 16-64); with the
    fp16 decode at 8 rows and more, 8 warps of 1 row (the sweeps of sessions 27 and 29).
    FC2: R·k >= 128 threads where k allows, whole warps (R a multiple of 32 for odd k); at one
    row two threads per W2 row where the row allows (`fc2_splits`; the H100 A/B of 2026-12-06 at
    the TP16 rank: 11.45 µs per expert step against 12.55, -8.8%; +3% and +5% at 2 and 4 rows)."""
    if stage == "fc1g":  # 64 rows of W1 and of W3 per CTA (3 row tiles at I 192), 4 steps ahead
        # one expert per CTA in both (H100, session 41, 64 rows: 321 µs against 361 with 4 fc1g
        # experts per CTA, 394 with 8 fc2g experts too, 403 with 2 steps ahead as well)
        return GroupedConfig(4, 1, 4, batch_bucket, 1)
    if stage == "fc2g":  # 256 rows of W2 per CTA (14 row tiles at L 3584)
        return GroupedConfig(4, 4, 2, batch_bucket, 1)
    if stage == "fc1":
        f16 = f16_decode(batch_bucket)
        if batch_bucket == 1 and fc1_fits(latent, cp := FC1Config(4, 1, True, f16)):
            return cp
        if f16 and batch_bucket >= F16_SWEPT_ROWS:
            # the fp16 decode's sweeps (H100): 8 warps x 1 row, 71 registers, the best of 18
            # configs at 32 and 64 rows (2026-12-05: -9.1% / -4.8% against 4 x 2) and at 8 and
            # 16 rows (2026-12-06: 55.25 / 98.88 µs against 59.60 / 107.21 for 4 x 2)
            return FC1Config(8, 1, f16=True)
        return FC1Config(4, 2 if _lane_vectors(latent) <= 4 else 1, f16=f16)
    rows = 64 if top_k <= 2 else 32 if top_k <= 4 or top_k % 2 else 16
    f16 = f16_decode(batch_bucket) and inter <= 32 * ROW_VECTORS
    split = 2 if batch_bucket == 1 and fc2_splits(inter) else 1
    return FC2Config(rows, fc2_threads(rows, top_k, split), f16, split)


def fc2_threads(rows: int, top_k: int, split: int = 1) -> int:
    """FC2's block: R·k·split threads in whole warps."""
    return -(-rows * top_k * split // 32) * 32


def fc2_splits(inter: int) -> bool:
    """Whether FC2 can take two threads per W2 row (`FC2Config.split`): the whole row in
    registers (I <= 512) and an even number of 32-input groups."""
    return inter <= 32 * ROW_VECTORS and inter // 32 % 2 == 0


def f16_decode(batch_bucket: int) -> bool:
    """Whether the bucket's FC1 and FC2 decode into packed fp16 math (K3_MOE_F16)."""
    if KERNELS.moe_f16 is None:
        return batch_bucket >= F16_AUTO_ROWS
    return KERNELS.moe_f16


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
    """FC1's shared memory per CTA: z as fp32 (with `f16` as fp16 and the warps' |z| maxima),
    and with cp.async every lane's 16-byte vector of every lane step, row and matrix
    (47 KB at L 3584 with 4 warps of 2 rows)."""
    z = 2 * latent + 4 * cfg.warps + 64 if cfg.f16 else 4 * latent + 64
    if not cfg.cp_async:
        return z
    m, split = _lane_steps(latent)
    return z + 16 * 32 * 2 * cfg.rows_per_warp * (m + split) * cfg.warps


def fc2_smem(inter: int, top_k: int, cfg: FC2Config) -> int:
    """FC2's shared memory per CTA: token n's k act rows (fp32, or `f16` fp16 pairs, rows
    padded by 16 bytes), the R·k weighted products to sum, `f16`'s k maxima."""
    pitch = (inter // 2 if cfg.f16 else inter) + 4
    return 4 * top_k * (pitch + cfg.rows_per_cta + cfg.f16) + 64


def fc1_fits(latent: int, cfg: FC1Config) -> bool:
    return 32 <= cfg.threads <= 1024 and fc1_smem(latent, cfg) <= SMEM_BYTES


def _lane_vectors(latent: int) -> int:
    return -(-(latent // 32) // 32)


def refusal(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
            w2_scale, *_) -> str | None:
    """Why the kernels cannot take operands that meet the op's constraints
    (`k3compile.ops.moe_experts.moe_experts_refusal`, which the pattern checks first), or None:
    the kernels' own limits.
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
        if t.dtype != torch.uint8:
            return f"{name}: {t.dtype} (want uint8)"
    for name, t in (("w2_packed", w2_packed), ("w2_scale", w2_scale)):
        if not t.is_contiguous():
            return f"{name}: strides {t.stride()} (want contiguous)"
    if n_exp < 1:
        return "no experts"
    rows = fc1_expert_rows(w1_packed, w1_scale, w3_packed, w3_scale)
    return rows if isinstance(rows, str) else None


def fc1_expert_rows(w1_packed, w1_scale, w3_packed, w3_scale) -> int | str:
    """The rows from one expert's first W1 / W3 row to the next's, one for all four tensors:
    I where each is contiguous [E, I, ·], 2I where W1 and W3 are the halves of a fused gate_up
    [E, 2I, ·] (a spelling's `w13[:, :I]`, `w13[:, I:]`: the kernels then read each half in
    place, so an update of the fused Parameter is seen); or why the kernels cannot take them.
    Metadata only."""
    n_exp, inter = w1_packed.shape[:2]
    found = set()
    for name, t in (("w1_packed", w1_packed), ("w1_scale", w1_scale), ("w3_packed", w3_packed),
                    ("w3_scale", w3_scale)):
        width = t.shape[-1]
        if t.stride(-1) != 1 or (inter > 1 and t.stride(1) != width):
            return f"{name}: strides {t.stride()} (want rows of {width} contiguous bytes)"
        if n_exp > 1:
            if t.stride(0) % width or t.stride(0) // width < inter:
                return f"{name}: expert stride {t.stride(0)} (want whole rows, >= {inter})"
            found.add(t.stride(0) // width)
    if len(found) > 1:
        return f"w1 / w3: expert strides of {sorted(found)} rows (want one for all four)"
    return found.pop() if found else inter


def can_implement(*args) -> bool:
    """Whether the kernels take this call's operands: the op's constraints and their limits."""
    return moe_experts_refusal(*args) is None and refusal(*args) is None


def prepare(latent: int, inter: int, top_k: int, buckets=(1, 2, 4, 8, 16, 32, 64),
            ids_dtype=torch.int64, out_fp32: bool = False) -> None:
    """Compile the stages of every batch bucket (call before graph capture): FC1 and FC2,
    or where `grouped` takes the bucket, the grouped FC1, FC2 and the sum."""
    ids64 = ids_dtype == torch.int64
    store = {"out_fp32": True} if out_fp32 else {}
    for b in buckets:
        if grouped(b):
            for stage in ("fc1g", "fc2g", "fin"):
                cfg = None if stage == "fin" else config(stage, latent, inter, top_k, b)
                KERNEL.compiled(stage, latent, inter, top_k, ids64, cfg, rows=b,
                                pdl=None if stage == "fc1g" else False,
                                **(store if stage == "fin" else {}))
            continue
        for stage in ("fc1", "fc2"):
            cfg = config(stage, latent, inter, top_k, b)
            if stage == "fc1" and by_expert(b, latent):
                stage, cfg = "fc1e", by_expert_config(cfg, b)
            KERNEL.compiled(stage, latent, inter, top_k, ids64, cfg, rows=b,
                            pdl=None if stage != "fc2" else False,
                            **(store if stage == "fc2" else {}))


def build(stage, latent, inter, top_k, ids64, cfg, arch=None, dump_dir=None, pdl=False,
          out_fp32=False, expert_rows=0):
    """Compile one stage now, uncached (`dump_dir` keeps the cubin; `pdl`: FC1 launched with
    PDL after the previous kernel; `out_fp32`: FC2 / the grouped sum store u in fp32;
    `expert_rows`: FC1's rows per expert in W1 / W3, `fc1_expert_rows`, where not I)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    bf16, i32, u8 = cutlass.BFloat16, cutlass.Int32, cutlass.Uint8
    n, pairs, rows = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def dense(dtype, n_rows, width, align, row_stride=None):
        stride = (width if row_stride is None else row_stride, 1)
        return make_fake_tensor(dtype, (n_rows, width), stride=stride, assumed_align=align)

    ids = dense(cutlass.Int64 if ids64 else i32, n, top_k, 8 if ids64 else 4, cute.sym_int())
    u = cutlass.Float32 if out_fp32 else bf16
    if stage in ("fc1g", "fc2g", "fin"):
        return _build_grouped(stage, latent, inter, top_k, cfg, ids, dense, arch, dump_dir, pdl,
                              u, expert_rows)
    from .device.moe_experts import FC1, FC2

    if stage in ("fc1", "fc1e"):  # act as (N·k, I) rows
        w, s = dense(i32, rows, latent // 8, 16), dense(u8, rows, latent // 32, 1)
        if stage == "fc1e":
            from .device.moe_experts_by_expert import FC1ByExpert

            host = FC1ByExpert(latent, inter, top_k, cfg.fc1, cfg.rows, cfg.tokens,
                               cfg.min_blocks, cfg.experts_per_cta, pdl, expert_rows)
        else:
            host = FC1(latent, inter, top_k, cfg, pdl, expert_rows)
        return compile_kernel(host, fake_rows(bf16, n, latent), ids,
                              w, s, w, s, dense(bf16, pairs, inter, 16), cutlass.Float32(4.0),
                              cutlass.Float32(25.0), fake_stream(), arch=arch, dump_dir=dump_dir)
    return compile_kernel(FC2(latent, inter, top_k, cfg), dense(bf16, n, top_k * inter, 16),
                          ids, dense(cutlass.Float32, n, top_k, 4, cute.sym_int()),
                          dense(i32, rows, inter // 8, 16), dense(u8, rows, inter // 32, 1),
                          fake_rows(u, n, latent), fake_stream(), arch=arch,
                          dump_dir=dump_dir)


def _build_grouped(stage, latent, inter, top_k, cfg, ids, dense, arch, dump_dir, pdl, u,
                   expert_rows=0):
    import cutlass
    from cutlass import cute

    from .device.moe_experts_grouped import Finalize, GroupedMMA

    bf16, i32, u8, f32 = cutlass.BFloat16, cutlass.Int32, cutlass.Uint8, cutlass.Float32
    n, pairs, rows = cute.sym_int(), cute.sym_int(), cute.sym_int()
    if stage == "fin":
        return compile_kernel(Finalize(latent, top_k), dense(bf16, pairs, latent, 16),
                              dense(f32, n, top_k, 4, cute.sym_int()),
                              fake_rows(u, n, latent), fake_stream(), arch=arch,
                              dump_dir=dump_dir)
    fc1 = stage == "fc1g"
    depth, out = (latent, inter) if fc1 else (inter, latent)
    x = fake_rows(bf16, n, latent) if fc1 else dense(bf16, pairs, inter, 16)
    w, s = dense(i32, rows, depth // 8, 16), dense(u8, rows, depth // 32, 1)
    host = GroupedMMA(fc1, latent, inter, top_k, cfg.rows, cfg, pdl and fc1,
                      expert_rows if fc1 else 0)
    return compile_kernel(host, x, ids, w, s, w, s, dense(bf16, pairs, out, 16),
                          f32(4.0), f32(25.0), fake_stream(), arch=arch, dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def _words(packed: torch.Tensor) -> torch.Tensor:
    """[E, O, W] uint8 (contiguous) -> [E·O, W/4] int32 (a view)."""
    return packed.view(torch.int32).view(-1, packed.shape[-1] // 4)


def expert_rows_view(t: torch.Tensor, expert_rows: int) -> torch.Tensor:
    """[E, O, W] uint8 whose experts start `expert_rows` rows apart (rows contiguous) -> the
    rows [(E - 1)·expert_rows + O, W] in place, starting at t's first row (a view: the rows of
    other tensors between the experts are in it and never read)."""
    n_exp, rows, width = t.shape
    return t.as_strided(((n_exp - 1) * expert_rows + rows, width), (width, 1))


def fc1_operands(w1_packed, w1_scale, w3_packed, w3_scale, latent: int):
    """(W1 words, W1 scales, W3 words, W3 scales, the build option of their expert stride):
    FC1's operands, read in place (`fc1_expert_rows`)."""
    inter = w1_packed.shape[1]
    rows = fc1_expert_rows(w1_packed, w1_scale, w3_packed, w3_scale)
    if rows == inter:
        return (_words(w1_packed), w1_scale.view(-1, latent // 32), _words(w3_packed),
                w3_scale.view(-1, latent // 32), {})
    return (expert_rows_view(w1_packed, rows).view(torch.int32),
            expert_rows_view(w1_scale, rows), expert_rows_view(w3_packed, rows).view(torch.int32),
            expert_rows_view(w3_scale, rows), {"expert_rows": rows})


def moe_experts_cuda(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                     w2_scale, beta, linear_beta, out_fp32=False, *, out=None):
    """k3::moe_experts with the two kernels, or the reference (reason logged) when they refuse
    the inputs. `out` [N, L] bf16 (fp32 with `out_fp32`; last dim contiguous) is written only
    when the kernels run."""
    args = (z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
    return KERNEL.run(lambda: call_refusal(args, out, out_fp32),
                      lambda: moe_experts_ref(*args, beta, linear_beta, out_fp32),
                      lambda: _launch(args, beta, linear_beta, out, out_fp32),
                      z, w1_packed, w3_packed, w2_packed)


def call_refusal(args, out, out_fp32=False) -> str | None:
    """Why the kernels cannot take this call (the nine tensor operands `args`, `out`), or None."""
    z = args[0]
    if reason := moe_experts_refusal(*args) or refusal(*args):
        return reason
    if not all(t.is_cuda for t in args):
        return "not on a CUDA device"
    if out is not None and (
            out.dtype != (torch.float32 if out_fp32 else torch.bfloat16)
            or out.shape != z.shape or out.stride(-1) != 1
            or out.stride(0) % 8 or not aligned16(out)):
        return f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
    return None


def _launch(args, beta, linear_beta, out, out_fp32=False):
    z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale = args
    (n, latent), top_k, inter = z.shape, ids.shape[-1], w1_packed.shape[1]
    dtype = torch.float32 if out_fp32 else z.dtype
    y = z.new_empty((n, latent), dtype=dtype) if out is None else out
    store = {"out_fp32": True} if out_fp32 else {}  # the plain builds keep their compile keys
    if n and grouped(n):
        _launch_grouped(args, beta, linear_beta, y, store)
    elif n:
        b, ids64 = bucket(n), ids.dtype == torch.int64
        act = z.new_empty((n * top_k, inter))
        stage, fc1 = "fc1", config("fc1", latent, inter, top_k, b)
        if by_expert(n, latent):  # act written by expert, the same bits (K3_MOE_BY_EXPERT)
            stage, fc1 = "fc1e", by_expert_config(fc1, b)
        *fc1_args, strided = fc1_operands(w1_packed, w1_scale, w3_packed, w3_scale, latent)
        KERNEL.compiled(stage, latent, inter, top_k, ids64, fc1, rows=b, **strided)(
            z, ids, *fc1_args, act, float(beta), float(linear_beta))
        # FC2 always follows FC1 with PDL (its own build has no switch)
        KERNEL.compiled("fc2", latent, inter, top_k, ids64,
                        config("fc2", latent, inter, top_k, b), pdl=False, **store)(
            act.view(n, top_k * inter), ids, weights, _words(w2_packed),
            w2_scale.view(-1, inter // 32), y)
    return y


def _launch_grouped(args, beta, linear_beta, y, store):
    """FC1 + SiTU by expert -> act [N·k, I]; FC2 by expert -> y per pair [N·k, L] (bf16, as the
    reference rounds it); the weighted sum over k. FC2 and the sum launch with PDL."""
    z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale = args
    (n, latent), top_k, inter = z.shape, ids.shape[-1], w1_packed.shape[1]
    b, ids64 = bucket(n), ids.dtype == torch.int64
    act = z.new_empty((n * top_k, inter))
    y_pairs = z.new_empty((n * top_k, latent))
    scalars = (latent, inter, top_k, ids64)
    *fc1_args, strided = fc1_operands(w1_packed, w1_scale, w3_packed, w3_scale, latent)
    KERNEL.compiled("fc1g", *scalars, config("fc1g", latent, inter, top_k, b), rows=b,
                    **strided)(z, ids, *fc1_args, act, float(beta), float(linear_beta))
    w2, s2 = _words(w2_packed), w2_scale.view(-1, inter // 32)
    KERNEL.compiled("fc2g", *scalars, config("fc2g", latent, inter, top_k, b), pdl=False)(
        act, ids, w2, s2, w2, s2, y_pairs, float(beta), float(linear_beta))
    KERNEL.compiled("fin", *scalars, None, pdl=False, **store)(y_pairs, weights, y)


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", moe_experts_cuda)
