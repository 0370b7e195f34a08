"""CuTe DSL kernel for `k3::rms_norm` (the routed-latent norm, spec §3.3 step 6).

    y = bf16(w · bf16(x · rsqrt(mean(x²) + eps)))        (K3's order: normalise, cast, weight)

One CTA per row (docs/kernels.md, rms_norm).

Constraints:
    * x bf16 [N, D], contiguous rows, row stride a multiple of 8 elements, 16-byte-aligned data;
      weight bf16 [D] contiguous; eps is a runtime scalar.
    * D % 8 == 0 and 8 <= D <= 32768.
    * With PDL (settings.KERNELS.pdl): w loads before `griddepcontrol.wait`, x after it.
"""

from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.rms_norm import rms_norm_ref

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

OP = "rms_norm"
MAX_DIM = 32768


@dataclass(frozen=True)
class Config:
    threads: int
    vec_per_thread: int


def config(dim: int, batch_bucket: int) -> Config:
    """Batch <= 8: one 16-byte vector per thread (most loads in flight per row); larger batches:
    up to 4 per thread (fewer warps per reduction, same bytes)."""
    return Config(*pick_threads(dim // 8, 1 if batch_bucket <= 8 else 4))


def can_implement(x, weight) -> bool:
    return refusal(x, weight) is None


def refusal(x, weight, *_) -> str | None:
    dim = x.shape[-1]
    if dim % 8 or not 8 <= dim <= MAX_DIM:
        return f"width {dim} (want a multiple of 8 in [8, {MAX_DIM}])"
    if why := rows_ok(x, dim, torch.bfloat16):
        return f"x: {why}"
    if weight.dtype != torch.bfloat16 or weight.shape != (dim,) or not weight.is_contiguous():
        return f"weight: {weight.dtype} {tuple(weight.shape)} (want contiguous bf16 [{dim}])"
    return None


def prepare(dim: int, buckets=BUCKETS) -> None:
    """Compile the kernel of every batch bucket for this width (call before graph capture)."""
    for b in buckets:
        KERNEL.compiled(dim, config(dim, b), rows=b)


def build(dim, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute

    from .device.rms_norm import RMSNorm

    bf16, n = cutlass.BFloat16, cute.sym_int()
    return compile_kernel(RMSNorm(dim, cfg, pdl), fake_rows(bf16, n, dim),
                          fake_vector(bf16, dim), fake_rows(bf16, n, dim, dim),
                          cutlass.Float32(1e-5), fake_stream(), arch=arch, dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def rms_norm_cuda(x, weight, eps, *, out=None):
    """CUDA implementation of k3::rms_norm: the kernel, or the reference if refused."""
    def launch():
        n, dim = x.shape
        y = torch.empty((n, dim), dtype=x.dtype, device=x.device) if out is None else out
        if n:
            b = bucket(n)
            KERNEL.compiled(dim, config(dim, b), rows=b)(x, weight, y, float(eps))
        return y

    return KERNEL.run(lambda: refusal(x, weight), lambda: rms_norm_ref(x, weight, eps), launch,
                      x, weight)


def register() -> None:
    registry.register_kernel(OP, refusal=flat_refusal(refusal))
    torch.library.register_kernel(f"k3::{OP}", "cuda", flat_rows(rms_norm_cuda))
