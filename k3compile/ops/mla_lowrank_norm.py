"""`cq, c_kv, k_pe = k3.mla_lowrank_norm(cq, ckv, q_weight, kv_weight, eps, weight_fp32=False)`:
Gated MLA's two low-rank RMSNorms in one launch (spec §3.2 step 2).

    cq [N, Q]     -> RMSNorm(cq; q_weight)
    ckv [N, C + R] -> (RMSNorm(ckv[:, :C]; kv_weight), ckv[:, C:])     C = kv_weight.numel()

The norms round like `math.rms_norm` (the normalised row rounded to the activations' dtype, times
the weight in that dtype); with `weight_fp32` like `math.rms_norm_fp32_weight`: the weight
multiplied in fp32, one rounding (a JAX/Flax-style norm, spell9's `(x.float() * rstd *
w.float()).to(bf16)`); the same in fp32.
"""

from __future__ import annotations

import torch

from k3compile.math import rms_norm, rms_norm_fp32_weight


def mla_lowrank_norm_ref(cq, ckv, q_weight, kv_weight, eps, weight_fp32=False):
    c = kv_weight.shape[0]

    def norm(x, w):
        return rms_norm_fp32_weight(x, w, eps, x.dtype) if weight_fp32 else rms_norm(x, w, eps)

    return norm(cq, q_weight), norm(ckv[..., :c], kv_weight), ckv[..., c:].clone()


@torch.library.custom_op("k3::mla_lowrank_norm", mutates_args=())
def mla_lowrank_norm(
    cq: torch.Tensor, ckv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor,
    eps: float, weight_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return mla_lowrank_norm_ref(cq, ckv, q_weight, kv_weight, eps, weight_fp32)


@mla_lowrank_norm.register_fake
def _(cq, ckv, q_weight, kv_weight, eps, weight_fp32=False):
    c = kv_weight.shape[0]
    return (
        torch.empty_like(cq),
        ckv.new_empty((*ckv.shape[:-1], c)),
        ckv.new_empty((*ckv.shape[:-1], ckv.shape[-1] - c)),
    )
