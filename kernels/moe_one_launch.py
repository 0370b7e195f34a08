"""K3_KERNELS_EXTRA=moe_one_launch: `k3::moe_experts` at 1..MAX_ROWS rows in one launch, FC1 +
SiTU and FC2 + finalize in one grid (kernels/device/moe_one_launch.py), bit for bit the two
launches of kernels/moe_experts.py (same device code, same configs but the block size).

    u[n] = bf16(Σ_j w[n,j]·bf16(SiTU(bf16(z[n]·W1[e]ᵀ), bf16(z[n]·W3[e]ᵀ))·W2[e]ᵀ)), e = ids[n,j]

Each CTA takes a ticket from a global counter: FC1 items first, then FC2 items, which wait for
their token's FC1 items only (a count per token). The counters are this stream's slot of
kernels/common/last_cta.py, reset by the last CTA. Opt-in until its GPU tests pass on the H200
(tests/fusions/test_moe_one_launch_kernel.py); registered after KERNELS, it replaces the
two-launch CUDA implementation and hands it every call it refuses. Design: docs/kernels.md,
moe_experts, 2026-12-04.

Constraints (besides kernels/moe_experts.py's):
    * 1 <= N <= MAX_ROWS (a count per token in the stream's counter slot); not where
      K3_MOE_GROUPED takes the rows (`moe_experts.grouped`), not with K3_MOE_F16.
    * One block size (`configs`); both bodies' shared memory in one CTA (<= 227 KB).
"""

import dataclasses

import torch

from k3compile.ops import registry

from . import moe_experts
from .common.dsl import bucket, compile_kernel, fake_rows, fake_stream, log
from .common.last_cta import counter
from .common.launch import Kernel

OP = "moe_experts"
NAME = "moe_one_launch"
MAX_ROWS = 8
# the rows a call is taken at: the 2-row hang of session 17 (the FC2 items' arrivals on the ticket
# word) is fixed (`arrival_word`: the H200's GPU tests pass at 1, 2 and 8 rows, session 18), but
# one launch loses to the two at every row count (top-16: 1 row 16.4 vs 11.2 µs, 2 rows 24.5 vs
# 19.3, 8 rows 82.6 vs 58.4); docs/kernels.md
TAKEN_ROWS = 1
TICKET_BYTES = 16  # the ticket's shared word, padded to the bodies' 16-byte alignment
# The stream's counter slot (kernels/common/last_cta.py) at N rows: word TICKET_WORD takes the
# tickets, words 1..N the tokens' counts of finished FC1 items, `arrival_word(N)` the FC2 items'
# arrivals, `arrivals` of them complete it (n_rows: an int, or the kernel's Int32). The arrivals
# have a word of their own: an FC2 item can finish before the grid's last CTA takes its ticket
# (at 2+ rows the FC2 items outnumber the CTAs an H200 holds at once), and an arrival on the
# ticket word gave that CTA a ticket past the grid's items, waiting on a count no FC1 item adds
# to (the hang of 2026-12-04; tests/fusions/test_moe_one_launch_protocol.py models it).
TICKET_WORD = 0


def arrival_word(n_rows):
    return 1 + n_rows


def arrivals(n_rows, fc1_per_token, blocks2):
    """The arrivals on `arrival_word` that make the last one: every FC2 item's (each took its
    ticket before, after every FC1 ticket, so the last arrival follows every ticket)."""
    return n_rows * blocks2


def slot_words(n_rows: int) -> int:
    return 2 + n_rows


