"""CUDA implementation of `k3::fb_kda_decode`: the KDA gate's low-rank up-projection, then the
KDA recurrent step.

    graw = fa · W_fbᵀ;  o = kda_decode(q, k, v, g, graw, b, ...)

Two launches: `router.linear` on the flat rows (our skinny GEMM at one row, cuBLAS above), then the
kda_decode kernel (its device code).

Constraints:
    * fa [B, T, R], W_fb [H·K, R]; the rest as kda_decode (refused inputs run its reference,
      reason logged).
"""

import torch

from k3compile.ops import registry

from . import kda_decode
from .common.router import linear
from .kda_decode import kda_decode_cuda

OP = "fb_kda_decode"


def refusal(q, k, v, g, fa, fb_weight, b, *rest, **options) -> str | None:
    """The kda_decode kernel's limits, with graw [B, T, H·K] as the GEMM writes it."""
    graw = torch.empty((*fa.shape[:2], fb_weight.shape[0]), dtype=fa.dtype, device="meta")
    return kda_decode.refusal(q, k, v, g, graw, b, *rest, **options)


def fb_kda_decode_cuda(q, k, v, g, fa, fb_weight, b, conv_state, recurrent_state, slots,
                       q_conv_weight, k_conv_weight, v_conv_weight, A_log, dt_bias,
                       o_norm_weight, lower_bound, l2_eps, q_scale, norm_eps, norm_fp32=False,
                       *, out=None):
    B, T, R = fa.shape
    graw = linear(fa.reshape(B * T, R), fb_weight).view(B, T, -1)
    return kda_decode_cuda(q, k, v, g, graw, b, conv_state, recurrent_state, slots,
                           q_conv_weight, k_conv_weight, v_conv_weight, A_log, dt_bias,
                           o_norm_weight, lower_bound, l2_eps, q_scale, norm_eps, norm_fp32,
                           out=out)


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", fb_kda_decode_cuda)
