"""`q_lat, q_pe = k3.mla_q_absorb(cq, q_b_weight, w_uk)`: Gated MLA's query up-projection with
W_UK absorbed (spec §3.2 step 3):

    q = cq·W_qbᵀ -> [q_nope | q_pe] per head;  q_lat[h] = q_nope[h]·W_UK[h]

W_UK [H, N, C] is the first half of kv_b_proj.weight viewed [H, N+V, C].
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
