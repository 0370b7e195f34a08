"""CUDA implementations of fused ops that are one cuBLAS GEMM (or one collective) plus one of our
CuTe kernels, until the skinny-GEMM kernels (issue 8) take the GEMM into the kernel:

    oproj_attn_res_mix_norm:      a = o · W_oᵀ (cuBLAS) → attn_res_mix_norm kernel (prefix + a, mix, norm)
    allreduce_attn_res_mix_norm:  a = all_reduce(partial) → attn_res_mix_norm kernel
    norm_linear:                  x = rms_norm kernel (u) → y = x · Wᵀ [+ r] (one cuBLAS addmm)
    moe_front:                    router logits = x · W_rᵀ in fp32 from the bf16 weight (cuBLAS
                                  bf16 GEMM with fp32 output), z = x · W_dᵀ

The reference (like the model) upcasts the router weight every step (`w.float()`: a 2-byte
read, a 4-byte write and a 4-byte read of 896 × 7168 values, ~64 MB per layer at TP16 instead of
~13 MB); bf16 × bf16 products are exact in fp32, so a bf16 GEMM accumulating and writing fp32
computes the same sums (in another order).

Two launches each, against Inductor's three or more for the same math. The references round the
GEMM output to bf16 before adding the residual; `addmm` adds it in fp32 and rounds once, within
the bf16 tolerance of the GPU tests. Each falls back to its torch reference when a kernel refuses
its inputs (the kernel wrappers log why).
"""

import torch
import torch.nn.functional as F

from k3compile.ops.attn_res import mix_norm_after

from .attn_res_mix_norm import attn_res_mix_norm_cuda
from .common.dsl import flat_rows
from .rms_norm import rms_norm_cuda

OPS = ("oproj_attn_res_mix_norm", "allreduce_attn_res_mix_norm", "norm_linear", "moe_front")


def oproj_attn_res_mix_norm_cuda(o, o_proj_weight, prefix, blocks, mix_norm_weight,
                                 mix_proj_weight, norm_weight, mix_eps, norm_eps):
    # o, prefix, blocks: [N, ·] rows (flat_rows)
    a = F.linear(o, o_proj_weight)
    return mix_norm_after(a, prefix, list(blocks), mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, mix_norm=attn_res_mix_norm_cuda)


def allreduce_attn_res_mix_norm_cuda(partial, prefix, blocks, mix_norm_weight, mix_proj_weight,
                                     norm_weight, mix_eps, norm_eps, group_name):
    c10d = torch.ops._c10d_functional
    a = c10d.wait_tensor(c10d.all_reduce(partial, "sum", group_name))
    return mix_norm_after(a, prefix, list(blocks), mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, mix_norm=attn_res_mix_norm_cuda)


def norm_linear_cuda(u, norm_w, w, eps, residual=None):
    # u [N, L] rows; w [O, L]; residual [N, O]
    x = rms_norm_cuda(u, norm_w, eps)
    if residual is None:
        return F.linear(x, w)
    return torch.addmm(residual, x, w.t())


def moe_front_cuda(x, router_w, down_w):
    # x [N, D] bf16 rows; router_w [E, D], down_w [L, D]
    if x.dtype == router_w.dtype and x.dtype in (torch.bfloat16, torch.float16):
        logits = torch.mm(x, router_w.t(), out_dtype=torch.float32)
    else:
        logits = F.linear(x.float(), router_w.float())
    return logits, F.linear(x, down_w)


def register() -> None:
    for op in OPS:
        torch.library.register_kernel(f"k3::{op}", "cuda", flat_rows(globals()[f"{op}_cuda"]))
