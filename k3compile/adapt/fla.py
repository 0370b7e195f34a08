"""Torch stand-ins for the flash-linear-attention (fla) entry points Moonshot's KDA layer calls.

fla's kernels are Triton (no CPU path) and opaque to Dynamo, so neither Moonshot's eager model on
a CPU nor a traced decode step can use them. These functions and modules take fla's arguments and
state layouts and compute what fla documents, in plain torch ops that trace into the ATen graph
the canonical rules and the patterns read:

    ShortConvolution      causal depthwise conv over [cache (W inputs), x], SiLU; state [N, D, W]
    FusedRMSNormGated     x / rms(x) · w · act(g), fp32 math, one rounding to x's dtype
    fused_recurrent_kda   the gated delta rule token by token on an fp32 state [N, H, K, V]
    chunk_kda             the same recurrence (fla's chunked form computes the same values)

Gate and beta follow fla's in-kernel options: decay = exp(lower_bound · σ(e^A_log · (g + dt_bias)))
(or exp(-e^A_log · softplus(g + dt_bias)) without a bound), β = σ(b); q and k L2-normalised
(eps 1e-6 inside the root), q scaled by K^-½. `state_v_first` (alias `transpose_state_layout`)
stores the state as [N, H, V, K]. Variable-length batches (`cu_seqlens`) are not taken.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from k3compile.math import delta_rule_step, l2norm

L2_EPS = 1e-6


def _no_varlen(cu_seqlens):
    if cu_seqlens is not None:
        raise NotImplementedError("k3compile's fla stand-ins take equal-length batches only")


class ShortConvolution(nn.Conv1d):
    """fla's `ShortConvolution`: a depthwise causal conv whose cache holds the last W inputs."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False,
                 activation: str | None = "silu", backend: str | None = None, device=None,
                 dtype=None, **_):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias,
                         padding=kernel_size - 1, device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.activation = activation
        self.backend = backend

    def forward(self, x, residual=None, mask=None, cache=None, output_final_state=False,
                cu_seqlens=None, **_):
        return short_convolution(self, x, residual, mask, cache, output_final_state, cu_seqlens)


def short_convolution(conv: nn.Conv1d, x, residual=None, mask=None, cache=None,
                      output_final_state=False, cu_seqlens=None):
    """y [B, T, D] and the new cache of `conv` (any module with a depthwise `weight` [D, 1, W],
    optional `bias` and `activation`) over x [B, T, D]. The cache is fla's [B, D, W] (the last W
    inputs; the oldest is never read again) or, as k3compile's adapter keeps it, [B, D, W - 1]:
    the new cache has the width of the one given."""
    _no_varlen(cu_seqlens)
    width = conv.weight.shape[-1]
    if mask is not None:
        x = x * mask.unsqueeze(-1)
    if cache is None:
        cache = x.new_zeros(x.shape[0], x.shape[2], width)
    kept = cache.shape[-1]  # the width handed back
    past = cache if kept == width - 1 else cache[..., kept - width + 1:]
    window = torch.cat([past, x.transpose(1, 2)], dim=-1)  # [B, D, W - 1 + T]
    bias = None if conv.bias is None else conv.bias.float()
    y = F.conv1d(window.float(), conv.weight.float(), bias, groups=conv.weight.shape[0])
    if conv.activation in ("silu", "swish"):
        y = F.silu(y)
    y = y.to(x.dtype).transpose(1, 2)
    if residual is not None:
        y = y + residual
    return y, (window[..., window.shape[-1] - kept:] if output_final_state else None)


class FusedRMSNormGated(nn.Module):
    """fla's `FusedRMSNormGated`: RMSNorm of x times act(g), fp32 math, cast once."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device=None, dtype=None):
        super().__init__()
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"Unsupported activation: {activation}")
        self.hidden_size, self.elementwise_affine = hidden_size, elementwise_affine
        self.eps, self.activation = eps, activation
        weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.weight = weight if elementwise_affine else None
        self.register_parameter("bias", None)

    def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        return rms_norm_gated(self, x, g, residual, prenorm)


def rms_norm_gated(norm: nn.Module, x, g, residual=None, prenorm=False):
    """`FusedRMSNormGated.forward` for any module with fla's attributes (weight, eps, activation)."""
    if residual is not None or prenorm:
        raise NotImplementedError("k3compile's FusedRMSNormGated stand-in has no residual path")
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    if norm.weight is not None:
        h = h * norm.weight.float()
    gate = g.float()
    gate = torch.sigmoid(gate) if norm.activation == "sigmoid" else F.silu(gate)
    return (h * gate).to(x.dtype)


