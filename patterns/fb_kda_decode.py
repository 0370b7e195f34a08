"""KDA's f_b GEMM (the decay's low-rank up-projection) folded into the recurrent step ->
`k3.fb_kda_decode` (spec §5.2 rows 3-4: the kernel does the 128-wide GEMM in its prologue).

Runs after `kda_decode` and `linear_concat` and matches the op fed by `F.linear(fa, W_fb)` as its
`graw`, where `fa` is the f_a slice of the fused in-projection and nothing else reads graw. W_fb
must be a weight (a graph input the graph does not write, as `linear` wants): the one-launch
kernel copies it before its PDL wait, while the previous kernel may still run.

Before: graw = view(mm(view(fa), permute(W_fb))); o = k3.kda_decode(q, k, v, g, graw, b, ...)
After:  o = k3.fb_kda_decode(q, k, v, g, fa, W_fb, b, ...)   (the same states updated in place)
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from k3compile.patterns import kda_decode

from k3compile.graph import written_in_place
from k3compile.ops.kda_decode import ConvRounding, KDAVariant
from k3compile.rewrite import Pattern, tensor_meta, with_signature

NAMES = (*kda_decode.NAMES[:4], "fa", "fb_weight", *kda_decode.NAMES[5:])
R = 8  # f_a's width (head_dim in K3) for tracing; matching ignores sizes


def search(q, k, v, g, fa, fb_weight, b, conv_state, recurrent_state, slots, q_conv_weight,
           k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps,
           q_scale, norm_eps, k_conv_state=None, v_conv_state=None, *spec):
    """`spec`: the op's `variant` argument (none for the default)."""
    return torch.ops.k3.kda_decode(q, k, v, g, F.linear(fa, fb_weight), b, conv_state,
                                   recurrent_state, slots, q_conv_weight, k_conv_weight,
                                   v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                                   l2_eps, q_scale, norm_eps, k_conv_state, v_conv_state, *spec)


def replace(q, k, v, g, fa, fb_weight, b, conv_state, recurrent_state, slots, q_conv_weight,
            k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound, l2_eps,
            q_scale, norm_eps, k_conv_state=None, v_conv_state=None, *spec):
    return torch.ops.k3.fb_kda_decode(q, k, v, g, fa, fb_weight, b, conv_state, recurrent_state,
                                      slots, q_conv_weight, k_conv_weight, v_conv_weight, A_log,
                                      dt_bias, o_norm_weight, lower_bound, l2_eps, q_scale,
                                      norm_eps, k_conv_state, v_conv_state, *spec)


def search_rows(q, k, v, g, fa, fb_weight, b, *rest):
    """`search` on flat [B*T, R] f_a rows (vLLM's tokens: the f_b GEMM a plain mm, its output
    viewed to [B, T, W] for the step; rule `token_view` leaves it so)."""
    graw = F.linear(fa, fb_weight).view(q.shape[0], q.shape[1], -1)
    return torch.ops.k3.kda_decode(q, k, v, g, graw, b, *rest)


def replace_rows(q, k, v, g, fa, fb_weight, b, *rest):
    return torch.ops.k3.fb_kda_decode(q, k, v, g, fa.view(q.shape[0], q.shape[1], -1),
                                      fb_weight, b, *rest)


def check(match) -> str | None:
    fa, w = tensor_meta(match.kwargs["fa"]), tensor_meta(match.kwargs["fb_weight"])
    if fa is None or w is None:
        return "fa or W_fb has no tensor metadata"
    node = match.kwargs["fb_weight"]
    if node.op != "placeholder":
        return f"W_fb is computed in the graph ({node.name}), not a weight input"
    if written_in_place(node):
        return f"W_fb ({node.name}) is state the graph writes in place, not a weight"
    if w.dim() != 2 or w.shape[1] != fa.shape[-1]:
        return f"W_fb {list(w.shape)} does not take fa's width {fa.shape[-1]}"
    if w.dtype != fa.dtype:
        return f"W_fb {w.dtype} != fa {fa.dtype}"
    if fa.shape[-1] % 8:
        return f"fa width {fa.shape[-1]} is not a multiple of 8 (16-byte rows)"
    # the step's own conditions, on the GEMM's output as its graw
    op = next(n for n in match.nodes if n.target is torch.ops.k3.kda_decode.default)
    args = {**dict(zip((a.name for a in op.target._schema.arguments), op.args)), **op.kwargs}
    variant = KDAVariant.parse(args.get("variant", ""), args["k_conv_state"] is not None)
    return kda_decode.check(types.SimpleNamespace(kwargs={**match.kwargs, "graw": op.args[4]}),
                            variant)


