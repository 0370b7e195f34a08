"""Stable LatentMoE ops (spec §3.3): the front GEMMs, routing, and the MXFP4 routed experts.

    moe_front:   logits = x·W_routerᵀ (fp32), z = x·W_downᵀ          one launch, two outputs
    moe_route:   ids = top_k(sigmoid(logits) + bias), w = s[ids] / (Σ s[ids] + 1e-20) · scaling
    moe_experts: u = Σ_k w_k · (SiTU(z·W1[ids_k]ᵀ, z·W3[ids_k]ᵀ) · W2[ids_k]ᵀ)   FC1+SiTU+FC2+finalize

Each CPU implementation is the reference and rounds like the model code (`models/k3.py`:
MoEGate, LatentMoE, MXFP4Experts), so a rewritten graph equals eager on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.models import mxfp4
from k3compile.ops.gemm import situ_ref

# ---- moe_front ----------------------------------------------------------------------------------


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


# ---- moe_route ----------------------------------------------------------------------------------


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


# ---- moe_experts --------------------------------------------------------------------------------


_E2M1: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> the E2M1 table


def e2m1_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The 16 E2M1 values, built once per device and dtype: a CUDA graph cannot capture the
    host-to-device copy that making it takes."""
    key = (device, dtype)
    if key not in _E2M1:
        _E2M1[key] = mxfp4.e2m1_table(device, dtype)
    return _E2M1[key]


def moe_experts_ref(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                    w2_scale, beta: float, linear_beta: float) -> torch.Tensor:
    """W4A16: dequantise the selected experts to z's dtype, bf16 GEMMs, fp32 finalize."""
    return experts_math(z, ids, weights, e2m1_table(z.device, z.dtype), w1_packed, w1_scale,
                        w3_packed, w3_scale, w2_packed, w2_scale, beta, linear_beta)


def experts_math(z, ids, weights, lut, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                 w2_scale, beta: float, linear_beta: float) -> torch.Tensor:
    """The routed experts as the model writes them (`MXFP4Experts.forward`), given the E2M1 table
    in z's dtype: shared by the op's reference and the pattern's search."""
    w1 = mxfp4.dequantize(w1_packed[ids], w1_scale[ids], lut)  # [N, k, I, L]
    w3 = mxfp4.dequantize(w3_packed[ids], w3_scale[ids], lut)
    w2 = mxfp4.dequantize(w2_packed[ids], w2_scale[ids], lut)  # [N, k, L, I]
    hg = torch.einsum("nl,nkil->nki", z, w1)
    hu = torch.einsum("nl,nkil->nki", z, w3)
    act = situ_ref(hg, hu, beta, linear_beta)
    y = torch.einsum("nki,nkli->nkl", act, w2)
    return (weights.unsqueeze(-1) * y.float()).sum(1).to(z.dtype)


def moe_experts_refusal(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                        w2_scale) -> str | None:
    """Constraints of the grouped MXFP4 kernel (FC1+SiTU+FC2+finalize)."""
    if z.dim() != 2 or ids.dim() != 2 or ids.shape != weights.shape:
        return f"z {tuple(z.shape)}, ids {tuple(ids.shape)}, weights {tuple(weights.shape)}"
    n_exp, inter, half = w1_packed.shape
    latent = z.shape[-1]
    if 2 * half != latent or w3_packed.shape != w1_packed.shape:
        return f"FC1 packed {tuple(w1_packed.shape)} does not take latent width {latent}"
    if w2_packed.shape != (n_exp, latent, inter // 2):
        return f"FC2 packed {tuple(w2_packed.shape)} != [{n_exp}, {latent}, {inter // 2}]"
    if latent % mxfp4.GROUP or inter % mxfp4.GROUP:
        return f"latent {latent} / intermediate {inter} not multiples of {mxfp4.GROUP}"
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
    beta: float, linear_beta: float,
) -> torch.Tensor:
    """z [N, L], ids int64 [N, k], weights fp32 [N, k], experts stacked MXFP4
    (w1/w3 [E, I, L/2] + [E, I, L/32], w2 [E, L, I/2] + [E, L, I/32]) -> u [N, L] in z's dtype.
    Under TP, I is this rank's slice of the intermediate and u a partial sum."""
    return moe_experts_ref(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                           w2_scale, beta, linear_beta)


@moe_experts.register_fake
def _(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale, beta,
      linear_beta):
    return torch.empty_like(z)
