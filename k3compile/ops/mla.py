"""Gated MLA decode in the absorbed form (spec §3.2 steps 3, 5-9), three ops around the cache:

    mla_q_absorb:  q = cq·W_qbᵀ -> [q_nope | q_pe] per head;  q_lat[h] = q_nope[h]·W_UK[h]
    mla_decode:    cache[slot, pos .. pos+T-1] <- [c_kv | k_pe];
                   o_lat = softmax(mask_causal((q_lat·c_kvᵀ + q_pe·k_peᵀ)·scale))·c_kv
    mla_uv_gate:   o = (o_lat[h]·W_UV[h]ᵀ over heads) ⊙ sigmoid(g)

W_UK [H, N, C] and W_UV [H, V, C] are the two halves of kv_b_proj.weight viewed [H, N+V, C].
T >= 1 query rows per request (speculative verify): row t sees cache rows 0 .. pos + t.
"""

from __future__ import annotations

import torch


def mla_q_absorb_ref(cq, q_b_weight, w_uk):
    H, N, _ = w_uk.shape
    q = torch.nn.functional.linear(cq, q_b_weight).view(*cq.shape[:-1], H, -1)
    q_nope, q_pe = q.split([N, q.shape[-1] - N], dim=-1)
    return torch.einsum("bthd,hdc->bthc", q_nope, w_uk), q_pe


@torch.library.custom_op("k3::mla_q_absorb", mutates_args=())
def mla_q_absorb(cq: torch.Tensor, q_b_weight: torch.Tensor, w_uk: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cq [B, T, Q], q_b_weight [H·(N+R), Q], w_uk [H, N, C] -> (q_lat [B, T, H, C],
    q_pe [B, T, H, R]), both contiguous."""
    q_lat, q_pe = mla_q_absorb_ref(cq, q_b_weight, w_uk)
    return q_lat.contiguous(), q_pe.contiguous()


@mla_q_absorb.register_fake
def _(cq, q_b_weight, w_uk):
    H, N, C = w_uk.shape
    R = q_b_weight.shape[0] // H - N
    lead = cq.shape[:-1]
    return cq.new_empty((*lead, H, C)), cq.new_empty((*lead, H, R))


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


def mla_uv_gate_ref(o_lat, w_uv, g):
    B, T = o_lat.shape[:2]
    H, V, _ = w_uv.shape
    o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * V)
    return o * torch.sigmoid(g)


@torch.library.custom_op("k3::mla_uv_gate", mutates_args=())
def mla_uv_gate(o_lat: torch.Tensor, w_uv: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """o_lat [B, T, H, C], w_uv [H, V, C], g [B, T, H·V] -> o [B, T, H·V]."""
    return mla_uv_gate_ref(o_lat, w_uv, g).contiguous()


@mla_uv_gate.register_fake
def _(o_lat, w_uv, g):
    dtype = torch.promote_types(torch.promote_types(o_lat.dtype, w_uv.dtype), g.dtype)
    return g.new_empty(g.shape, dtype=dtype)
