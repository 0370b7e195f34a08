"""`prefix_out, x = k3.oproj_attn_res_mix_norm(o, o_proj_weight, prefix, blocks, ...)`: the
attention's o_proj GEMM as the prologue of the post-attention depth mix + RMSNorm (world size 1:
no collective after o_proj).

    a = o · W_oᵀ;  prefix_out = prefix + a (or a, where a block starts);  mix;  norm

`scores_fp32` and `norm_weight_fp32` as in `k3.attn_res_mix_norm`.
"""

from __future__ import annotations

import torch

from k3compile.ops.attn_res_mix_norm import mix_norm_after


@torch.library.custom_op("k3::oproj_attn_res_mix_norm", mutates_args=())
def oproj_attn_res_mix_norm(
    o: torch.Tensor, o_proj_weight: torch.Tensor, prefix: torch.Tensor | None,
    blocks: list[torch.Tensor], mix_norm_weight: torch.Tensor, mix_proj_weight: torch.Tensor,
    norm_weight: torch.Tensor, mix_eps: float, norm_eps: float, scores_fp32: bool = False,
    norm_weight_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.nn.functional.linear(o, o_proj_weight)
    return mix_norm_after(a, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, scores_fp32, norm_weight_fp32=norm_weight_fp32)


@oproj_attn_res_mix_norm.register_fake
def _(o, o_proj_weight, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps,
      norm_eps, scores_fp32=False, norm_weight_fp32=False):
    shape = (*o.shape[:-1], o_proj_weight.shape[0])
    return o.new_empty(shape), o.new_empty(shape)
