"""`o = k3.fb_kda_decode(q, k, v, g, fa, fb_weight, b, conv_state!, recurrent_state!, ...)`:
`k3.kda_decode` with the decay's low-rank up-projection in its prologue,

    graw = fa · W_fbᵀ      fa [B, T, R], W_fb [H·K, R]; R = head_dim, a 128-wide GEMM at K3's sizes

then the KDA step of `k3compile.ops.kda_decode`, its variant (`variant`: a `KDAVariant.spec`) and
its conv state buffers (`k_conv_state` / `v_conv_state`: one per q / k / v, required, None with
one buffer) as there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.ops.kda_decode import MUTATED, KDAVariant, kda_decode_fake, kda_decode_ref


def fb_kda_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, fa: torch.Tensor,
    fb_weight: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor,
    recurrent_state: torch.Tensor, slots: torch.Tensor, q_conv_weight: torch.Tensor,
    k_conv_weight: torch.Tensor, v_conv_weight: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, o_norm_weight: torch.Tensor, lower_bound: float, l2_eps: float,
    q_scale: float, norm_eps: float, k_conv_state: torch.Tensor | None,
    v_conv_state: torch.Tensor | None, variant: str = "",
) -> torch.Tensor:
    graw = F.linear(fa, fb_weight)
    return kda_decode_ref(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                          k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                          l2_eps, q_scale, norm_eps, k_conv_state, v_conv_state,
                          KDAVariant.parse(variant, k_conv_state is not None))


fb_kda_decode = torch.library.custom_op("k3::fb_kda_decode", fb_kda_decode, mutates_args=MUTATED)


@fb_kda_decode.register_fake
def _(q, k, v, g, fa, fb_weight, b, conv_state, recurrent_state, slots, q_conv_weight,
      k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps, q_scale,
      norm_eps, k_conv_state, v_conv_state, variant=""):
    return kda_decode_fake(q, recurrent_state, g, o_norm_weight,
                           KDAVariant.parse(variant, k_conv_state is not None))
