"""A plain RMSNorm -> `k3.rms_norm`: what is left after the larger fusions, i.e. layer 0's
input_layernorm (its depth mix has no completed block, so there is no mix to fuse it into).

Matches K3's RMSNorm order (spec §3.3 step 6, `models/k3.py` RMSNorm): normalise in fp32, cast
back, times the weight. Runs last, so it never splits a site a larger pattern would take.

Before: convert, pow, mean, add, rsqrt, mul, convert, mul
After:  y = k3.rms_norm(x, weight, eps)
"""

from __future__ import annotations

import torch

from k3compile.math import rms_norm
from k3compile.rewrite import Pattern, tensor_meta

DTYPES = (torch.bfloat16, torch.float32)  # fp32 models trace no casts


def search(x, weight, eps):
    return rms_norm(x, weight, eps)


def replace(x, weight, eps):
    return torch.ops.k3.rms_norm(x, weight, eps)


def check(match) -> str | None:
    if not isinstance(match.kwargs["eps"], float):
        return "eps is not a compile-time float"
    x, weight = tensor_meta(match.kwargs["x"]), tensor_meta(match.kwargs["weight"])
    if x is None or weight is None:
        return "an input has no tensor metadata"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"x dtype {x.dtype} is not a float type"
    if weight.shape != (x.shape[-1],):
        return f"weight {list(weight.shape)} does not fit width {x.shape[-1]}"
    return None


def _variant(dtype: torch.dtype) -> Pattern:
    def example_inputs():
        return [torch.randn(2, 1, 64, dtype=dtype), torch.randn(64, dtype=dtype), 1.1e-5]

    return Pattern(
        name=f"rms_norm[{str(dtype).removeprefix('torch.')}]", search=search, replace=replace,
        example_inputs=example_inputs, op="k3.rms_norm", check=check, scalars={"eps": 1.1e-5},
        distinctive=("rsqrt", "mean"),
    )


def patterns() -> list[Pattern]:
    return [_variant(d) for d in DTYPES]
