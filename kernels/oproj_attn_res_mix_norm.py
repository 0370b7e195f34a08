"""CUDA implementation of `k3::oproj_attn_res_mix_norm`: the output projection, then the mix.

    a = o · W_oᵀ;  (h, x) = attn_res_mix_norm(prefix + a, blocks)      (the reference's roundings)

Constraints:
    * The GEMM goes through `router.linear` (any shape: cuBLAS where our GEMMs refuse).
    * The mix takes the attn_res_mix_norm kernel's limits (both score variants); refused inputs
      run its reference (reason logged).
"""

import torch

from k3compile.ops import registry
from k3compile.ops.attn_res_mix_norm import mix_norm_after

from .attn_res_mix_norm import attn_res_mix_norm_cuda
from .common.dsl import flat_rows, on_stream
from .common.router import linear

OP = "oproj_attn_res_mix_norm"


def oproj_attn_res_mix_norm_cuda(o, o_proj_weight, prefix, blocks, mix_norm_weight,
                                 mix_proj_weight, norm_weight, mix_eps, norm_eps,
                                 scores_fp32=False):
    # o, prefix, blocks: [N, ·] rows (flat_rows)
    a = linear(o, o_proj_weight)
    return mix_norm_after(a, prefix, list(blocks), mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, scores_fp32, mix_norm=attn_res_mix_norm_cuda)


def register() -> None:
    registry.register_kernel(OP)  # refused inputs take the unfused launches
    torch.library.register_kernel(f"k3::{OP}", "cuda",
                                  on_stream(flat_rows(oproj_attn_res_mix_norm_cuda)))
