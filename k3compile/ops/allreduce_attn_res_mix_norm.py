"""`prefix_out, x = k3.allreduce_attn_res_mix_norm(partial, prefix, blocks, ..., group_name)`:
the post-attention depth mix + RMSNorm fused with the attention output's all-reduce (spec §2).

    a = all_reduce(partial) over the TP group;  prefix_out = prefix + a (or a);  mix;  norm

`scores_fp32` as in `k3.attn_res_mix_norm`.
"""

from __future__ import annotations

import torch

from k3compile.ops.attn_res_mix_norm import mix_norm_after


@torch.library.custom_op("k3::allreduce_attn_res_mix_norm", mutates_args=())
def allreduce_attn_res_mix_norm(
    partial: torch.Tensor, prefix: torch.Tensor | None, blocks: list[torch.Tensor],
    mix_norm_weight: torch.Tensor, mix_proj_weight: torch.Tensor, norm_weight: torch.Tensor,
    mix_eps: float, norm_eps: float, group_name: str, scores_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(partial, "sum", group_name))
    return mix_norm_after(a, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, scores_fp32)


@allreduce_attn_res_mix_norm.register_fake
def _(partial, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps, norm_eps,
      group_name, scores_fp32=False):
    return torch.empty_like(partial), torch.empty_like(partial)
