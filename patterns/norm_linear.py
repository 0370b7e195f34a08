"""RMSNorm followed by one GEMM of the normalised value -> `k3.norm_linear` (the routed latent's
`routed_expert_norm` + `routed_expert_up_proj`, spec §3.3 step 6).

Matches K3's RMSNorm order (normalise in fp32, cast back, times the weight) feeding `F.linear`
on a 2-D input, where nothing else reads the normalised value.

Before: convert, pow, mean, add, rsqrt, mul, convert, mul, permute, mm
After:  y = k3.norm_linear(u, norm_w, w, eps)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.math import rms_norm
from k3compile.ops.norm_linear import norm_linear_refusal
from k3compile.rewrite import Pattern, tensor_meta

DTYPES = (torch.bfloat16, torch.float32)


def search(u, norm_w, w, eps):
    return F.linear(rms_norm(u, norm_w, eps), w)


def replace(u, norm_w, w, eps):
    return torch.ops.k3.norm_linear(u, norm_w, w, eps)


def check(match) -> str | None:
    if not isinstance(match.kwargs["eps"], float):
        return "eps is not a compile-time float"
    u, norm_w, w = (tensor_meta(match.kwargs[k]) for k in ("u", "norm_w", "w"))
    if any(t is None for t in (u, norm_w, w)):
        return "an input has no tensor metadata"
    return norm_linear_refusal(u, norm_w, w)


def _variant(dtype: torch.dtype) -> Pattern:
    def example_inputs():
        return [torch.randn(2, 64, dtype=dtype), torch.randn(64, dtype=dtype),
                torch.randn(32, 64, dtype=dtype), 1.1e-5]

    return Pattern(
        name=f"norm_linear[{str(dtype).removeprefix('torch.')}]", search=search, replace=replace,
        example_inputs=example_inputs, op="k3.norm_linear", check=check, scalars={"eps": 1.1e-5},
        distinctive=("pow", "mean", "rsqrt", "mm"),
    )


def patterns() -> list[Pattern]:
    return [_variant(d) for d in DTYPES]