def kda_decay(g, A_log, dt_bias, lower_bound):
    """fla's in-kernel KDA gate: the per-channel decay factor (not its log), fp32 [B, T, H, K]."""
    heads, dim = g.shape[-2:]
    f = g.float()
    if dt_bias is not None:
        f = f + dt_bias.view(heads, dim)
    a = torch.exp(A_log.float()).view(heads, 1) if A_log is not None else None
    if lower_bound is not None:
        return torch.exp(lower_bound * torch.sigmoid(f if a is None else a * f))
    return torch.exp(-a * F.softplus(f))


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None,
                        initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                        lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs):
    """fla's `fused_recurrent_kda`: o [B, T, H, V] in q's dtype, final state fp32."""
    _no_varlen(cu_seqlens)
    state_v_first = kwargs.pop("transpose_state_layout", state_v_first)
    kwargs.pop("safe_gate", None)
    B, T, H, K = q.shape
    dtype = v.dtype
    scale = K**-0.5 if scale is None else scale
    q, k = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q, L2_EPS), l2norm(k, L2_EPS)
    q = q * scale
    decay = kda_decay(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else torch.exp(g.float())
    beta = beta.float()
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta) * 2 if allow_neg_eigval else torch.sigmoid(beta)
    if initial_state is None:
        state = q.new_zeros(B, H, K, v.shape[-1])
    else:
        state = initial_state.transpose(-1, -2) if state_v_first else initial_state
    v = v.float()
    outs = []
    for t in range(T):
        state, o_t = delta_rule_step(state, q, k, v, beta, decay, t)
        outs.append(o_t)
    o = torch.stack(outs, dim=1).to(dtype)
    if not output_final_state:
        return o, None
    return o, (state.transpose(-1, -2) if state_v_first else state)


def chunk_kda(q, k, v, g, beta, **kwargs):
    """fla's `chunk_kda` (prefill): the same recurrence, computed token by token."""
    kwargs.pop("chunk_size", None)
    return fused_recurrent_kda(q, k, v, g, beta, **kwargs)


def prepare_lens_from_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(-1, dtype=torch.int32)


def prepare_cu_seqlens_from_mask(mask: torch.Tensor, dtype=torch.int32) -> torch.Tensor:
    return F.pad(prepare_lens_from_mask(mask).cumsum(0, dtype=dtype), (1, 0))


def tensor_cache(fn):
    return fn


def _modules() -> dict[str, types.ModuleType]:
    """The fla module tree Moonshot's file imports from, holding these stand-ins."""
    names = {
        "fla": {}, "fla.modules": {"ShortConvolution": ShortConvolution,
                                   "FusedRMSNormGated": FusedRMSNormGated},
        "fla.ops": {}, "fla.ops.kda": {"chunk_kda": chunk_kda,
                                       "fused_recurrent_kda": fused_recurrent_kda},
        "fla.ops.utils": {}, "fla.ops.utils.index": {
            "prepare_lens_from_mask": prepare_lens_from_mask,
            "prepare_cu_seqlens_from_mask": prepare_cu_seqlens_from_mask},
        "fla.utils": {"tensor_cache": tensor_cache},
    }
    mods = {}
    for name, attrs in names.items():
        mod = types.ModuleType(name, f"k3compile's torch stand-in for {name}")
        mod.__dict__.update(attrs)
        mod.__path__ = []
        mods[name] = mod
    return mods


@contextmanager
def installed():
    """Within the block, `import fla...` gives these stand-ins; sys.modules is restored after."""
    mods = _modules()
    saved = {name: sys.modules.get(name) for name in mods}
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name, prev in saved.items():
            if prev is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = prev
