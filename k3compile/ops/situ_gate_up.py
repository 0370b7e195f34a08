"""`a = k3.situ_gate_up(x, W_g, W_u, beta, linear_beta, stream=s)`: the SiTU-GLU gate/up GEMM
with SiTU in the epilogue (shared experts, dense MLP).

    a = SiTU(x·W_gᵀ, x·W_uᵀ)     SiTU(g, u) = β·tanh(g/β)·sigmoid(g) · β₂·tanh(u/β₂), fp32 math,
                                 cast to the GEMM dtype (`k3compile.math.situ`)

The CUDA kernel runs one GEMM over [W_g; W_u]: a view where stage `pack` stored the pair back to
back, else concatenated at every call (`k3compile.ops.linear_concat.concatenated`: no cached copy
can go stale). The reference computes the two GEMMs apart, as the unfused graph does. With `stream=s` it runs on side stream s
(stage `streams`: the shared experts beside the routed path; `k3compile.ops.side_streams`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.math import situ
from k3compile.ops.linear_concat import concatenated
from k3compile.ops.side_streams import run_on_stream


def gate_up_weight(wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    """[W_g; W_u] for the kernel's one GEMM (a view where packed, else a fresh copy)."""
    return concatenated([wg, wu])


def situ_gate_up_ref(x, wg, wu, beta: float, linear_beta: float) -> torch.Tensor:
    return situ(F.linear(x, wg), F.linear(x, wu), beta, linear_beta)


def situ_gate_up_refusal(x, wg, wu) -> str | None:
    if wg.shape != wu.shape or wg.dim() != 2:
        return f"gate {tuple(wg.shape)} and up {tuple(wu.shape)} weights differ"
    if x.shape[-1] != wg.shape[-1]:
        return f"x width {x.shape[-1]} != weight input width {wg.shape[-1]}"
    if x.shape[-1] % 8 or wg.shape[0] % 8:
        return f"widths {x.shape[-1]} -> {wg.shape[0]} are not multiples of 8 (16-byte rows)"
    if wg.dtype != x.dtype or wu.dtype != x.dtype:
        return f"weights {wg.dtype} != activations {x.dtype}"
    return None


@torch.library.custom_op(
    "k3::situ_gate_up", mutates_args=(),
    schema="(Tensor x, Tensor wg, Tensor wu, float beta, float linear_beta, *, int stream=0)"
           " -> Tensor")
def situ_gate_up(x, wg, wu, beta, linear_beta, *, stream=0):
    """x [..., D], W_g/W_u [I, D] -> SiTU(x·W_gᵀ, x·W_uᵀ) [..., I] in x's dtype, on CUDA side
    stream `stream` when it is not 0 (stage `streams`: the shared experts)."""
    return run_on_stream(stream, situ_gate_up_ref, x, wg, wu, beta, linear_beta)


@situ_gate_up.register_fake
def _(x, wg, wu, beta, linear_beta, *, stream=0):
    return x.new_empty((*x.shape[:-1], wg.shape[0]))
