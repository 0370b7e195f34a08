"""GEMMs with a fused prologue or epilogue: RMSNorm → GEMM, and the SiTU-GLU gate/up GEMM.

    norm_linear:   y = RMSNorm(u; w_norm, eps) · Wᵀ [+ r]           (routed latent norm + up-proj
                                                                     [+ the shared experts' r])
    situ_gate_up:  a = SiTU(x·W_gᵀ, x·W_uᵀ)                         (shared experts, dense MLP)
    SiTU(g, u) = β·tanh(g/β)·sigmoid(g) · β₂·tanh(u/β₂), fp32 math, cast to the GEMM dtype

`situ_gate_up` runs one GEMM over [W_g; W_u]: the concatenation is built once per weight pair
and cached with `k3.linear_concat`'s (a second copy of the two weights; on a GPU it is made by
the first, uncaptured run, so a CUDA graph never replays a cat).
With `stream=s` it runs on side stream s (stage `streams`: the shared experts beside the routed
path; `k3compile.ops.sched`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.ops.linear import concatenated
from k3compile.ops.norms import rms_norm_ref
from k3compile.ops.sched import run_on_stream


def situ_ref(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float):
    g = gate.float()
    u = up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    lin = linear_beta * torch.tanh(u / linear_beta)
    return (act * lin).to(gate.dtype)


# ---- norm_linear --------------------------------------------------------------------------------


def norm_linear_ref(u: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    y = F.linear(rms_norm_ref(u, norm_w, eps), w)
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


# ---- situ_gate_up -------------------------------------------------------------------------------

def gate_up_weight(wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    """[W_g; W_u], concatenated once per weight pair (the cache `k3.linear_concat` keeps)."""
    return concatenated([wg, wu])


def situ_gate_up_ref(x, wg, wu, beta: float, linear_beta: float) -> torch.Tensor:
    gate_up = F.linear(x, gate_up_weight(wg, wu))
    gate, up = gate_up.split(wg.shape[0], dim=-1)
    return situ_ref(gate, up, beta, linear_beta)


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
