"""`prefix_out, x = k3.attn_res_mix_norm(prefix, delta, blocks, ...)`: the Attention-Residual
depth mix and the RMSNorm after it (spec §2), pre- and post-attention.

    prefix_out = prefix + delta            (no delta: prefix_out = prefix, a block just started)
    h          = Mix(prefix_out, blocks)   (identity when there are no completed blocks)
    x          = RMSNorm(h; norm_weight)

`scores_fp32`: the scores in fp32 throughout, no rounding to the activations' dtype (Moonshot's
`_apply_attn_res`, `k3compile.math.depth_mix_scores_fp32`); the two differ only in bf16/fp16.
`norm_weight_fp32`: the RMSNorm after the mix multiplies its weight in fp32 before the one
rounding to h's dtype (`k3compile.math.rms_norm_fp32_weight`: a JAX/Flax-style norm, spell9's
`(x.float() * rstd * w.float()).to(bf16)`), where the default rounds the normalised row first and
multiplies in h's dtype (`math.rms_norm`); the same in fp32.

The post-attention form fed by a collective or by o_proj is `k3.allreduce_attn_res_mix_norm` /
`k3.oproj_attn_res_mix_norm`; both compute the mix through `mix_norm_after`.
"""

from __future__ import annotations

import torch

from k3compile.math import (
    depth_mix_scores_fp32,
    depth_mix_weights,
    rms_norm,
    rms_norm_fp32_weight,
)


def attn_res_mix_norm_ref(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, scores_fp32=False, norm_weight_fp32=False):
    prefix_out = prefix if delta is None else prefix + delta
    mix = depth_mix_scores_fp32 if scores_fp32 else depth_mix_weights
    h = mix(prefix_out, list(blocks), mix_norm_weight, mix_proj_weight, mix_eps)
    if norm_weight_fp32:
        return prefix_out, rms_norm_fp32_weight(h, norm_weight, norm_eps, h.dtype)
    return prefix_out, rms_norm(h, norm_weight, norm_eps)


def mix_norm_after(a, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps,
                   norm_eps, scores_fp32=False, mix_norm=attn_res_mix_norm_ref,
                   norm_weight_fp32=False):
    """The post-attention mix fed by the attention output a: prefix + a, or a where a block
    starts (no prefix). `mix_norm` computes it: the reference, or a kernel on CUDA."""
    first, second = (a, None) if prefix is None else (prefix, a)
    if norm_weight_fp32:  # only where set: mix_norm callables without the flag keep working
        return mix_norm(first, second, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
                        mix_eps, norm_eps, scores_fp32, norm_weight_fp32)
    return mix_norm(first, second, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps,
                    norm_eps, scores_fp32)


@torch.library.custom_op("k3::attn_res_mix_norm", mutates_args=())
def attn_res_mix_norm(
    prefix: torch.Tensor, delta: torch.Tensor | None, blocks: list[torch.Tensor],
    mix_norm_weight: torch.Tensor, mix_proj_weight: torch.Tensor, norm_weight: torch.Tensor,
    mix_eps: float, norm_eps: float, scores_fp32: bool = False, norm_weight_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    prefix_out, x = attn_res_mix_norm_ref(prefix, delta, blocks, mix_norm_weight,
                                          mix_proj_weight, norm_weight, mix_eps, norm_eps,
                                          scores_fp32, norm_weight_fp32)
    return prefix_out.clone() if delta is None else prefix_out, x  # outputs never alias inputs


@attn_res_mix_norm.register_fake
def _(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps, norm_eps,
      scores_fp32=False, norm_weight_fp32=False):
    return torch.empty_like(prefix), torch.empty_like(prefix)
