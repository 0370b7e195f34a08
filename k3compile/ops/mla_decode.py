"""`o_lat = k3.mla_decode(q_lat, q_pe, c_kv, k_pe, kv_cache!, slots, positions, scale)`: Gated
MLA's cache write and attention in the absorbed form (spec §3.2 steps 5-7):

    cache[slot, pos .. pos+T-1] <- [c_kv | k_pe];
    o_lat = softmax(mask_causal((q_lat·c_kvᵀ + q_pe·k_peᵀ)·scale))·c_kv

T >= 1 query rows per request (speculative verify): row t sees cache rows 0 .. pos + t.
"""

from __future__ import annotations

import torch


def mla_decode_ref(q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions, scale):
    """The model's cache write + absorbed attention (`GatedMLA.forward`), op for op."""
    B, T = q_lat.shape[:2]
    C, R = c_kv.shape[-1], k_pe.shape[-1]
    pos = positions.view(B, 1) + torch.arange(T, device=q_lat.device)  # [B, T]
    kv_cache[slots.view(B, 1), pos] = torch.cat([c_kv, k_pe], dim=-1)
    cache = kv_cache[slots]  # [B, L, C + R]
    kv_lat, kv_pe = cache.split([C, R], dim=-1)
    scores = (torch.einsum("bthc,blc->bthl", q_lat, kv_lat)
              + torch.einsum("bthr,blr->bthl", q_pe, kv_pe))
    scores = scores.float() * scale
    visible = torch.arange(cache.shape[1], device=q_lat.device).view(1, 1, -1) <= pos.unsqueeze(-1)
    scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q_lat.dtype)
    return torch.einsum("bthl,blc->bthc", p, kv_lat)


@torch.library.custom_op("k3::mla_decode", mutates_args=("kv_cache",))
def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               kv_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, scale: float
               ) -> torch.Tensor:
    """q_lat [B, T, H, C], q_pe [B, T, H, R], c_kv [B, T, C], k_pe [B, T, R]; kv_cache
    [S, L, C + R] (rows pos .. pos+T-1 of each slot written in place); slots, positions int64 [B].
    Returns o_lat [B, T, H, C] (contiguous)."""
    return mla_decode_ref(q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions, scale).contiguous()


@mla_decode.register_fake
def _(q_lat, q_pe, c_kv, k_pe, kv_cache, slots, positions, scale):
    return torch.empty_like(q_lat, memory_format=torch.contiguous_format)
