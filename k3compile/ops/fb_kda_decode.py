"""`o = k3.fb_kda_decode(q, k, v, g, fa, fb_weight, b, conv_state!, recurrent_state!, ...)`:
`k3.kda_decode` with the decay's low-rank up-projection in its prologue,

    graw = fa · W_fbᵀ      fa [B, T, R], W_fb [H·K, R]; R = head_dim, a 128-wide GEMM at K3's sizes

then the KDA step of `k3compile.ops.kda_decode` (`norm_fp32`: its fp32 output norm,
`conv_time_major`: the conv state [S, taps-1, 3·H·K], `state_v_major`: the recurrent state
[S, H, V, K], `o_fp32`: o unrounded into the output norm, `norm_weight_fp32`: the norm's weight multiplied in
fp32 before one rounding, `conv_rounded`: the conv rounded before its SiLU,
`conv_products_rounded`: the conv a window sum multiplied in bf16, `k_conv_state` /
`v_conv_state`: one conv state buffer per q / k / v, required, None with one buffer, as there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.ops.kda_decode import MUTATED, kda_decode_fake, kda_decode_ref


def fb_kda_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, fa: torch.Tensor,
    fb_weight: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
    recurrent_state: torch.Tensor, slots: torch.Tensor, q_conv_weight: torch.Tensor,
    k_conv_weight: torch.Tensor, v_conv_weight: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, o_norm_weight: torch.Tensor, lower_bound: float, l2_eps: float,
    q_scale: float, norm_eps: float, k_conv_state: torch.Tensor | None,
    v_conv_state: torch.Tensor | None, norm_fp32: bool = False, conv_time_major: bool = False,
    state_v_major: bool = False, o_fp32: bool = False, norm_weight_fp32: bool = False,
    conv_rounded: bool = False, conv_products_rounded: bool = False,
) -> torch.Tensor:
    graw = F.linear(fa, fb_weight)
    return kda_decode_ref(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                          k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                          l2_eps, q_scale, norm_eps, k_conv_state, v_conv_state, norm_fp32,
                          conv_time_major, state_v_major, o_fp32, norm_weight_fp32, conv_rounded,
                          conv_products_rounded)


fb_kda_decode = torch.library.custom_op("k3::fb_kda_decode", fb_kda_decode, mutates_args=MUTATED)


@fb_kda_decode.register_fake
def _(q, k, v, g, fa, fb_weight, b, conv_state, recurrent_state, slots, q_conv_weight,
      k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps, q_scale,
      norm_eps, k_conv_state, v_conv_state, norm_fp32=False, conv_time_major=False,
      state_v_major=False, o_fp32=False, norm_weight_fp32=False, conv_rounded=False,
      conv_products_rounded=False):
    return kda_decode_fake(q, recurrent_state, g, o_norm_weight, norm_fp32, norm_weight_fp32)
