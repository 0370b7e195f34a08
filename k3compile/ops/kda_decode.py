"""`o = k3.kda_decode(q, k, v, g, graw, b, conv_state!, recurrent_state!, slots, ...)`: the KDA
recurrent step of one layer, whole (spec §3.1 steps 3-7; vLLM's fused_kda_decode):

    window = [conv_state, q|k|v]  ->  conv_state <- last K-1 inputs
    q, k, v = SiLU(depthwise conv(window))                      (fp32 math, cast back)
    q̂ = l2norm(q)·q_scale, k̂ = l2norm(k)                        (eps inside the sqrt)
    α = exp(lower_bound·sigmoid(exp(A_log)·(graw + dt_bias))),  β = sigmoid(b)
    per token t: S <- Diag(α_t)·S;  S <- S + k̂_t·(β_t(v_t − Sᵀk̂_t))ᵀ;  o_t = Sᵀq̂_t   (fp32 S)
    o = RMSNorm_head(o; o_norm_weight) ⊙ sigmoid(g)

The step's variants are one value, `KDAVariant` (layouts, output norm, the conv's rounding, each
below); the ops take it as one string argument, `variant` (`KDAVariant.spec`: the names of its
flags, comma-separated, in field order; "" for the default), parsed in one place
(`KDAVariant.parse`).

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

`o_fp32` (with `norm_fp32` or `norm_weight_fp32`): the recurrent output o goes into the output
norm as the fp32 recurrence leaves it, not rounded to the activations' dtype first (code that
keeps o in fp32 through its gated norm and casts once after it: the red-team spelling, spell8);
the same in fp32.

`norm_weight_fp32`: the output norm multiplies its weight in fp32 before its one rounding, then
gates in the activations' dtype (`rms_norm_fp32_weight(o) * sigmoid(g)`: a JAX/Flax-style RMSNorm,
spell9's), where the default rounds the normalised row first and multiplies the weight in that
dtype; with `o_fp32`, o goes in unrounded. Not with `norm_fp32` (which gates in fp32 as well).

`gate_fp32` (with the built-in norm only): the output norm as the built-in model's (rounded to the
activations' dtype after the norm and after the weight), then the gate product in fp32 with one
rounding, `bf16(float(rms_norm(o)) · sigmoid(float(g)))`, where the built-in rounds sigmoid(g)
and the product each (a mixed-precision codebase's fp32 island around the gate: spell11's); the
same in fp32.

`conv` (`ConvRounding`, one of three): `FP32` (the default) applies the SiLU to the fp32 conv and
rounds once. `ROUNDED` (spec name `conv_rounded`): the short conv is rounded to the activations'
dtype before its SiLU (a conv run in bf16, then `F.silu` on its bf16 output: the red-team
spelling, spell9's per-token einsum); the same in fp32. `PRODUCTS_ROUNDED`
(`conv_products_rounded`): the short conv as a window sum multiplied in the activations' dtype,
`(window.unfold(-1, taps, 1) * taps).sum(-1)` on bf16 (spell10's per-token `causal_conv1d_update`
loop, spell12's `vecdot` of stacked windows): each tap product rounded to that dtype, the products
summed in fp32 in tap order, the sum rounded once, then the SiLU, as `ROUNDED`'s. torch's CPU
sum of a bf16 / fp16 row of <= 4 elements is that sequential fp32 sum (measured, torch 2.11 and
2.13; longer rows are summed in another order, a few ulps of fp32 apart). In fp32 the same
products, summed in tap order.

`three_conv_states` is no part of the spec: the op reads it off its arguments (`k_conv_state`
given); the patterns and the kernel builds carry it in the value.

`k_conv_state`, `v_conv_state`: three conv state buffers, one per q / k / v (fla's three
`ShortConvolution`s, each with its own cache; tests/models/spell8_k3.py): `conv_state` then holds
q's channels only, [S, H·K, taps-1] (the layout `conv_time_major` says), and the window is the
three gathered rows concatenated along the channels: the same values as one buffer. Both are
required arguments, None with one buffer, placed after the scalars and before the defaulted
`variant`: torch 2.11 (the GPU machine's) drops trailing arguments left at their defaults before the
custom op's ADInplaceOrView kernel, which then indexes the mutated ones (an IndexError on every
call with them defaulted to None: session 25); an argument without a default is never dropped,
so the one schema works on torch 2.11 and 2.13 (docs/decisions.md, session 30).

T >= 1 tokens per request (T > 1: speculative verify rows, the recurrence sequential over them).
`slots` picks each request's rows of the state buffers, which are updated in place.
`k3.fb_kda_decode` is this step with the decay's low-rank up-projection in its prologue.
"""

