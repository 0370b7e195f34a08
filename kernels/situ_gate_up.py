"""CUDA implementation of `k3::situ_gate_up`: one GEMM over the cached [W_g; W_u], then this
file's CuTe DSL kernel for the SiTU-GLU activation (spec §3.3 step 8).

    y = bf16(β·tanh(g/β)·σ(g) · β₂·tanh(u/β₂)),  [g | u] = x · [W_g; W_u]ᵀ,  fp32 math

One launch, this kernel's math on the GEMM's bf16 outputs in the GEMM's epilogue: at
M <= gemv.GEMV_MAX_M gemv's SiTU variant where settings.KERNELS.gemv_fused names "situ" (the
default); at 2..64 rows gemm_tc's where settings.KERNELS.gemm_tc_fused names "situ" (opt-in)
and `router.linear` would run gemm_tc on [W_g; W_u] (`router.tc_fused_takes`). Otherwise two
(`router.linear`, then this kernel). docs/kernels.md, situ_gate_up.

Constraints:
    * The kernel: gate_up bf16 [N, 2I], contiguous rows (row stride a multiple of 8 elements),
      16-byte-aligned; I % 8 == 0 and 8 <= I <= 8192; β, β₂ runtime scalars (refused: the
      reference, reason logged).
    * The one-launch variants take their engine's limits (gemm_tc's: I a multiple of half its
      row tile, 32 or 64 rows); a refused call logs why and takes the two launches.
    * With PDL (settings.KERNELS.pdl) everything it reads is activation: it waits first.
"""

from dataclasses import dataclass

import torch

from k3compile.math import situ as situ_ref
from k3compile.ops import registry
from k3compile.ops.situ_gate_up import gate_up_weight

from .common import gemm_tc, gemv, router
from .common.dsl import (
    BUCKETS,
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
    flat_rows,
    on_stream,
    pick_threads,
    rows_ok,
)
from .common.launch import Kernel
from .common.router import linear

OP = "situ_gate_up"
MAX_WIDTH = 8192


@dataclass(frozen=True)
class Config:
    threads: int
    vec_per_thread: int


def config(width: int, batch_bucket: int) -> Config:
    """One 16-byte vector of g (and of u) per thread while a row fits 1024 threads."""
    return Config(*pick_threads(width // 8, 1 if batch_bucket <= 8 else 2))


def refusal(gate_up) -> str | None:
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        return f"gate_up {tuple(gate_up.shape)} is not [N, 2I]"
    width = gate_up.shape[-1] // 2
    if width % 8 or not 8 <= width <= MAX_WIDTH:
        return f"width {width} (want a multiple of 8 in [8, {MAX_WIDTH}])"
    if why := rows_ok(gate_up, 2 * width, torch.bfloat16):
        return f"gate_up: {why}"
    return None


def can_implement(gate_up) -> bool:
    return refusal(gate_up) is None


def prepare(width: int, buckets=BUCKETS) -> None:
    """Compile the kernel of every batch bucket for this width (call before graph capture)."""
    for b in buckets:
        KERNEL.compiled(width, config(width, b), rows=b)


def build(width, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute

    from .device.situ_gate_up import SiTU

    bf16, n = cutlass.BFloat16, cute.sym_int()
    return compile_kernel(SiTU(width, cfg, pdl), fake_rows(bf16, n, 2 * width),
                          fake_rows(bf16, n, width, width), cutlass.Float32(4.0),
                          cutlass.Float32(25.0), fake_stream(), arch=arch, dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def situ_cuda(gate_up, beta, linear_beta, *, out=None):
    """SiTU-GLU of gate_up [N, 2I] -> [N, I]: the kernel, or the reference if refused."""
    width = gate_up.shape[-1] // 2

    def launch():
        n = gate_up.shape[0]
        y = gate_up.new_empty((n, width)) if out is None else out
        if n:
            b = bucket(n)
            KERNEL.compiled(width, config(width, b), rows=b)(gate_up, y, float(beta),
                                                             float(linear_beta))
        return y

    return KERNEL.run(lambda: refusal(gate_up),
                      lambda: situ_ref(*gate_up.split(width, dim=-1), beta, linear_beta), launch,
                      gate_up)


def situ_gate_up_cuda(x, wg, wu, beta, linear_beta):
    """k3::situ_gate_up on CUDA: one GEMM over the cached [W_g; W_u], then the kernel; one
    launch where a SiTU-epilogue variant takes it (K3_GEMV_FUSED at M <= gemv.GEMV_MAX_M,
    K3_GEMM_TC_FUSED where `linear` would run gemm_tc; a refused call logs why and takes the
    two launches)."""
    w = gate_up_weight(wg, wu)
    if gemv.fused_takes(x, "situ") and gemv.fused_ok(
            "situ", gemv.fused_launch_refusal(gemv.SITU, x, w)):
        return gemv.gemv_situ_cuda(x, w, beta, linear_beta)
    if router.tc_fused_takes(x, "situ", w.shape[0]) and gemm_tc.fused_ok(
            "situ", gemm_tc.fused_launch_refusal(gemm_tc.SITU, x, w)):
        return gemm_tc.gemm_tc_situ_cuda(x, w, beta, linear_beta)
    return situ_cuda(linear(x, w), beta, linear_beta)


def register() -> None:
    registry.register_kernel(OP)  # a refused SiTU runs its reference after the GEMM
    torch.library.register_kernel(f"k3::{OP}", "cuda",
                                  on_stream(flat_rows(situ_gate_up_cuda)))
