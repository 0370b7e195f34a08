"""CuTe DSL kernel for `k3::mla_lowrank_norm`: both Gated-MLA low-rank norms in one launch
(spec §3.2 step 2).

    q = bf16(wq·bf16(cq·rstd(cq)));  kv = bf16(wkv·bf16(c·rstd(c))), c = ckv[:, :C];
    pe = ckv[:, C:]                                     (copied, never rotated: K3 is NoPE)
    (`weight_fp32`: q = bf16(cq·rstd(cq)·wq), kv likewise, one rounding: a build of its own)

Design: docs/kernels.md, mla_lowrank_norm.

Constraints:
    * bf16; cq [N, Q] and ckv [N, C + R] with contiguous rows, row strides multiples of 8 elements
      and 16-byte-aligned data (column slices of the fused q_a|kv_a GEMM output qualify);
      q_weight [Q], kv_weight [C] contiguous; eps is a runtime scalar.
    * Q, C, R multiples of 8 (so k_pe starts 16-byte aligned), 8 <= Q, C <= 8192, 0 <= R <= 8192.
    * With PDL (settings.KERNELS.pdl): the norm weights load before `griddepcontrol.wait`.
    * `weight_fp32` is a build option (in the key only when set: the plain builds and their keys
      are unchanged); built for sm_90a, not yet run on a GPU (session 26), so the patterns leave
      its sites to Inductor on GPU graphs (`patterns/mla_lowrank_norm.py`).
"""

from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.mla_lowrank_norm import mla_lowrank_norm_ref

from .common.dsl import (
    BUCKETS,
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
    fake_vector,
    flat_refusal,
    flat_rows,
    pick_threads,
    rows_ok,
)
from .common.launch import Kernel

OP = "mla_lowrank_norm"
MAX_DIM = 8192


@dataclass(frozen=True)
class Config:
    threads: int


def config(q_dim: int, c_dim: int, r_dim: int, batch_bucket: int) -> Config:
    """The widest part sets the thread count: one vector of it per thread at batch <= 8, up to
    three (fewer warps, same loads in flight) above."""
    widest = max(q_dim, c_dim, r_dim) // 8
    return Config(pick_threads(widest, 1 if batch_bucket <= 8 else 3)[0])


def can_implement(cq, ckv, q_weight, kv_weight) -> bool:
    return refusal(cq, ckv, q_weight, kv_weight) is None


def refusal(cq, ckv, q_weight, kv_weight, *_) -> str | None:
    q_dim, c_dim = cq.shape[-1], kv_weight.shape[0]
    r_dim = ckv.shape[-1] - c_dim
    if any(d % 8 for d in (q_dim, c_dim, r_dim)) or not (
            8 <= q_dim <= MAX_DIM and 8 <= c_dim <= MAX_DIM and 0 <= r_dim <= MAX_DIM):
        return f"widths q {q_dim}, c {c_dim}, r {r_dim} (multiples of 8, at most {MAX_DIM})"
    bf16 = torch.bfloat16
    if why := rows_ok(cq, q_dim, bf16) or rows_ok(ckv, c_dim + r_dim, bf16):
        return why
    if cq.shape[0] != ckv.shape[0]:
        return "cq and ckv row counts differ"
    for name, w, d in [("q_weight", q_weight, q_dim), ("kv_weight", kv_weight, c_dim)]:
        if w.dtype != bf16 or w.shape != (d,) or not w.is_contiguous():
            return f"{name}: {w.dtype} {tuple(w.shape)} (want contiguous bf16 [{d}])"
    return None


def prepare(q_dim: int, c_dim: int, r_dim: int, buckets=BUCKETS, weight_fp32: bool = False
            ) -> None:
    """Compile the kernel of every batch bucket for these widths (call before graph capture)."""
    for b in buckets:
        compiled(q_dim, c_dim, r_dim, b, weight_fp32)


def compiled(q_dim: int, c_dim: int, r_dim: int, batch_bucket: int, weight_fp32: bool = False):
    """The cached kernel; `weight_fp32` enters the key only when set (the plain build's key and
    build are those from before the variant)."""
    options = {"weight_fp32": True} if weight_fp32 else {}
    return KERNEL.compiled(q_dim, c_dim, r_dim, config(q_dim, c_dim, r_dim, batch_bucket),
                           rows=batch_bucket, **options)


def build(q_dim, c_dim, r_dim, cfg, arch=None, dump_dir=None, pdl=False, weight_fp32=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL;
    `weight_fp32`: the weights multiplied in fp32 before the one rounding)."""
    import cutlass
    from cutlass import cute

    from .device.mla_lowrank_norm import MLALowRankNorm

    bf16, n = cutlass.BFloat16, cute.sym_int()
    return compile_kernel(
        MLALowRankNorm(q_dim, c_dim, r_dim, cfg, pdl, weight_fp32), fake_rows(bf16, n, q_dim),
        fake_rows(bf16, n, c_dim + r_dim), fake_vector(bf16, q_dim), fake_vector(bf16, c_dim),
        fake_rows(bf16, n, q_dim, q_dim), fake_rows(bf16, n, c_dim, c_dim),
        fake_rows(bf16, n, r_dim, r_dim) if r_dim else None, cutlass.Float32(1e-6),
        fake_stream(), arch=arch, dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def mla_lowrank_norm_cuda(cq, ckv, q_weight, kv_weight, eps, weight_fp32=False, *, out=None):
    """CUDA implementation of k3::mla_lowrank_norm: the kernel, or the reference if refused."""
    c_dim = kv_weight.shape[0]

    def reference():
        return mla_lowrank_norm_ref(cq, ckv, q_weight, kv_weight, eps, weight_fp32)

    def launch():
        (n, q_dim), r_dim = cq.shape, ckv.shape[1] - c_dim
        q, kv, pe = out if out is not None else (
            cq.new_empty((n, q_dim)), cq.new_empty((n, c_dim)), cq.new_empty((n, r_dim)))
        if n:
            compiled(q_dim, c_dim, r_dim, bucket(n), weight_fp32)(
                cq, ckv, q_weight, kv_weight, q, kv, pe if r_dim else None, float(eps))
        return q, kv, pe

    return KERNEL.run(lambda: refusal(cq, ckv, q_weight, kv_weight), reference, launch,
                      cq, ckv, q_weight, kv_weight)


def register() -> None:
    registry.register_kernel(OP, refusal=flat_refusal(refusal))
    torch.library.register_kernel(f"k3::{OP}", "cuda", flat_rows(mla_lowrank_norm_cuda))
