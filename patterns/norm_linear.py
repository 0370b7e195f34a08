"""RMSNorm followed by one GEMM of the normalised value -> `k3.norm_linear` (the routed latent's
`routed_expert_norm` + `routed_expert_up_proj`, spec §3.3 step 6).

Matches K3's RMSNorm order (normalise in fp32, cast back, times the weight) feeding `F.linear`
on a 2-D input, where nothing else reads the normalised value.

Variants `weight_fp32` (traced for a bf16 GEMM): the norm of an fp32 u (the routed experts' fp32
sum) with the weight multiplied in fp32 before the one rounding to the GEMM's dtype, the weight cast
explicitly (`F.rms_norm(u, ..., w.float())`, tests/models/redteam_k3.py) or by type promotion
(`h * w` with h fp32, an RMSNorm module on an fp32 input, spell5_k3.py) -> the op's
`weight_fp32`. Another rounding than K3's, so a variant, not a canonical rule.

Before: convert, pow, mean, add, rsqrt, mul, convert, mul, permute, mm
After:  y = k3.norm_linear(u, norm_w, w, eps [, None, True])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.math import rms_norm
from k3compile.ops.norm_linear import norm_linear_refusal
from k3compile.rewrite import Pattern, tensor_meta

DTYPES = (torch.bfloat16, torch.float32)
LOW = (torch.bfloat16, torch.float16)  # GEMM dtypes where weight_fp32 is another rounding


def search(u, norm_w, w, eps):
    return F.linear(rms_norm(u, norm_w, eps), w)


def replace(u, norm_w, w, eps):
    return torch.ops.k3.norm_linear(u, norm_w, w, eps)


def _search_fp32(cast: bool):
    def search(u, norm_w, w, eps):
        h = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
        return F.linear((h * (norm_w.float() if cast else norm_w)).to(w.dtype), w)
    return search


def replace_fp32(u, norm_w, w, eps):
    return torch.ops.k3.norm_linear(u, norm_w, w, eps, None, True)


def check(match, weight_fp32: bool = False) -> str | None:
    if not isinstance(match.kwargs["eps"], float):
        return "eps is not a compile-time float"
    u, norm_w, w = (tensor_meta(match.kwargs[k]) for k in ("u", "norm_w", "w"))
    if any(t is None for t in (u, norm_w, w)):
        return "an input has no tensor metadata"
    if weight_fp32 and (u.dtype != torch.float32 or w.dtype not in LOW):
        return f"u {u.dtype}, weight {w.dtype}: not an fp32 norm before a {LOW} GEMM"
    return norm_linear_refusal(u, norm_w, w, weight_fp32)


def _variant(dtype: torch.dtype) -> Pattern:
    def example_inputs():
        return [torch.randn(2, 64, dtype=dtype), torch.randn(64, dtype=dtype),
                torch.randn(32, 64, dtype=dtype), 1.1e-5]

    return Pattern(
        name=f"norm_linear[{str(dtype).removeprefix('torch.')}]", search=search, replace=replace,
        example_inputs=example_inputs, op="k3.norm_linear", check=check, scalars={"eps": 1.1e-5},
        distinctive=("pow", "mean", "rsqrt", "mm"),
    )


def _variant_fp32(dtype: torch.dtype, cast: bool) -> Pattern:
    def example_inputs():  # u fp32 (the experts' sum), the weights in the GEMM's dtype
        return [torch.randn(2, 64), torch.randn(64, dtype=dtype),
                torch.randn(32, 64, dtype=dtype), 1.1e-5]

    return Pattern(
        name=f"norm_linear[{str(dtype).removeprefix('torch.')},weight_fp32"
             f"{',cast' if cast else ''}]",
        search=_search_fp32(cast), replace=replace_fp32, example_inputs=example_inputs,
        op="k3.norm_linear", check=lambda m: check(m, weight_fp32=True), scalars={"eps": 1.1e-5},
        distinctive=("pow", "mean", "rsqrt", "mm"),
    )


def patterns() -> list[Pattern]:
    return [*(_variant(d) for d in DTYPES),
            *(_variant_fp32(torch.bfloat16, c) for c in (True, False))]
