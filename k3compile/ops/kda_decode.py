"""`o = k3.kda_decode(q, k, v, g, graw, b, conv_state!, recurrent_state!, slots, ...)`: the KDA
recurrent step of one layer, whole (spec §3.1 steps 3-7; vLLM's fused_kda_decode):

    window = [conv_state, q|k|v]  ->  conv_state <- last K-1 inputs
    q, k, v = SiLU(depthwise conv(window))                      (fp32 math, cast back)
    q̂ = l2norm(q)·q_scale, k̂ = l2norm(k)                        (eps inside the sqrt)
    α = exp(lower_bound·sigmoid(exp(A_log)·(graw + dt_bias))),  β = sigmoid(b)
    per token t: S <- Diag(α_t)·S;  S <- S + k̂_t·(β_t(v_t − Sᵀk̂_t))ᵀ;  o_t = Sᵀq̂_t   (fp32 S)
    o = RMSNorm_head(o; o_norm_weight) ⊙ sigmoid(g)

`norm_fp32`: the output norm and gate in fp32 with one rounding (fla's `FusedRMSNormGated`, which
Moonshot's KDA layer calls), not rounded to the activations' dtype after the norm, the weight and
the gate as the built-in model does; the two differ only in bf16/fp16.

`conv_time_major`: the conv state buffer is [S, taps-1, 3·H·K] (vLLM v1's newer layout: the
window is `cat(conv_state[slots], q|k|v)` on dim 1, the conv runs over its transpose) instead of
[S, 3·H·K, taps-1]; the same values (the CUDA kernel reads it through the transposed view).

`state_v_major`: the recurrent state buffer is V-major [S, H, V, K] (the layout fla's
`transpose_state_layout` and several ports keep: a head's state as the matrix that maps k to v)
instead of K-major [S, H, K, V]; the step reads and writes it through its transpose, the same
values (K = V).

`o_fp32` (with `norm_fp32` only): the recurrent output o goes into the fp32 output norm as the
fp32 recurrence leaves it, not rounded to the activations' dtype first (code that keeps o in fp32
through its gated norm and casts once after it: the red-team spelling, spell8); the same in fp32.

`norm_weight_fp32`: the output norm multiplies its weight in fp32 before its one rounding, then
gates in the activations' dtype (`rms_norm_fp32_weight(o) * sigmoid(g)`: a JAX/Flax-style RMSNorm,
spell9's), where the default rounds the normalised row first and multiplies the weight in that
dtype; with `o_fp32`, o goes in unrounded. Not with `norm_fp32` (which gates in fp32 as well).

`conv_rounded`: the short conv is rounded to the activations' dtype before its SiLU (a conv run in
bf16, then `F.silu` on its bf16 output: the red-team spelling, spell9's per-token einsum), where
the default applies the SiLU to the fp32 conv and rounds once. The same in fp32.

`conv_products_rounded`: the short conv as a window sum multiplied in the activations' dtype,
`(window.unfold(-1, taps, 1) * taps).sum(-1)` on bf16 (spell10's per-token `causal_conv1d_update`
loop, spell12's `vecdot` of stacked windows): each tap product rounded to that dtype, the products
summed in fp32 in tap order, the sum rounded once, then the SiLU, as `conv_rounded`'s. torch's CPU
sum of a bf16 / fp16 row of <= 4 elements is that sequential fp32 sum (measured, torch 2.11 and
2.13; longer rows are summed in another order, a few ulps of fp32 apart). Not with `conv_rounded`
(which rounds the exact sum once). In fp32 the same products, summed in tap order.

`k_conv_state`, `v_conv_state`: three conv state buffers, one per q / k / v (fla's three
`ShortConvolution`s, each with its own cache; tests/models/spell8_k3.py): `conv_state` then holds
q's channels only, [S, H·K, taps-1] (the layout `conv_time_major` says), and the window is the
three gathered rows concatenated along the channels: the same values as one buffer. Both are
required arguments, None with one buffer, placed after the scalars and before the defaulted
flags: torch 2.11 (the GPU machine's) drops trailing arguments left at their defaults before the
custom op's ADInplaceOrView kernel, which then indexes the mutated ones (an IndexError on every
call with them defaulted to None: session 25); an argument without a default is never dropped,
so the one schema works on torch 2.11 and 2.13 (docs/decisions.md, session 30).

T >= 1 tokens per request (T > 1: speculative verify rows, the recurrence sequential over them).
`slots` picks each request's rows of the state buffers, which are updated in place.
`k3.fb_kda_decode` is this step with the decay's low-rank up-projection in its prologue.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.math import (
    delta_rule_step,
    l2norm,
    rms_norm,
    rms_norm_fp32_weight,
    rms_norm_gated_fp32,
)

# the parameters the KDA ops upcast themselves (the reference reads them as `.float()` or adds
# them to fp32, both exact for a narrower float): an upcast in the graph before the op is dropped
# (stage `writeback`), and the kernel takes them in bf16 as well as fp32
SELF_UPCAST = ("A_log", "dt_bias")


def kda_decode_ref(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                   k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                   l2_eps, q_scale, norm_eps, k_conv_state=None, v_conv_state=None,
                   norm_fp32=False, conv_time_major=False, state_v_major=False, o_fp32=False,
                   norm_weight_fp32=False, conv_rounded=False, conv_products_rounded=False):
    """The model's KDA step (`KimiDeltaAttention.forward` between the projections and o_proj),
    op for op, so that it rounds like eager. Mutates conv_state (and k_conv_state, v_conv_state)
    and recurrent_state. The op's arguments in its order."""
    B, T, W = q.shape
    H, K = recurrent_state.shape[1], recurrent_state.shape[2]
    dtype = q.dtype
    if o_fp32 and not (norm_fp32 or norm_weight_fp32):
        raise ValueError("kda_decode: o_fp32 (o unrounded into the output norm) needs norm_fp32 "
                         "or norm_weight_fp32")
    if norm_fp32 and norm_weight_fp32:
        raise ValueError("kda_decode: norm_fp32 and norm_weight_fp32 are two output norms")
    if conv_rounded and conv_products_rounded:
        raise ValueError("kda_decode: conv_rounded and conv_products_rounded are two conv "
                         "roundings")
    beta = torch.sigmoid(b.float())  # [B, T, H]

    taps = torch.cat([q_conv_weight, k_conv_weight, v_conv_weight])
    states = (conv_state,) if k_conv_state is None else (conv_state, k_conv_state, v_conv_state)
    channels = 2 if conv_time_major else 1
    past = torch.cat([s[slots] for s in states], dim=channels) if len(states) > 1 else \
        conv_state[slots]
    if conv_time_major:
        window = torch.cat([past, torch.cat([q, k, v], dim=-1)], dim=1)
        tail = window[:, T:]  # [B, K-1 + T, 3W] -> its last K-1 rows
        window = window.transpose(1, 2)
    else:
        new = torch.cat([q, k, v], dim=-1).transpose(1, 2)  # [B, 3W, T]
        window = torch.cat([past, new], dim=-1)  # [B, 3W, K-1 + T]
        tail = window[..., T:]
    if len(states) == 1:
        conv_state[slots] = tail
    else:
        for s, piece in zip(states, tail.split(W, dim=channels)):
            s[slots] = piece
    if conv_products_rounded:
        conv = window_sum_rounded(window, taps).to(dtype)
    else:
        conv = F.conv1d(window.float(), taps.float(), groups=taps.shape[0])
    if conv_rounded:  # the conv's output in the activations' dtype, its SiLU on that
        conv = conv.to(dtype)
    conv = F.silu(conv).to(dtype).transpose(1, 2)  # [B, T, 3W]
    q, k, v = conv.split(W, dim=-1)

    q = l2norm(q.float().view(B, T, H, K), l2_eps) * q_scale
    k = l2norm(k.float().view(B, T, H, K), l2_eps)
    v = v.float().view(B, T, H, K)
    gate = torch.exp(A_log.float()).view(H, 1) * (graw.float().view(B, T, H, K)
                                                   + dt_bias.view(H, K))
    decay = torch.exp(lower_bound * torch.sigmoid(gate))

    state = recurrent_state[slots]  # [B, H, K, V] fp32
    if state_v_major:
        state = state.transpose(-1, -2)  # [B, H, V, K] -> [B, H, K, V]
    outs = []
    for t in range(T):
        state, o_t = delta_rule_step(state, q, k, v, beta, decay, t)
        outs.append(o_t)
    recurrent_state[slots] = state.transpose(-1, -2) if state_v_major else state
    o = torch.stack(outs, dim=1)  # [B, T, H, V] fp32
    if norm_fp32:
        o = o if o_fp32 else o.to(dtype)
        return rms_norm_gated_fp32(o, o_norm_weight, g.view(B, T, H, K), norm_eps).to(dtype)
    if norm_weight_fp32:
        o = o if o_fp32 else o.to(dtype)
        return rms_norm_fp32_weight(o, o_norm_weight, norm_eps, dtype) * torch.sigmoid(
            g.view(B, T, H, K))
    o = o.to(dtype)
    return rms_norm(o, o_norm_weight, norm_eps) * torch.sigmoid(g.view(B, T, H, K))


