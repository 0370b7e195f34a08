"""`ids, weights, z = k3.moe_front_route(x, router_w, down_w, bias, top_k, scaling, eps, clamp)`:
LatentMoE's front GEMMs and its routing as one op (spec §3.3 steps 1-3), `k3.moe_front` feeding
`k3.moe_route`, the logits read by nothing else:

    logits = x·W_routerᵀ (fp32),  z = x·W_downᵀ,  (ids, weights) = moe_route(logits, bias, ...)

The reference is the two ops' references in turn, so the fused graph equals the unfused one bit
for bit on CPU.
"""

from __future__ import annotations

import torch

from k3compile.ops.moe_front import moe_front_ref, moe_front_refusal
from k3compile.ops.moe_route import EPS, moe_route_ref


def moe_front_route_ref(x, router_w, down_w, bias, top_k: int, scaling: float, eps: float = EPS,
                        clamp: bool = False):
    logits, z = moe_front_ref(x, router_w, down_w)
    ids, weights = moe_route_ref(logits, bias, top_k, scaling, eps, clamp)
    return ids, weights, z


def moe_front_route_refusal(x, router_w, down_w, bias) -> str | None:
    """moe_front's constraints, and a bias of one score per expert."""
    if why := moe_front_refusal(x, router_w, down_w):
        return why
    if tuple(bias.shape) != (router_w.shape[0],):
        return f"bias {tuple(bias.shape)} (want [{router_w.shape[0]}])"
    return None


@torch.library.custom_op("k3::moe_front_route", mutates_args=())
def moe_front_route(x: torch.Tensor, router_w: torch.Tensor, down_w: torch.Tensor,
                    bias: torch.Tensor, top_k: int, scaling: float, eps: float = EPS,
                    clamp: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, D] -> (ids int64 [N, k], weights fp32 [N, k], latent z [N, L] in x's dtype)."""
    return moe_front_route_ref(x, router_w, down_w, bias, top_k, scaling, eps, clamp)


@moe_front_route.register_fake
def _(x, router_w, down_w, bias, top_k, scaling, eps=EPS, clamp=False):
    n = x.shape[:-1]
    return (x.new_empty((*n, top_k), dtype=torch.int64),
            x.new_empty((*n, top_k), dtype=torch.float32), x.new_empty((*n, down_w.shape[0])))
