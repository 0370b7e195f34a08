"""`u = k3.moe_experts(z, ids, weights, w1p, w1s, w3p, w3s, w2p, w2s, beta, linear_beta,
out_fp32=False)`: the routed MXFP4 experts, FC1 + SiTU + FC2 + finalize (spec §3.3 steps 4-5):

    u = Σ_k w_k · (SiTU(z·W1[ids_k]ᵀ, z·W3[ids_k]ᵀ) · W2[ids_k]ᵀ)

The finalize sums in fp32 and rounds to z's dtype; with `out_fp32` it returns the fp32 sum
unrounded (a spelling that feeds that sum to the latent norm in fp32, tests/models/redteam_k3.py
and spell5_k3.py: the rounding is part of its values).

The reference is the model's `MXFP4Experts.forward` (`k3compile.math.mxfp4_experts`) with the
E2M1 table built by the op, so a rewritten graph equals eager on CPU.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from k3compile import math

_E2M1: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> the E2M1 table


def e2m1_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The 16 E2M1 values, built once per device and dtype: a CUDA graph cannot capture the
    host-to-device copy that making it takes."""
    key = (device, dtype)
    if key not in _E2M1:  # a real table even when first asked for under a fake mode
        with unset_fake_temporarily():
            _E2M1[key] = math.e2m1_table(device, dtype)
    return _E2M1[key]


def moe_experts_ref(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                    w2_scale, beta: float, linear_beta: float,
                    out_fp32: bool = False) -> torch.Tensor:
    """W4A16: dequantise the selected experts to z's dtype, bf16 GEMMs, fp32 finalize (rounded
    to z's dtype unless `out_fp32`)."""
    return math.mxfp4_experts(z, ids, weights, e2m1_table(z.device, z.dtype), w1_packed,
                              w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta,
                              linear_beta, torch.float32 if out_fp32 else None)


def moe_experts_refusal(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                        w2_scale) -> str | None:
    """Constraints of the op (FC1+SiTU+FC2+finalize over stacked MXFP4 experts)."""
    if z.dim() != 2 or ids.dim() != 2 or ids.shape != weights.shape:
        return f"z {tuple(z.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)}"
    n_exp, inter, half = w1_packed.shape
    latent = z.shape[-1]
    if 2 * half != latent or w3_packed.shape != w1_packed.shape:
        return f"FC1 packed {tuple(w1_packed.shape)} does not take latent width {latent}"
    if w2_packed.shape != (n_exp, latent, inter // 2):
        return f"FC2 packed {tuple(w2_packed.shape)} != [{n_exp}, {latent}, {inter // 2}]"
    if latent % math.GROUP or inter % math.GROUP:
        return f"latent {latent} / intermediate {inter} not multiples of {math.GROUP}"
    scales = ((w1_scale, (n_exp, inter, latent // 32)), (w3_scale, (n_exp, inter, latent // 32)),
              (w2_scale, (n_exp, latent, inter // 32)))
    for s, want in scales:
        if tuple(s.shape) != want:
            return f"scale {tuple(s.shape)} != {list(want)} (one E8M0 byte per 32 inputs)"
    if ids.shape[-1] > n_exp:
        return f"top_k {ids.shape[-1]} > {n_exp} experts"
    return None


@torch.library.custom_op("k3::moe_experts", mutates_args=())
def moe_experts(
    z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    w1_packed: torch.Tensor, w1_scale: torch.Tensor, w3_packed: torch.Tensor,
    w3_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
    beta: float, linear_beta: float, out_fp32: bool = False,
) -> torch.Tensor:
    """z [N, L], ids int64 [N, k], weights fp32 [N, k], experts stacked MXFP4
    (w1/w3 [E, I, L/2] + [E, I, L/32], w2 [E, L, I/2] + [E, L, I/32]) -> u [N, L] in z's dtype
    (fp32 with `out_fp32`). Under TP, I is this rank's slice of the intermediate and u a partial
    sum."""
    return moe_experts_ref(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                           w2_scale, beta, linear_beta, out_fp32)


@moe_experts.register_fake
def _(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta,
      linear_beta, out_fp32=False):
    return torch.empty_like(z, dtype=torch.float32 if out_fp32 else z.dtype)
