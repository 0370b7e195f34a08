"""`ids, weights = k3.moe_route(logits, bias, top_k, scaling, eps, clamp)`: LatentMoE's
bias-corrected top-k routing (spec §3.3 step 3; `k3compile.math.route_top_k`):

    ids = top_k(sigmoid(logits) + bias),  w = s[ids] / (Σ s[ids] + eps) · scaling
                                      or  w = s[ids] / max(Σ s[ids], eps) · scaling   (clamp)

K3 (and DeepSeek-V3) add eps = 1e-20; routers written elsewhere add another eps, none (eps 0:
Σ + 0.0 is Σ, bit for bit, for the non-negative sums of sigmoid scores) or clamp the sum. The op
carries what the graph did, so it computes the same values.
"""

from __future__ import annotations

import torch

from k3compile.math import route_top_k

EPS = 1e-20  # K3's renormalisation epsilon


def moe_route_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                  eps: float = EPS, clamp: bool = False):
    return route_top_k(logits.float(), bias, top_k, scaling, eps, clamp)


@torch.library.custom_op("k3::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
              eps: float = EPS, clamp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [N, E], bias fp32 or bf16 [E] (promoted to fp32) -> (ids int64 [N, k],
    weights fp32 [N, k]).
    Ties in score + bias may resolve to any of the tied experts."""
    return moe_route_ref(logits, bias, top_k, scaling, eps, clamp)


@moe_route.register_fake
def _(logits, bias, top_k, scaling, eps=EPS, clamp=False):
    n = logits.shape[:-1]
    return (logits.new_empty((*n, top_k), dtype=torch.int64),
            logits.new_empty((*n, top_k), dtype=torch.float32))
