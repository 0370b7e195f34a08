"""`logits, z = k3.moe_front(x, router_w, down_w)`: LatentMoE's two front GEMMs in one launch
(spec §3.3 steps 1-2), as MoEGate and LatentMoE compute them:

    logits = x·W_routerᵀ (fp32),  z = x·W_downᵀ (x's dtype)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_front_ref(x: torch.Tensor, router_w: torch.Tensor, down_w: torch.Tensor):
    return F.linear(x.float(), router_w.float()), F.linear(x, down_w)


def moe_front_refusal(x, router_w, down_w) -> str | None:
    """Constraints of a fused front GEMM: 2-D activations, K-contiguous weights, 16-byte rows."""
    if x.dim() != 2:
        return f"x has {x.dim()} dims (want [N, D])"
    d = x.shape[-1]
    if router_w.shape[-1] != d or down_w.shape[-1] != d:
        return f"weights' input widths {router_w.shape[-1]}, {down_w.shape[-1]} != hidden {d}"
    if d % 8:
        return f"hidden {d} is not a multiple of 8 (16-byte rows)"
    if down_w.dtype != x.dtype:
        return f"latent weight {down_w.dtype} != activations {x.dtype}"
    return None


@torch.library.custom_op("k3::moe_front", mutates_args=())
def moe_front(x: torch.Tensor, router_w: torch.Tensor, down_w: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (router logits fp32 [N, E], latent z [N, L] in x's dtype)."""
    return moe_front_ref(x, router_w, down_w)


@moe_front.register_fake
def _(x, router_w, down_w):
    n = x.shape[:-1]
    return (x.new_empty((*n, router_w.shape[0]), dtype=torch.float32),
            x.new_empty((*n, down_w.shape[0])))
