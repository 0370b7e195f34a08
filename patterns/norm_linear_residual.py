"""The MoE's `routed + shared` add folded into the routed up-projection's epilogue ->
`k3.norm_linear(u, norm_w, w, eps, residual)` (spec §5.2 row 13's "up-proj + add").

Runs after `norm_linear` and matches its op's output plus a tensor of the same shape (the shared
experts' down-projection, or its all-reduce at W > 1). The shared branch runs on the side stream
(`k3compile.stages.streams`): its join then lands before this op, which becomes its consumer.

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


def check(match) -> str | None:
    u, w, r = (tensor_meta(match.kwargs[k]) for k in ("u", "w", "residual"))
    if any(t is None for t in (u, w, r)):
        return "an input has no tensor metadata"
    out = (*u.shape[:-1], w.shape[0])
    if tuple(r.shape) != out:
        return f"residual {list(r.shape)} is not the output's {list(out)} (no broadcast epilogue)"
    if r.dtype != u.dtype:
        return f"residual {r.dtype} != activations {u.dtype}"
    return None


def example_inputs():
    return [torch.randn(2, 64), torch.randn(64), torch.randn(32, 64), torch.randn(2, 32), 1.1e-5]


def patterns() -> list[Pattern]:
    # one variant for every dtype: the op hides the casts, the add has none
    return [Pattern(
        name="norm_linear_residual", search=search, replace=replace,
        example_inputs=example_inputs, op="k3.norm_linear", check=check, scalars={"eps": 1.1e-5},
        fake_trace=True, distinctive=("norm_linear", "add"),
    )]
