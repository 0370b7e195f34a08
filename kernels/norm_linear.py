"""CUDA implementation of `k3::norm_linear`: RMSNorm, then a GEMM with the residual.

    y = rms_norm(u; g, eps) · Wᵀ [+ r]      (the residual added in the GEMM's fp32 epilogue)

One launch at M <= gemv.GEMV_MAX_M where settings.KERNELS.gemv_fused names "norm" (the default):
gemv's norm-prologue variant; at 2..64 rows gemm_tc's norm variant where
settings.KERNELS.gemm_tc_fused names "norm" (opt-in) and `router.linear` would run gemm_tc on W
(`router.tc_fused_takes`); otherwise two, the rms_norm kernel and `router.linear`.

`weight_fp32` (u bf16 or fp32, the weight multiplied in fp32 before the one rounding:
`k3compile.math.rms_norm_fp32_weight`): two launches, the rms_norm kernel's `fp32_weight` build
(`rms_norm_fp32_weight_cuda`; where it refuses, its reference in torch, logged) then
`router.linear`. Neither the gemv nor the gemm_tc norm prologue reads an fp32 x or rounds once
after the weight (docs/kernels.md, norm_linear, 2026-12-05; until session 39 this was torch's
F.rms_norm with the weight's upcast and the cast, three to four launches).

Constraints:
    * u [N, L] rows, W [O, L], r [N, O]; the one-launch variant takes gemv's limits (a refused call
      logs why and takes the two launches: gemv's limits, or gemm_tc's with its norm prologue's
      re-read limit S·M <= R/2); the rms_norm kernel's limits (refused: its reference).
"""

import torch

from k3compile.ops import registry

from .common import gemm_tc, gemv, router
from .common.dsl import flat_rows, on_stream
from .rms_norm import rms_norm_cuda, rms_norm_fp32_weight_cuda

OP = "norm_linear"


def norm_linear_cuda(u, norm_w, w, eps, residual=None, weight_fp32=False):
    # u [N, L] rows; w [O, L]; residual [N, O]
    if weight_fp32:
        return router.linear(rms_norm_fp32_weight_cuda(u, norm_w, eps, w.dtype), w, residual)
    if gemv.fused_takes(u, "norm") and gemv.fused_ok("norm", gemv.fused_launch_refusal(
            gemv.NORM, u, w, residual, norm_weight=norm_w)):
        return gemv.gemv_norm_cuda(u, norm_w, w, eps, residual)
    if router.tc_fused_takes(u, "norm", w.shape[0]) and gemm_tc.fused_ok(
            "norm", gemm_tc.fused_launch_refusal(gemm_tc.NORM, u, w, residual,
                                                 norm_weight=norm_w)):
        return gemm_tc.gemm_tc_norm_cuda(u, norm_w, w, eps, residual)
    return router.linear(rms_norm_cuda(u, norm_w, eps), w, residual)


def register() -> None:
    registry.register_kernel(OP)  # refused inputs take the unfused launches
    torch.library.register_kernel(f"k3::{OP}", "cuda", on_stream(flat_rows(norm_linear_cuda)))
