"""The gate and up GEMMs of a SiTU-GLU MLP with the SiTU epilogue -> `k3.situ_gate_up`
(shared experts and the dense layer-0 MLP, spec §3.3 step 7; §5.2 row 9). The down GEMM stays
a plain GEMM.

Matches `situ(F.linear(x, W_g), F.linear(x, W_u), β, β₂)` with SiTU in fp32 (the casts vanish in
an fp32 model); x is [N, D] (shared experts, after LatentMoE's reshape) or [B, T, D] (dense MLP).

Before: mm, mm, convert, convert, div, tanh, mul, sigmoid, mul, div, tanh, mul, mul, convert
After:  a = k3.situ_gate_up(x, W_g, W_u, beta, linear_beta)
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from k3compile.math import situ
from k3compile.ops.situ_gate_up import situ_gate_up_refusal
from k3compile.rewrite import Pattern, tensor_meta

DTYPES = (torch.bfloat16, torch.float32)
RANKS = (2, 3)  # x [N, D] or [B, T, D]


def search(x, wg, wu, beta, linear_beta):
    return situ(F.linear(x, wg), F.linear(x, wu), beta, linear_beta)


def replace(x, wg, wu, beta, linear_beta):
    return torch.ops.k3.situ_gate_up(x, wg, wu, beta, linear_beta)


def check(match) -> str | None:
    for name in ("beta", "linear_beta"):
        if not isinstance(match.kwargs[name], float):
            return f"{name} is not a compile-time float"
    x, wg, wu = (tensor_meta(match.kwargs[k]) for k in ("x", "wg", "wu"))
    if any(t is None for t in (x, wg, wu)):
        return "an input has no tensor metadata"
    return situ_gate_up_refusal(x, wg, wu)


def _variant(dtype: torch.dtype, rank: int) -> Pattern:
    def example_inputs():
        lead = (2, 3)[:rank - 1]
        return [torch.randn(*lead, 64, dtype=dtype), torch.randn(32, 64, dtype=dtype),
                torch.randn(32, 64, dtype=dtype), 4.1, 25.3]

    return Pattern(
        name=f"situ_gate_up[{str(dtype).removeprefix('torch.')},{rank}d]", search=search,
        replace=replace, example_inputs=example_inputs, op="k3.situ_gate_up", check=check,
        scalars={"beta": 4.1, "linear_beta": 25.3}, distinctive=("tanh", "sigmoid", "mm"),
    )


def patterns() -> list[Pattern]:
    return [_variant(d, r) for d, r in itertools.product(DTYPES, RANKS)]
