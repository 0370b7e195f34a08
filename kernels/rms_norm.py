"""CuTe DSL kernel for `k3::rms_norm` (the routed-latent norm, spec §3.3 step 6).

    y = bf16(w · bf16(x · rsqrt(mean(x²) + eps)))        (K3's order: normalise, cast, weight)

One CTA per row (docs/kernels.md, rms_norm).

Constraints:
    * x bf16 [N, D], contiguous rows, row stride a multiple of 8 elements, 16-byte-aligned data;
      weight bf16 [D] contiguous; eps is a runtime scalar.
    * D % 8 == 0 and 8 <= D <= 32768.
    * With PDL (settings.KERNELS.pdl): w loads before `griddepcontrol.wait`, x after it.
"""

import functools
from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.norms import rms_norm_ref

from .common.dsl import (
    BUCKETS,
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
    fake_vector,
    flat_refusal,
    flat_rows,
    pdl_launch_dependents,
    pdl_wait,
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


@functools.cache
def _kernel_class():
    import cutlass
    from cutlass import BFloat16, Float32, const_expr, cute

    from .common.copy import (
        load_vectors,
        make_frag,
        row_vectors,
        store_vectors,
        vectors,
    )
    from .common.reduce import block_sum

    class RMSNorm:
        def __init__(self, dim: int, cfg: Config, pdl: bool = False):
            self.dim, self.n_vec, self.pdl = dim, dim // 8, pdl
            self.threads, self.v = cfg.threads, cfg.vec_per_thread
            self.n_warps = cfg.threads // 32

        @cute.jit
        def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32,
                     stream):
            # mX, mY: (N, D); mW: (D,)
            self.kernel(mX, mW, mY, eps).launch(grid=[mX.shape[0], 1, 1],
                                                block=[self.threads, 1, 1],
                                                smem=4 * self.n_warps + 64, stream=stream,
                                                use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32):
            pdl_launch_dependents(self.pdl)
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            T, nv = self.threads, self.n_vec
            smem = cutlass.memory.SmemAllocator()
            sSum = smem.allocate_tensor(Float32, cute.make_layout((self.n_warps, 1)), 16)
            rX, rW = make_frag(BFloat16, self.v), make_frag(BFloat16, self.v)  # (8, V)
            if const_expr(self.pdl):  # the weight first: it loads while the producer of x ends
                load_vectors(vectors(mW), rW, tidx, T, nv)
            pdl_wait(self.pdl)
            load_vectors(row_vectors(mX, row), rX, tidx, T, nv)
            if const_expr(not self.pdl):
                load_vectors(vectors(mW), rW, tidx, T, nv)
            x = rX.load().to(Float32)
            ss = block_sum([(x * x).reduce(cute.ReductionOp.ADD, 0.0, reduction_profile=0)],
                           sSum, self.n_warps)[0]
            rstd = cute.math.rsqrt(ss / self.dim + eps, fastmath=True)
            rX.store(((x * rstd).to(BFloat16).to(Float32) * rW.load().to(Float32)).to(BFloat16))
            store_vectors(rX, row_vectors(mY, row), tidx, T, nv)

    return RMSNorm


def prepare(dim: int, buckets=BUCKETS) -> None:
    """Compile the kernel of every batch bucket for this width (call before graph capture)."""
    for b in buckets:
        KERNEL.compiled(dim, config(dim, b), rows=b)


def build(dim, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute

    bf16, n = cutlass.BFloat16, cute.sym_int()
    return compile_kernel(_kernel_class()(dim, cfg, pdl), fake_rows(bf16, n, dim),
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
