"""The MoE's `routed + shared` add folded into the routed up-projection's epilogue ->
`k3.norm_linear(u, norm_w, w, eps, residual)` (spec §5.2 row 13's "up-proj + add").

Runs after `norm_linear` and matches its op's output plus a tensor of the same shape (the shared
experts' down-projection, or its all-reduce at W > 1). The shared branch runs on the side stream
(`k3compile.stages.streams`): its join then lands before this op, which becomes its consumer.

Variant `weight_fp32`: the same on `k3.norm_linear(..., weight_fp32=True)` (its u fp32, the
output and the residual in the GEMM's dtype); the flag is carried over.

Before: y = k3.norm_linear(u, norm_w, w, eps); out = add(y, shared)
After:  out = k3.norm_linear(u, norm_w, w, eps, shared)
"""

from __future__ import annotations

import torch

from k3compile.rewrite import Pattern, tensor_meta


def search(u, norm_w, w, residual, eps):
    return torch.ops.k3.norm_linear(u, norm_w, w, eps) + residual


def replace(u, norm_w, w, residual, eps):
    return torch.ops.k3.norm_linear(u, norm_w, w, eps, residual)


def search_fp32(u, norm_w, w, residual, eps):
    return torch.ops.k3.norm_linear(u, norm_w, w, eps, None, True) + residual


def replace_fp32(u, norm_w, w, residual, eps):
    return torch.ops.k3.norm_linear(u, norm_w, w, eps, residual, True)


def check(match, weight_fp32: bool = False) -> str | None:
    u, w, r = (tensor_meta(match.kwargs[k]) for k in ("u", "w", "residual"))
    if any(t is None for t in (u, w, r)):
        return "an input has no tensor metadata"
    out = (*u.shape[:-1], w.shape[0])
    if tuple(r.shape) != out:
        return f"residual {list(r.shape)} is not the output's {list(out)} (no broadcast epilogue)"
    y_dtype = w.dtype if weight_fp32 else u.dtype
    if r.dtype != y_dtype:
        return f"residual {r.dtype} != the output's {y_dtype}"
    return None


def example_inputs():
    return [torch.randn(2, 64), torch.randn(64), torch.randn(32, 64), torch.randn(2, 32), 1.1e-5]


def example_inputs_fp32():
    bf16 = {"dtype": torch.bfloat16}
    return [torch.randn(2, 64), torch.randn(64, **bf16), torch.randn(32, 64, **bf16),
            torch.randn(2, 32, **bf16), 1.1e-5]


def patterns() -> list[Pattern]:
    # one variant for every dtype: the op hides the casts, the add has none
    return [Pattern(
        name="norm_linear_residual", search=search, replace=replace,
        example_inputs=example_inputs, op="k3.norm_linear", check=check, scalars={"eps": 1.1e-5},
        fake_trace=True, distinctive=("norm_linear", "add"),
    ), Pattern(
        name="norm_linear_residual[weight_fp32]", search=search_fp32, replace=replace_fp32,
        example_inputs=example_inputs_fp32, op="k3.norm_linear",
        check=lambda m: check(m, weight_fp32=True), scalars={"eps": 1.1e-5}, fake_trace=True,
        distinctive=("norm_linear", "add"),
    )]
