"""`y = k3.rms_norm(x, weight, eps)`: a plain RMSNorm (what the larger fusions leave: layer 0's
input_layernorm). The reference is the model's RMSNorm (`k3compile.math.rms_norm`)."""

from __future__ import annotations

import torch

from k3compile import math

rms_norm_ref = math.rms_norm  # normalise in fp32, cast to x's dtype, times the weight


@torch.library.custom_op("k3::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
