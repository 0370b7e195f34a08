"""`y = k3.norm_linear(u, norm_w, w, eps, residual=None, weight_fp32=False)`: RMSNorm as the
prologue of a GEMM (the routed latent's norm + up-projection, spec §3.3 step 6), with the shared
experts' output added in the epilogue when `residual` is given.

    y = RMSNorm(u; norm_w, eps) · Wᵀ [+ residual]

The norm rounds like `math.rms_norm` (normalised row rounded to u's dtype, times the weight in
that dtype); with `weight_fp32` like `math.rms_norm_fp32_weight`: the weight multiplied in fp32,
one rounding to W's dtype, and u may be fp32 (torch's `F.rms_norm` on the routed experts' fp32
sum, as tests/models/redteam_k3.py and spell5_k3.py write the latent norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.math import rms_norm, rms_norm_fp32_weight


def norm_linear_ref(u: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, weight_fp32: bool = False):
    h = rms_norm_fp32_weight(u, norm_w, eps, w.dtype) if weight_fp32 else rms_norm(u, norm_w, eps)
    y = F.linear(h, w)
    return y if residual is None else y + residual


def norm_linear_refusal(u, norm_w, w, weight_fp32: bool = False) -> str | None:
    if u.dim() != 2:
        return f"u has {u.dim()} dims (want [N, L])"
    width = u.shape[-1]
    if norm_w.shape != (width,) or w.shape[-1] != width:
        return f"norm {tuple(norm_w.shape)} / weight {tuple(w.shape)} do not take width {width}"
    if width % 8 or w.shape[0] % 8:
        return f"widths {width} -> {w.shape[0]} are not multiples of 8 (16-byte rows)"
    if weight_fp32:  # the norm in fp32, whatever u's and the norm weight's float dtypes
        if not (u.dtype.is_floating_point and norm_w.dtype.is_floating_point):
            return f"dtypes u {u.dtype}, norm {norm_w.dtype} are not float"
        return None
    if norm_w.dtype != u.dtype or w.dtype != u.dtype:
        return f"dtypes u {u.dtype}, norm {norm_w.dtype}, weight {w.dtype} differ"
    return None


@torch.library.custom_op("k3::norm_linear", mutates_args=())
def norm_linear(u: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None, weight_fp32: bool = False) -> torch.Tensor:
    """u [N, L] -> RMSNorm(u) · wᵀ [N, O] (+ residual [N, O] in the epilogue: the MoE's shared
    experts' output, added to the routed one); y in u's dtype, with `weight_fp32` in w's."""
    return norm_linear_ref(u, norm_w, w, eps, residual, weight_fp32)


@norm_linear.register_fake
def _(u, norm_w, w, eps, residual=None, weight_fp32=False):
    dtype = w.dtype if weight_fp32 else u.dtype
    return u.new_empty((*u.shape[:-1], w.shape[0]), dtype=dtype)
