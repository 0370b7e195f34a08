"""`o = k3.mla_uv_gate(o_lat, w_uv, g)`: Gated MLA's W_UV up-projection and sigmoid output gate
(spec §3.2 steps 8-9):

    o = (o_lat[h]·W_UV[h]ᵀ over heads) ⊙ sigmoid(g)

W_UV [H, V, C] is the second half of kv_b_proj.weight viewed [H, N+V, C].

`gate_fp32`: the gate product in fp32, one rounding to o's dtype (`(o.float() *
sigmoid(g.float())).to(o.dtype)`: a model whose output gate is an fp32 island under autocast,
tests/models/spell11_k3.py), where the default rounds sigmoid(g) to g's dtype and multiplies in
it; the projection o is rounded to its dtype first either way. The same in fp32.
"""

from __future__ import annotations

import torch


def mla_uv_gate_ref(o_lat, w_uv, g, gate_fp32=False):
    B, T = o_lat.shape[:2]
    H, V, _ = w_uv.shape
    o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * V)
    if gate_fp32:
        return (o.float() * torch.sigmoid(g.float())).to(o.dtype)
    return o * torch.sigmoid(g)


@torch.library.custom_op("k3::mla_uv_gate", mutates_args=())
def mla_uv_gate(o_lat: torch.Tensor, w_uv: torch.Tensor, g: torch.Tensor,
                gate_fp32: bool = False) -> torch.Tensor:
    """o_lat [B, T, H, C], w_uv [H, V, C], g [B, T, H·V] -> o [B, T, H·V]."""
    return mla_uv_gate_ref(o_lat, w_uv, g, gate_fp32).contiguous()


@mla_uv_gate.register_fake
def _(o_lat, w_uv, g, gate_fp32=False):
    dtype = torch.promote_types(torch.promote_types(o_lat.dtype, w_uv.dtype), g.dtype)
    return g.new_empty(g.shape, dtype=dtype)
