"""`cq, c_kv, k_pe = k3.mla_lowrank_norm(cq, ckv, q_weight, kv_weight, eps)`: Gated MLA's two
low-rank RMSNorms in one launch (spec §3.2 step 2).

    cq [N, Q]     -> RMSNorm(cq; q_weight)
    ckv [N, C + R] -> (RMSNorm(ckv[:, :C]; kv_weight), ckv[:, C:])     C = kv_weight.numel()
"""

from __future__ import annotations

import torch

from k3compile.math import rms_norm


def mla_lowrank_norm_ref(cq, ckv, q_weight, kv_weight, eps):
    c = kv_weight.shape[0]
    return (
        rms_norm(cq, q_weight, eps),
        rms_norm(ckv[..., :c], kv_weight, eps),
        ckv[..., c:].clone(),
    )


@torch.library.custom_op("k3::mla_lowrank_norm", mutates_args=())
def mla_lowrank_norm(
    cq: torch.Tensor, ckv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return mla_lowrank_norm_ref(cq, ckv, q_weight, kv_weight, eps)


@mla_lowrank_norm.register_fake
def _(cq, ckv, q_weight, kv_weight, eps):
    c = kv_weight.shape[0]
    return (
        torch.empty_like(cq),
        ckv.new_empty((*ckv.shape[:-1], c)),
        ckv.new_empty((*ckv.shape[:-1], ckv.shape[-1] - c)),
    )
