"""RMSNorm ops: plain (routed-latent norm) and the two MLA low-rank norms in one launch."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast to x's dtype, multiply by the weight (K3's RMSNorm order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@torch.library.custom_op("k3::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("k3::mla_lowrank_norm", mutates_args=())
def mla_lowrank_norm(
    cq: torch.Tensor, ckv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cq [N, Q] -> RMSNorm(cq); ckv [N, C + R] -> (RMSNorm(ckv[:, :C]), ckv[:, C:]) where
    C = kv_weight.numel(). One launch for both norms of Gated MLA (spec §3.2 step 2)."""
    c = kv_weight.shape[0]
    return (
        rms_norm_ref(cq, q_weight, eps),
        rms_norm_ref(ckv[..., :c], kv_weight, eps),
        ckv[..., c:].clone(),
    )


@mla_lowrank_norm.register_fake
def _(cq, ckv, q_weight, kv_weight, eps):
    c = kv_weight.shape[0]
    return (
        torch.empty_like(cq),
        ckv.new_empty((*ckv.shape[:-1], c)),
        ckv.new_empty((*ckv.shape[:-1], ckv.shape[-1] - c)),
    )