def example_inputs(dtype: torch.dtype = torch.bfloat16, conv_time_major: bool = False,
                   three_states: bool = False, rows: bool = False) -> list:
    """(the recurrent state is square: its example values serve either layout; three conv
    states: the k and v buffers after the tensors, as `kda_decode.variant_names` orders them)"""
    W = kda_decode.H * kda_decode.K
    act = [torch.randn(2, 1, W, dtype=dtype) for _ in range(4)]
    fa = [torch.randn(*((2,) if rows else (2, 1)), R, dtype=dtype),
          torch.randn(W, R, dtype=dtype)]
    b = torch.randn(2, 1, kda_decode.H, dtype=dtype)
    conv = (3, kda_decode.TAPS - 1, 3 * W) if conv_time_major else (3, 3 * W, kda_decode.TAPS - 1)
    if three_states:
        conv = (3, W, kda_decode.TAPS - 1)
    state = [torch.randn(conv, dtype=dtype),
             torch.randn(3, kda_decode.H, kda_decode.K, kda_decode.K), torch.tensor([0, 2])]
    weights = [torch.randn(W, 1, kda_decode.TAPS, dtype=dtype) for _ in range(3)]
    weights += [torch.randn(kda_decode.H), torch.randn(W), torch.randn(kda_decode.K, dtype=dtype)]
    more = [torch.randn(conv, dtype=dtype) for _ in kda_decode.THREE_STATES] if three_states \
        else []
    return [*act, *fa, b, *state, *weights, *more, *kda_decode.SCALARS.values()]


def _variant(variant: KDAVariant, rows: bool = False) -> Pattern:
    """The step as kda_decode fused it, in any of its variants (the op's `variant` argument,
    passed through; with one conv state buffer or three, `k_conv_state`, `v_conv_state`);
    `rows`: f_a as flat [B*T, R] token rows (`search_rows`)."""
    names = [*variant.names, *(("rows",) if rows else ())]
    three_states = variant.three_conv_states
    args = (*NAMES[:-len(kda_decode.SCALARS)], *kda_decode.THREE_STATES,
            *kda_decode.SCALARS) if three_states else NAMES
    tensors, n_scalars = len(NAMES) - len(kda_decode.SCALARS), len(kda_decode.SCALARS)
    spec = (variant.spec,) if variant.spec else ()

    def call(fn):  # the op's arguments in its order: the two extra buffers (or None), the spec
        return lambda *a: fn(*a[:tensors], *a[-n_scalars:], *(a[tensors:-n_scalars] or
                                                              (None, None)), *spec)

    return Pattern(
        name=f"fb_kda_decode[{','.join(names)}]" if names else "fb_kda_decode",
        search=with_signature(call(search_rows if rows else search), args),
        replace=with_signature(call(replace_rows if rows else replace), args),
        example_inputs=lambda dtype=torch.bfloat16: example_inputs(
            dtype, variant.conv_time_major, three_states, rows),
        op="k3.fb_kda_decode", check=check, kernel_refusal=kda_decode.kernel_refusal(variant),
        scalars=dict(kda_decode.SCALARS), fake_trace=True, distinctive=("mm", "kda_decode"),
    )


def patterns() -> list[Pattern]:
    # one variant for every T, batch and dtype: the op hides the step, the GEMM has no casts
    # (o_fp32: with the fp32 norm, or the Flax norm; those two and the rounded conv as
    # kda_decode's; rows: f_a as flat token rows, vLLM's, on one conv state, without the Flax
    # norm; the products-rounded conv as kda_decode's: channel-major, K-major, no Flax norm;
    # listed after the others, as they were added)
    late = (ConvRounding.PRODUCTS_ROUNDED,)
    return [_variant(KDAVariant((n or o) and not f, m, s, c, o, f, conv=r), rw)
            for convs in (tuple(c for c in ConvRounding if c not in late), late)
            for rw in (False, True) for r in convs for f in (False, True)
            for o in (False, True) for c in (False, True) for s in (False, True)
            for m in (False, True) for n in (False, True)
            if not (c and m) and not (o and n)
            and not ((f or r is not ConvRounding.FP32) and c) and not (f and (s or n or not o))
            and not (rw and (c or f))
            and not (r is ConvRounding.PRODUCTS_ROUNDED and (f or m or s))] + [
        _variant(KDAVariant(gate_fp32=True), rw) for rw in (False, True)]
