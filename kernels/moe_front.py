"""CUDA implementation of `k3::moe_front`: the router logits and the latent down-projection.

    logits = x · W_rᵀ (fp32 out of bf16 operands),  z = x · W_dᵀ (bf16)

bf16 × bf16 products are exact in fp32, so a bf16 GEMM accumulating and writing fp32 computes the
reference's sums (in another order) without its fp32 copy of W_r.
One launch over [W_r; W_d], read in place where the `pack` stage stored both as one buffer: at
M <= gemv.GEMV_MAX_M gemv's split-output variant where settings.KERNELS.gemv_fused names "split"
(the default since session 20: B1 the same time at one kernel fewer per layer on the H200); at
2..64 rows gemm_tc's where settings.KERNELS.gemm_tc_fused names "split" (opt-in) and
`router.linear` would run gemm_tc on [W_r; W_d] (`router.tc_fused_takes`). Otherwise (weights
apart: a copy per call would cost more than the launch saves) two `router.linear` calls.

Constraints:
    * x [N, D] rows, W_r [E, D], W_d [L, D]; non-bf16 activations take the reference's fp32 math.
    * The split variants take their engine's limits on both weights (gemm_tc's: K >= 64, M <= 64;
      a refused call logs why and takes the two launches).
"""

import torch

from k3compile.ops import registry
from k3compile.ops.linear_concat import adjacent, concatenated

from .common import gemm_tc, gemv, router
from .common.dsl import flat_rows, on_stream
from .common.router import linear

OP = "moe_front"


def moe_front_cuda(x, router_w, down_w):
    # x [N, D] bf16 rows; router_w [E, D], down_w [L, D]
    if x.dtype != router_w.dtype:  # the reference's fp32 math
        return linear(x.float(), router_w.float()), linear(x, down_w)
    if gemv.fused_takes(x, "split") and gemv.fused_ok("split", _split_refusal(x, router_w, down_w)):
        return gemv.gemv_split_cuda(x, concatenated([router_w, down_w]), router_w.shape[0])
    n = router_w.shape[0] + down_w.shape[0]
    if router.tc_fused_takes(x, "split", n) and gemm_tc.fused_ok(
            "split", _tc_split_refusal(x, router_w, down_w)):
        return gemm_tc.gemm_tc_split_cuda(x, concatenated([router_w, down_w]), router_w.shape[0])
    return linear(x, router_w, out_dtype=torch.float32), linear(x, down_w)


def _split_refusal(x, router_w, down_w):
    """Why the split variant cannot take the front: weights that do not lie back to back (stage
    `pack` off or refused: the variant would copy both, ~64 MB at one TP16 rank, on every call),
    or gemv's limits on either."""
    if not adjacent([router_w, down_w]):
        return "the router and latent-down weights are not packed into one buffer"
    return (gemv.launch_refusal(gemv.refusal, x, router_w, None, None, torch.float32)
            or gemv.launch_refusal(gemv.refusal, x, down_w, None, None, torch.bfloat16))


def _tc_split_refusal(x, router_w, down_w):
    """As `_split_refusal`, with gemm_tc's limits on the packed weight."""
    if not adjacent([router_w, down_w]):
        return "the router and latent-down weights are not packed into one buffer"
    return gemm_tc.fused_launch_refusal(
        gemm_tc.Fusion(split=router_w.shape[0]), x, concatenated([router_w, down_w]),
        out_dtype=torch.float32)


def register() -> None:
    registry.register_kernel(OP)  # refused inputs take the unfused launches
    torch.library.register_kernel(f"k3::{OP}", "cuda", on_stream(flat_rows(moe_front_cuda)))
