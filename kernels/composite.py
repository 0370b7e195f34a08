"""CUDA implementations of fused ops that are one GEMM (or one collective) plus one of our CuTe
kernels, until the GEMM moves into the kernel. GEMMs go through `gemv.linear`: our skinny GEMM at
one row (x1.2-1.8 over cuBLAS there), cuBLAS above.

    oproj_attn_res_mix_norm:      a = o · W_oᵀ → attn_res_mix_norm kernel (prefix + a, mix, norm)
    allreduce_attn_res_mix_norm:  a = all_reduce(partial) (one-shot / two-shot symmetric memory
                                  or NCCL by size: common/collective.py) → attn_res_mix_norm kernel
    norm_linear:                  x = rms_norm kernel (u) → y = x · Wᵀ [+ r] (the residual added
                                  in the GEMM's fp32 epilogue)
    moe_front:                    router logits = x · W_rᵀ in fp32 from the bf16 weight (GEMM
                                  with fp32 output), z = x · W_dᵀ
    linear_concat:                x · [W_0; W_1; ...]ᵀ over the cached concatenation
    linear:                       x · Wᵀ, a plain GEMM that no fusion took
    mla_uv_gate:                  o = o_lat · W_UVᵀ per head, times sigmoid(g): gemv's gate
                                  variant at one row where K3_GEMV_FUSED names "gate" (on by
                                  default), else the reference; its pattern defers every other
                                  site to Inductor (`kernel_refusal`)

The reference (like the model) upcasts the router weight every step (`w.float()`: a 2-byte
read, a 4-byte write and a 4-byte read of 896 × 7168 values, ~64 MB per layer at TP16 instead of
~13 MB); bf16 × bf16 products are exact in fp32, so a bf16 GEMM accumulating and writing fp32
computes the same sums (in another order).

Two launches each, against Inductor's three or more for the same math. The references round the
GEMM output to bf16 before adding the residual; `addmm` adds it in fp32 and rounds once, within
the bf16 tolerance of the GPU tests. Each falls back to its torch reference when a kernel refuses
its inputs (the kernel wrappers log why).

Where K3_GEMV_FUSED names them (`gemv.FUSED`, read at every call), norm_linear and moe_front
launch once at M <= gemv.GEMV_MAX_M: gemv's norm-prologue variant ("norm", on by default), and
its split-output variant over [W_r; W_d] ("split", opt-in: `concatenated`, a view where the
backend's `pack` stage stored both as one buffer, else a second copy of both weights, 64 MB per
layer at TP16). A refused call logs why and takes the two launches.
"""

import torch
import torch.distributed as dist

from k3compile.ops.attn_res_mix_norm import mix_norm_after
from k3compile.ops.linear_concat import concatenated
from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

from . import gemv
from .attn_res_mix_norm import attn_res_mix_norm_cuda
from .common import collective
from .common.dsl import flat_rows, on_stream
from .gemv import linear
from .rms_norm import rms_norm_cuda

OPS = ("oproj_attn_res_mix_norm", "allreduce_attn_res_mix_norm", "norm_linear", "moe_front",
       "linear_concat", "linear", "mla_uv_gate")
OWN_SHAPES = frozenset({"mla_uv_gate"})  # per-head operands: flat_rows would merge the heads


def oproj_attn_res_mix_norm_cuda(o, o_proj_weight, prefix, blocks, mix_norm_weight,
                                 mix_proj_weight, norm_weight, mix_eps, norm_eps):
    # o, prefix, blocks: [N, ·] rows (flat_rows)
    a = linear(o, o_proj_weight)
    return mix_norm_after(a, prefix, list(blocks), mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, mix_norm=attn_res_mix_norm_cuda)


def allreduce_attn_res_mix_norm_cuda(partial, prefix, blocks, mix_norm_weight, mix_proj_weight,
                                     norm_weight, mix_eps, norm_eps, group_name):
    world = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group_name))
    a = collective.all_reduce(partial.contiguous(), group_name, world)
    return mix_norm_after(a, prefix, list(blocks), mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, mix_norm=attn_res_mix_norm_cuda)


def norm_linear_cuda(u, norm_w, w, eps, residual=None):
    # u [N, L] rows; w [O, L]; residual [N, O]
    if gemv.fused_takes(u, "norm") and gemv.fused_ok("norm", gemv.fused_launch_refusal(
            gemv.NORM, u, w, residual, norm_weight=norm_w)):
        return gemv.gemv_norm_cuda(u, norm_w, w, eps, residual)
    return linear(rms_norm_cuda(u, norm_w, eps), w, residual)


def moe_front_cuda(x, router_w, down_w):
    # x [N, D] bf16 rows; router_w [E, D], down_w [L, D]
    if x.dtype != router_w.dtype:  # the reference's fp32 math
        return linear(x.float(), router_w.float()), linear(x, down_w)
    if gemv.fused_takes(x, "split") and gemv.fused_ok("split", _front_refusal(x, router_w, down_w)):
        return gemv.gemv_split_cuda(x, concatenated([router_w, down_w]), router_w.shape[0])
    return linear(x, router_w, out_dtype=torch.float32), linear(x, down_w)


def _front_refusal(x, router_w, down_w):
    """Why the split variant cannot take the front, checked on the two weights before their
    concatenation is built."""
    return (gemv.launch_refusal(gemv.refusal, x, router_w, None, None, torch.float32)
            or gemv.launch_refusal(gemv.refusal, x, down_w, None, None, torch.bfloat16))


def linear_concat_cuda(x, weights):
    # x [N, D] rows; weights [N_i, D]
    return linear(x, concatenated(list(weights)))


def linear_cuda(x, w):
    # x [N, K] rows; w [O, K]
    return linear(x, w)


def mla_uv_gate_cuda(o_lat, w_uv, g):
    # o_lat [B, T, H, C], w_uv [H, V, C] (a view of kv_b's weight), g [B, T, H·V]
    (b, t, h, c), v = o_lat.shape, w_uv.shape[1]
    x, gate = o_lat.reshape(b * t, h * c), g.reshape(b * t, h * v)
    if gemv.fused_takes(x, "gate"):
        rows = uv_rows(w_uv)
        if gemv.fused_ok("gate", gemv.gate_refusal(x, rows, gate, v)):
            return gemv.gemv_gate_cuda(x, rows, gate, v).view(b, t, h * v)
    return mla_uv_gate_ref(o_lat, w_uv, g)


def _even_heads(w_uv) -> bool:
    return w_uv.stride(2) == 1 and w_uv.stride(0) == w_uv.shape[1] * w_uv.stride(1)


def uv_rows(w_uv):
    """W_UV [H, V, C] as [H·V, C] rows: a view where the heads are evenly spaced, else the heads
    concatenated once (the model's W_UV is a view of kv_b's weight with W_UK's rows between
    heads) and reused while that weight lives unchanged."""
    h, v, c = w_uv.shape
    return w_uv.reshape(h * v, c) if _even_heads(w_uv) else concatenated(list(w_uv))


def register() -> None:
    for op in OPS:
        fn = globals()[f"{op}_cuda"]
        torch.library.register_kernel(f"k3::{op}", "cuda",
                                      on_stream(fn if op in OWN_SHAPES else flat_rows(fn)))
