"""CUDA implementation of `k3::allreduce_attn_res_mix_norm`: the TP all-reduce, then the depth mix.

    a = all_reduce(partial);  (h, x) = attn_res_mix_norm(prefix + a, blocks)

Constraints:
    * partial [N, D] rows; the all-reduce is one-shot or two-shot over symmetric memory or NCCL,
      by size (common/collective.py; K3_ALLREDUCE forces one).
    * The mix takes the attn_res_mix_norm kernel's limits (both score variants); refused inputs
      run its reference (reason logged).
"""

import torch
import torch.distributed as dist

from k3compile.ops import registry
from k3compile.ops.attn_res_mix_norm import mix_norm_after

from .attn_res_mix_norm import attn_res_mix_norm_cuda
from .common import collective
from .common.dsl import flat_rows, on_stream

OP = "allreduce_attn_res_mix_norm"


def allreduce_attn_res_mix_norm_cuda(partial, prefix, blocks, mix_norm_weight, mix_proj_weight,
                                     norm_weight, mix_eps, norm_eps, group_name,
                                     scores_fp32=False):
    world = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group_name))
    a = collective.all_reduce(partial.contiguous(), group_name, world)
    return mix_norm_after(a, prefix, list(blocks), mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, scores_fp32, mix_norm=attn_res_mix_norm_cuda)


def register() -> None:
    registry.register_kernel(OP)  # refused inputs take the unfused launches
    torch.library.register_kernel(f"k3::{OP}", "cuda",
                                  on_stream(flat_rows(allreduce_attn_res_mix_norm_cuda)))