def window_sum_rounded(window: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The depthwise conv of window [B, C, L] with taps [C, 1, n] as a window sum multiplied in
    their dtype: each product rounded to it, the products summed in fp32 in tap order. Returns
    the fp32 sums [B, C, L - n + 1] (unrounded: the caller rounds once)."""
    products = window.unfold(-1, taps.shape[-1], 1) * taps  # [B, C, T, n], each rounded
    total = products[..., 0].float()
    for j in range(1, taps.shape[-1]):
        total = total + products[..., j].float()
    return total


def kda_decode_fake(q, recurrent_state, g, o_norm_weight, norm_fp32=False,
                    norm_weight_fp32=False) -> torch.Tensor:
    """The output both KDA decode ops return: [B, T, H, K] in the activations' dtype."""
    B, T, _ = q.shape
    H, K = recurrent_state.shape[1], recurrent_state.shape[2]
    dtype = q.dtype if norm_fp32 else torch.promote_types(q.dtype, g.dtype) if \
        norm_weight_fp32 else torch.promote_types(
            torch.promote_types(o_norm_weight.dtype, q.dtype), g.dtype)
    return q.new_empty((B, T, H, K), dtype=dtype)


# the ops write these in place (k_conv_state, v_conv_state where given)
MUTATED = ("conv_state", "recurrent_state", "k_conv_state", "v_conv_state")


def kda_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, graw: torch.Tensor,
    b: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor,
    q_conv_weight: torch.Tensor, k_conv_weight: torch.Tensor, v_conv_weight: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_weight: torch.Tensor,
    lower_bound: float, l2_eps: float, q_scale: float, norm_eps: float,
    k_conv_state: torch.Tensor | None, v_conv_state: torch.Tensor | None,
    norm_fp32: bool = False, conv_time_major: bool = False, state_v_major: bool = False,
    o_fp32: bool = False, norm_weight_fp32: bool = False, conv_rounded: bool = False,
    conv_products_rounded: bool = False,
) -> torch.Tensor:
    """q, k, v, g, graw [B, T, H·K] (pre-conv projections, output gate, low-rank decay input),
    b [B, T, H] (β logits); conv_state [S, 3·H·K, taps-1] ([S, taps-1, 3·H·K] with
    `conv_time_major`; with `k_conv_state` and `v_conv_state`, each of the three [S, H·K,
    taps-1] or [S, taps-1, H·K]); recurrent_state fp32 [S, H, K, V], K = V ([S, H, V, K] with
    `state_v_major`);
    `o_fp32`: with `norm_fp32` or `norm_weight_fp32`, o unrounded into the output norm;
    `norm_weight_fp32`: the norm's weight multiplied in fp32 before one rounding, the gate after;
    `conv_rounded`: the conv rounded to the activations' dtype before its SiLU;
    `conv_products_rounded`: the conv a window sum multiplied in the activations' dtype (each
    product rounded, fp32 sum in tap order, rounded before its SiLU);
    slots int64 [B]; conv weights [H·K, 1, taps]; A_log [H], dt_bias [H·K] (fp32, or bf16 where
    a model is cast whole: promoted to fp32); o_norm_weight [K]; `k_conv_state`, `v_conv_state`:
    None with one conv state buffer (required: see the module docstring). Returns o [B, T, H, K]
    in the activations' dtype."""
    return kda_decode_ref(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                          k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                          l2_eps, q_scale, norm_eps, k_conv_state, v_conv_state, norm_fp32,
                          conv_time_major, state_v_major, o_fp32, norm_weight_fp32, conv_rounded,
                          conv_products_rounded)


kda_decode = torch.library.custom_op("k3::kda_decode", kda_decode, mutates_args=MUTATED)


@kda_decode.register_fake
def _(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight, k_conv_weight,
      v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps, q_scale, norm_eps,
      k_conv_state, v_conv_state, norm_fp32=False, conv_time_major=False, state_v_major=False,
      o_fp32=False, norm_weight_fp32=False, conv_rounded=False, conv_products_rounded=False):
    return kda_decode_fake(q, recurrent_state, g, o_norm_weight, norm_fp32, norm_weight_fp32)
