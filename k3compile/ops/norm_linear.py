"""`y = k3.norm_linear(u, norm_w, w, eps, residual=None)`: RMSNorm as the prologue of a GEMM
(the routed latent's norm + up-projection, spec §3.3 step 6), with the shared experts' output
added in the epilogue when `residual` is given.

    y = RMSNorm(u; norm_w, eps) · Wᵀ [+ residual]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.math import rms_norm


def norm_linear_ref(u: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    y = F.linear(rms_norm(u, norm_w, eps), w)
    return y if residual is None else y + residual


def norm_linear_refusal(u, norm_w, w) -> str | None:
    if u.dim() != 2:
        return f"u has {u.dim()} dims (want [N, L])"
    width = u.shape[-1]
    if norm_w.shape != (width,) or w.shape[-1] != width:
        return f"norm {tuple(norm_w.shape)} / weight {tuple(w.shape)} do not take width {width}"
    if width % 8 or w.shape[0] % 8:
        return f"widths {width} -> {w.shape[0]} are not multiples of 8 (16-byte rows)"
    if norm_w.dtype != u.dtype or w.dtype != u.dtype:
        return f"dtypes u {u.dtype}, norm {norm_w.dtype}, weight {w.dtype} differ"
    return None


@torch.library.custom_op("k3::norm_linear", mutates_args=())
def norm_linear(u: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """u [N, L] -> RMSNorm(u) · wᵀ [N, O] (+ residual [N, O] in the epilogue: the MoE's shared
    experts' output, added to the routed one)."""
    return norm_linear_ref(u, norm_w, w, eps, residual)


@norm_linear.register_fake
def _(u, norm_w, w, eps, residual=None):
    return u.new_empty((*u.shape[:-1], w.shape[0]))