from __future__ import annotations

import dataclasses
import enum

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


class ConvRounding(enum.Enum):
    """How the short conv rounds before its SiLU (the value: its name in a variant's spec)."""

    FP32 = ""  # the fp32 conv, its SiLU, one rounding
    ROUNDED = "conv_rounded"  # the conv rounded to the activations' dtype, then its SiLU
    PRODUCTS_ROUNDED = "conv_products_rounded"  # each tap product rounded, the sum rounded


@dataclasses.dataclass(frozen=True)
class KDAVariant:
    """One variant of the KDA step (the module docstring says what each field computes). The
    default is the built-in model's step. `names` lists its flags in field order (the pattern
    variants' names, `GPU_TESTED_FLAGS`); `spec` is the ops' `variant` argument."""

    norm_fp32: bool = False
    conv_time_major: bool = False
    state_v_major: bool = False
    three_conv_states: bool = False
    o_fp32: bool = False
    norm_weight_fp32: bool = False
    gate_fp32: bool = False
    conv: ConvRounding = ConvRounding.FP32

    def __post_init__(self):
        if not isinstance(self.conv, ConvRounding):
            raise TypeError(f"kda_decode: conv {self.conv!r} is not a ConvRounding")
        if self.o_fp32 and not (self.norm_fp32 or self.norm_weight_fp32):
            raise ValueError("kda_decode: o_fp32 (o unrounded into the output norm) needs "
                             "norm_fp32 or norm_weight_fp32")
        if self.norm_fp32 and self.norm_weight_fp32:
            raise ValueError("kda_decode: norm_fp32 and norm_weight_fp32 are two output norms")
        if self.gate_fp32 and (self.norm_fp32 or self.norm_weight_fp32):
            raise ValueError("kda_decode: gate_fp32 is the built-in norm's gate in fp32 (norm_fp32 "
                             "gates in fp32 already; not with norm_weight_fp32)")

    @property
    def names(self) -> tuple[str, ...]:
        """The flags set, in field order, the conv's rounding last (none for FP32)."""
        flags = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is True]
        return (*flags, *((self.conv.value,) if self.conv.value else ()))

    @property
    def spec(self) -> str:
        """The ops' `variant` argument: `names` less `three_conv_states` (the op reads that off
        its arguments), comma-separated; "" for the default."""
        return ",".join(n for n in self.names if n != "three_conv_states")

    @classmethod
    def parse(cls, spec: str, three_conv_states: bool = False) -> KDAVariant:
        """The variant an op's `variant` argument names (with three conv states or not): its
        names as `spec` writes them, each once, in field order, at most one conv rounding;
        anything else is a ValueError naming what is wrong."""
        names = spec.split(",") if spec else []
        flags = {f.name for f in dataclasses.fields(cls)} - {"three_conv_states", "conv"}
        convs = {c.value: c for c in ConvRounding if c.value}
        if unknown := [n for n in names if n not in flags and n not in convs]:
            raise ValueError(f"kda_decode: variant {spec!r}: unknown {', '.join(unknown)} (the "
                             f"flags: {', '.join([*flags, *convs])})")
        if len(rounding := [n for n in names if n in convs]) > 1:
            raise ValueError(f"kda_decode: variant {spec!r}: {' and '.join(rounding)}: two conv "
                             "roundings (one at most)")
        variant = cls(**{n: True for n in names if n in flags}, three_conv_states=three_conv_states,
                      conv=convs[rounding[0]] if rounding else ConvRounding.FP32)
        if variant.spec != spec:
            raise ValueError(f"kda_decode: variant {spec!r} is written {variant.spec!r}")
        return variant


BUILTIN = KDAVariant()  # the built-in model's step: every flag off, the fp32 conv


