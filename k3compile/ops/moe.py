"""MoE routing op: fp32 sigmoid scores, bias-corrected top-k, unbiased renormalised weights."""

from __future__ import annotations

import torch


def moe_route_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    scores = torch.sigmoid(logits.float())
    _, ids = torch.topk(scores + bias, top_k, dim=-1)
    weights = scores.gather(-1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


@torch.library.custom_op("k3::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [N, E], bias fp32 [E] -> (ids int64 [N, k], weights fp32 [N, k]).
    Ties in score + bias may resolve to any of the tied experts."""
    return moe_route_ref(logits, bias, top_k, scaling)


@moe_route.register_fake
def _(logits, bias, top_k, scaling):
    n = logits.shape[:-1]
    return (logits.new_empty((*n, top_k), dtype=torch.int64),
            logits.new_empty((*n, top_k), dtype=torch.float32))
