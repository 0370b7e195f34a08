"""CuTe DSL kernel for `k3::rms_norm` (the routed-latent norm, spec §3.3 step 6).

    y = bf16(w · bf16(x · rsqrt(mean(x²) + eps)))        (K3's order: normalise, cast, weight)

One CTA per row (docs/kernels.md, rms_norm).

`rms_norm_fp32_weight_cuda`: the same kernel's `fp32_weight` build for
`k3compile.math.rms_norm_fp32_weight` (norm_linear's `weight_fp32`): x bf16 or fp32, the weight
bf16 or fp32, multiplied in fp32 before the one rounding to bf16.

Constraints:
    * x bf16 [N, D], contiguous rows, row stride a multiple of 8 elements, 16-byte-aligned data;
      weight bf16 [D] contiguous; eps is a runtime scalar. `fp32_weight`: x and the weight bf16
      or fp32 (rows 16-byte aligned), y bf16.
    * D % 8 == 0 and 8 <= D <= 32768.
    * With PDL (settings.KERNELS.pdl): w loads before `griddepcontrol.wait`, x after it.
"""

from dataclasses import dataclass

import torch

from k3compile.math import rms_norm_fp32_weight
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


def fp32_weight_refusal(x, weight, dtype) -> str | None:
    """Why the `fp32_weight` build cannot take this call (metadata only), or None."""
    dim = x.shape[-1]
    if dim % 8 or not 8 <= dim <= MAX_DIM:
        return f"width {dim} (want a multiple of 8 in [8, {MAX_DIM}])"
    if dtype != torch.bfloat16:
        return f"output {dtype} (want bf16)"
    if x.dtype not in (torch.bfloat16, torch.float32):
        return f"x: {x.dtype} (want bf16 or fp32)"
    if why := rows_ok(x, dim, x.dtype):
        return f"x: {why}"
    if (weight.dtype not in (torch.bfloat16, torch.float32) or weight.shape != (dim,)
            or not weight.is_contiguous()):
        return f"weight: {weight.dtype} {tuple(weight.shape)} (want contiguous bf16 or fp32 [{dim}])"
    return None


def prepare(dim: int, buckets=BUCKETS) -> None:
    """Compile the kernel of every batch bucket for this width (call before graph capture)."""
    for b in buckets:
        KERNEL.compiled(dim, config(dim, b), rows=b)


def build(dim, cfg, arch=None, dump_dir=None, pdl=False, fp32_weight=False, x_fp32=False,
          w_fp32=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL;
    `fp32_weight`: the weight multiplied in fp32 before the one rounding, x / the weight fp32
    with `x_fp32` / `w_fp32`)."""
    import cutlass
    from cutlass import cute

    from .device.rms_norm import RMSNorm

    bf16, f32, n = cutlass.BFloat16, cutlass.Float32, cute.sym_int()
    host = RMSNorm(dim, cfg, pdl, fp32_weight, x_fp32, w_fp32)
    return compile_kernel(host, fake_rows(f32 if x_fp32 else bf16, n, dim),
                          fake_vector(f32 if w_fp32 else bf16, dim),
                          fake_rows(bf16, n, dim, dim), f32(1e-5), fake_stream(), arch=arch,
                          dump_dir=dump_dir)


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


def rms_norm_fp32_weight_cuda(x, weight, eps, dtype):
    """`math.rms_norm_fp32_weight` (x [N, D] -> dtype) with the `fp32_weight` build, or the
    reference (logged as a fallback of rms_norm[fp32_weight]) where it refuses."""
    def launch():
        n, dim = x.shape
        y = torch.empty((n, dim), dtype=dtype, device=x.device)
        if n:
            b = bucket(n)
            KERNEL.compiled(dim, config(dim, b), rows=b, fp32_weight=True,
                            x_fp32=x.dtype == torch.float32,
                            w_fp32=weight.dtype == torch.float32)(x, weight, y, float(eps))
        return y

    return KERNEL.run(lambda: fp32_weight_refusal(x, weight, dtype),
                      lambda: rms_norm_fp32_weight(x, weight, eps, dtype), launch, x, weight,
                      op=f"{OP}[fp32_weight]")


def register() -> None:
    registry.register_kernel(OP, refusal=flat_refusal(refusal))
    torch.library.register_kernel(f"k3::{OP}", "cuda", flat_rows(rms_norm_cuda))