def kda_decode_ref(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                   k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                   l2_eps, q_scale, norm_eps, k_conv_state=None, v_conv_state=None,
                   variant: KDAVariant = BUILTIN):
    """The model's KDA step (`KimiDeltaAttention.forward` between the projections and o_proj),
    op for op, so that it rounds like eager. Mutates conv_state (and k_conv_state, v_conv_state)
    and recurrent_state. The op's arguments in its order, the variant parsed (its
    `three_conv_states` is read off `k_conv_state`)."""
    B, T, W = q.shape
    H, K = recurrent_state.shape[1], recurrent_state.shape[2]
    dtype = q.dtype
    beta = torch.sigmoid(b.float())  # [B, T, H]

    taps = torch.cat([q_conv_weight, k_conv_weight, v_conv_weight])
    states = (conv_state,) if k_conv_state is None else (conv_state, k_conv_state, v_conv_state)
    channels = 2 if variant.conv_time_major else 1
    past = torch.cat([s[slots] for s in states], dim=channels) if len(states) > 1 else \
        conv_state[slots]
    if variant.conv_time_major:
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
    if variant.conv is ConvRounding.PRODUCTS_ROUNDED:
        conv = window_sum_rounded(window, taps).to(dtype)
    else:
        conv = F.conv1d(window.float(), taps.float(), groups=taps.shape[0])
    if variant.conv is ConvRounding.ROUNDED:  # the conv's output in the activations' dtype
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
    if variant.state_v_major:
        state = state.transpose(-1, -2)  # [B, H, V, K] -> [B, H, K, V]
    outs = []
    for t in range(T):
        state, o_t = delta_rule_step(state, q, k, v, beta, decay, t)
        outs.append(o_t)
    recurrent_state[slots] = state.transpose(-1, -2) if variant.state_v_major else state
    o = torch.stack(outs, dim=1)  # [B, T, H, V] fp32
    if variant.norm_fp32:
        o = o if variant.o_fp32 else o.to(dtype)
        return rms_norm_gated_fp32(o, o_norm_weight, g.view(B, T, H, K), norm_eps).to(dtype)
    if variant.norm_weight_fp32:
        o = o if variant.o_fp32 else o.to(dtype)
        return rms_norm_fp32_weight(o, o_norm_weight, norm_eps, dtype) * torch.sigmoid(
            g.view(B, T, H, K))
    o = o.to(dtype)
    if variant.gate_fp32:
        return (rms_norm(o, o_norm_weight, norm_eps).float() * torch.sigmoid(
            g.float().view(B, T, H, K))).to(dtype)
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


def kda_decode_fake(q, recurrent_state, g, o_norm_weight, variant: KDAVariant) -> torch.Tensor:
    """The output both KDA decode ops return: [B, T, H, K] in the activations' dtype."""
    B, T, _ = q.shape
    H, K = recurrent_state.shape[1], recurrent_state.shape[2]
    dtype = q.dtype if variant.norm_fp32 or variant.gate_fp32 else torch.promote_types(
        q.dtype, g.dtype) if variant.norm_weight_fp32 else torch.promote_types(
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
    k_conv_state: torch.Tensor | None, v_conv_state: torch.Tensor | None, variant: str = "",
) -> torch.Tensor:
    """q, k, v, g, graw [B, T, H·K] (pre-conv projections, output gate, low-rank decay input),
    b [B, T, H] (β logits); conv_state [S, 3·H·K, taps-1] ([S, taps-1, 3·H·K] with
    `conv_time_major`; with `k_conv_state` and `v_conv_state`, each of the three [S, H·K,
    taps-1] or [S, taps-1, H·K]); recurrent_state fp32 [S, H, K, V], K = V ([S, H, V, K] with
    `state_v_major`); slots int64 [B]; conv weights [H·K, 1, taps] (the activations' dtype, or
    fp32: read as they are, the conv being fp32); A_log [H], dt_bias [H·K]
    (fp32, or bf16 where a model is cast whole: promoted to fp32); o_norm_weight [K];
    `k_conv_state`, `v_conv_state`: None with one conv state buffer (required: see the module
    docstring); `variant`: `KDAVariant.spec` ("" for the built-in step). Returns o [B, T, H, K]
    in the activations' dtype."""
    return kda_decode_ref(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                          k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                          l2_eps, q_scale, norm_eps, k_conv_state, v_conv_state,
                          KDAVariant.parse(variant, k_conv_state is not None))


kda_decode = torch.library.custom_op("k3::kda_decode", kda_decode, mutates_args=MUTATED)


@kda_decode.register_fake
def _(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight, k_conv_weight,
      v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps, q_scale, norm_eps,
      k_conv_state, v_conv_state, variant=""):
    return kda_decode_fake(q, recurrent_state, g, o_norm_weight,
                           KDAVariant.parse(variant, k_conv_state is not None))
