"""Attention-Residual depth mix + RMSNorm, pre- and post-attention forms, and the post-attention
form fused with the attention output's all-reduce (spec §2) or, at world size 1, with o_proj.

    prefix_out = prefix + delta            (no delta: prefix_out = prefix, a block just started)
    h          = Mix(prefix_out, blocks)   (identity when there are no completed blocks)
    x          = RMSNorm(h; norm_weight)
"""

from __future__ import annotations

import torch

from k3compile.ops.norms import rms_norm_ref


def mix_ref(prefix: torch.Tensor, blocks: list[torch.Tensor], mix_norm_weight: torch.Tensor,
            mix_proj_weight: torch.Tensor, mix_eps: float) -> torch.Tensor:
    if not blocks:
        return prefix
    sources = torch.stack([*blocks, prefix])
    scores = torch.nn.functional.linear(rms_norm_ref(sources, mix_norm_weight, mix_eps),
                                        mix_proj_weight).squeeze(-1).float()
    alpha = torch.softmax(scores, dim=0)
    return (alpha.unsqueeze(-1) * sources.float()).sum(0).to(prefix.dtype)


def attn_res_mix_norm_ref(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps):
    prefix_out = prefix if delta is None else prefix + delta
    h = mix_ref(prefix_out, list(blocks), mix_norm_weight, mix_proj_weight, mix_eps)
    return prefix_out, rms_norm_ref(h, norm_weight, norm_eps)


def mix_norm_after(a, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps,
                   norm_eps, mix_norm=attn_res_mix_norm_ref):
    """The post-attention mix fed by the attention output a: prefix + a, or a where a block
    starts (no prefix). `mix_norm` computes it: the reference, or a kernel on CUDA."""
    if prefix is None:
        return mix_norm(a, None, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps,
                        norm_eps)
    return mix_norm(prefix, a, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps,
                    norm_eps)


@torch.library.custom_op("k3::attn_res_mix_norm", mutates_args=())
def attn_res_mix_norm(
    prefix: torch.Tensor, delta: torch.Tensor | None, blocks: list[torch.Tensor],
    mix_norm_weight: torch.Tensor, mix_proj_weight: torch.Tensor, norm_weight: torch.Tensor,
    mix_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    prefix_out, x = attn_res_mix_norm_ref(prefix, delta, blocks, mix_norm_weight,
                                          mix_proj_weight, norm_weight, mix_eps, norm_eps)
    return prefix_out.clone() if delta is None else prefix_out, x  # outputs never alias inputs


@attn_res_mix_norm.register_fake
def _(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps, norm_eps):
    return torch.empty_like(prefix), torch.empty_like(prefix)


@torch.library.custom_op("k3::allreduce_attn_res_mix_norm", mutates_args=())
def allreduce_attn_res_mix_norm(
    partial: torch.Tensor, prefix: torch.Tensor | None, blocks: list[torch.Tensor],
    mix_norm_weight: torch.Tensor, mix_proj_weight: torch.Tensor, norm_weight: torch.Tensor,
    mix_eps: float, norm_eps: float, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a = all_reduce(partial) over the TP group; prefix_out = prefix + a (or a); mix; norm."""
    a = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(partial, "sum", group_name))
    return mix_norm_after(a, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
                           mix_eps, norm_eps)


@allreduce_attn_res_mix_norm.register_fake
def _(partial, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps, norm_eps,
      group_name):
    return torch.empty_like(partial), torch.empty_like(partial)


@torch.library.custom_op("k3::oproj_attn_res_mix_norm", mutates_args=())
def oproj_attn_res_mix_norm(
    o: torch.Tensor, o_proj_weight: torch.Tensor, prefix: torch.Tensor | None,
    blocks: list[torch.Tensor], mix_norm_weight: torch.Tensor, mix_proj_weight: torch.Tensor,
    norm_weight: torch.Tensor, mix_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a = o · W_oᵀ (world size 1: no collective after o_proj); prefix_out = prefix + a (or a,
    where a block starts); mix; norm. The GEMM is the kernel's prologue."""
    a = torch.nn.functional.linear(o, o_proj_weight)
    return mix_norm_after(a, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
                           mix_eps, norm_eps)


@oproj_attn_res_mix_norm.register_fake
def _(o, o_proj_weight, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps,
      norm_eps):
    shape = (*o.shape[:-1], o_proj_weight.shape[0])
    return o.new_empty(shape), o.new_empty(shape)