def configs(latent: int, inter: int, top_k: int, batch_bucket: int, block: str = "fc1"):
    """(FC1Config, FC2Config): the two launches' configs of this bucket in one block size.
    `block` "fc1" (the default, not measured against "fc2"): FC1's, FC2 taking at most
    threads / k output rows per CTA (k = 16: 8 rows, not 16; its threads past R·k mirror the
    last and write nothing); "fc2": FC2's where it is larger, FC1 with threads / 32 warps (FC1's
    2-8 row config then holds one CTA of 130 registers x 256 threads per SM). A thread's dot
    and a row's sum over j do not depend on R, nor a warp's rows on the warps: the values are
    the two launches' either way."""
    fc1 = moe_experts.config("fc1", latent, inter, top_k, batch_bucket)
    fc2 = moe_experts.config("fc2", latent, inter, top_k, batch_bucket)
    if fc2.split != 1:  # one thread per W2 row here (the block size is FC1's or FC2's)
        fc2 = dataclasses.replace(fc2, split=1,
                                  threads=moe_experts.fc2_threads(fc2.rows_per_cta, top_k))
    if block == "fc2" and fc2.threads > fc1.threads:
        wide = dataclasses.replace(fc1, warps=fc2.threads // 32)
        if moe_experts.fc1_fits(latent, wide):
            return wide, fc2
    rows = min(fc2.rows_per_cta, max(fc1.threads // top_k, 1))
    return fc1, dataclasses.replace(fc2, rows_per_cta=rows, threads=fc1.threads)


def shared_bytes(latent: int, inter: int, top_k: int, fc1_cfg, fc2_cfg) -> int:
    """Shared memory of a CTA: the ticket, then FC1's and FC2's (the DSL places the two bodies'
    buffers one after the other, though a CTA runs one body)."""
    return (TICKET_BYTES + moe_experts.fc1_smem(latent, fc1_cfg)
            + moe_experts.fc2_smem(inter, top_k, fc2_cfg))


def refusal(n_rows: int, latent: int, inter: int, top_k: int, block: str = "fc1") -> str | None:
    """Why one launch does not take n_rows rows of a call the two launches take, or None."""
    if not 1 <= n_rows <= MAX_ROWS:
        return f"{n_rows} rows (one launch takes 1..{MAX_ROWS})"
    if moe_experts.grouped(n_rows) or moe_experts.f16_decode(bucket(n_rows)):
        return "K3_MOE_GROUPED or K3_MOE_F16 takes these rows"
    fc1, fc2 = configs(latent, inter, top_k, bucket(n_rows), block)
    if fc2.rows_per_cta * top_k > fc2.threads or fc1.threads != fc2.threads:
        return f"top_k {top_k}: no one block size ({fc1}, {fc2})"
    if (smem := shared_bytes(latent, inter, top_k, fc1, fc2)) > moe_experts.SMEM_BYTES:
        return f"{smem} B of shared memory"
    return None


def build(latent, inter, top_k, ids64, fc1_cfg, fc2_cfg, arch=None, dump_dir=None, pdl=False,
          expert_rows=0):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL;
    `expert_rows`: moe_experts' `fc1_expert_rows` where not I)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from .device.moe_one_launch import MoEOneLaunch

    bf16, f32, i32, u8 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32, cutlass.Uint8
    n, pairs, rows, rows2 = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()

    def dense(dtype, n_rows, width, align, row_stride=None):
        stride = (width if row_stride is None else row_stride, 1)
        return make_fake_tensor(dtype, (n_rows, width), stride=stride, assumed_align=align)

    ids = dense(cutlass.Int64 if ids64 else i32, n, top_k, 8 if ids64 else 4, cute.sym_int())
    w1, s1 = dense(i32, rows, latent // 8, 16), dense(u8, rows, latent // 32, 1)
    w2, s2 = dense(i32, rows2, inter // 8, 16), dense(u8, rows2, inter // 32, 1)
    count = make_fake_tensor(i32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    return compile_kernel(
        MoEOneLaunch(latent, inter, top_k, fc1_cfg, fc2_cfg, pdl, expert_rows), fake_rows(bf16, n, latent),
        ids, dense(f32, n, top_k, 4, cute.sym_int()), w1, s1, w1, s1, w2, s2,
        dense(bf16, pairs, inter, 16), dense(bf16, n, top_k * inter, 16),
        fake_rows(bf16, n, latent), count, f32(4.0), f32(25.0), fake_stream(), arch=arch,
        dump_dir=dump_dir)


KERNEL = Kernel(NAME, build)


def compiled(latent: int, inter: int, top_k: int, ids64: bool, n_rows: int, block: str,
             **strided):
    b = bucket(n_rows)
    return KERNEL.compiled(latent, inter, top_k, ids64,
                           *configs(latent, inter, top_k, b, block), rows=b, **strided)


def moe_one_launch_cuda(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                        w2_scale, beta, linear_beta, out_fp32=False, *, out=None,
                        block: str = "fc1"):
    """k3::moe_experts in one launch, or `moe_experts.moe_experts_cuda`: for rows or settings
    one launch does not take (logged at debug level; not a fallback, the two launches run), or
    a call the kernels refuse (the two launches' fallback, logged and counted there).
    `block`: `configs`' (benchmarks/moe_one_launch.py times both)."""
    args = (z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
    (n, latent), top_k, inter = z.shape, ids.shape[-1], w1_packed.shape[1]

    def two_launches():
        return moe_experts.moe_experts_cuda(*args, beta, linear_beta, out_fp32, out=out)

    if out_fp32 or moe_experts.call_refusal(args, out) is not None:  # one launch writes bf16
        return two_launches()
    if reason := (refusal(n, latent, inter, top_k, block)
                  or (f"{n} rows (taken at 1..{TAKEN_ROWS}: slower than two launches on the H200)"
                      if n > TAKEN_ROWS else None)):
        log.debug("k3::%s: %s: the two launches", NAME, reason)
        return two_launches()
    count = []  # this stream's counter words, found once the call is taken

    def why():
        count.append(counter(z.device, slot_words(n)))
        return count[0] if isinstance(count[0], str) else None

    def launch():
        y = z.new_empty((n, latent)) if out is None else out
        act = z.new_empty((n * top_k, inter))
        *fc1_args, strided = moe_experts.fc1_operands(w1_packed, w1_scale, w3_packed, w3_scale,
                                                      latent)
        compiled(latent, inter, top_k, ids.dtype == torch.int64, n, block, **strided)(
            z, ids, weights, *fc1_args, moe_experts._words(w2_packed),
            w2_scale.view(-1, inter // 32), act, act.view(n, top_k * inter), y, count[0],
            float(beta), float(linear_beta))
        return y

    return KERNEL.run(why, two_launches, launch, z, w1_packed, w3_packed, w2_packed, op=NAME)


def prepare(latent: int, inter: int, top_k: int, buckets=(1, 2, 4, 8),
            ids_dtype=torch.int64) -> None:
    """Compile the one-launch kernel of each bucket up to MAX_ROWS (call before graph capture)."""
    for b in buckets:
        if refusal(b, latent, inter, top_k) is None:
            compiled(latent, inter, top_k, ids_dtype == torch.int64, b, "fc1")


def register() -> None:
    registry.register_kernel(OP, refusal=moe_experts.refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", moe_one_launch_cuda)
