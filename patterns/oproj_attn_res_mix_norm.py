"""The attention's o_proj GEMM fused into the post-attention depth mix + RMSNorm ->
`k3.oproj_attn_res_mix_norm` (world size 1).

Runs after `attn_res_mix_norm` and matches its op fed by `F.linear(o, W_o)` (the prefix add
`prefix + a`, or `a` itself where a block starts: then `a` is also the next prefix, an output).
One kernel then does the GEMM in its prologue, the prefix update, the mix and the norm. The GEMM
is the attention's by structure, whatever its module is called: o reads a state buffer (the KDA
state, the MLA cache) since the norm before it; the dense MLP's down GEMM, which also feeds a mix
(the next layer's, as its delta), reads none and is refused. At world
size > 1 an all-reduce sits between o_proj and the mix: `allreduce_attn_res_mix_norm` takes it.

Before: a = view(mm(view(o), permute(W_o))); p, x = k3.attn_res_mix_norm(prefix, a, ..)
After:  p, x = k3.oproj_attn_res_mix_norm(o, W_o, prefix, [blocks], ...)

Activations [N, D] (one row per token, vLLM's layout) make o_proj one `mm` without the views
F.linear of [B, T, X] traces to: the `flat` variants.

A model that writes the prefix add as `a + prefix` gets an attn_res_mix_norm with the two in
swapped roles (the `swapped` variants; the sum is the same in IEEE arithmetic). The mix's
`scores_fp32` variants (bf16) carry that argument over, and its `norm_weight_fp32` ones that flag
too (on CUDA the two launches run it; the opt-in one launch refuses it).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from k3compile.patterns.attn_res_mix_norm import (
    KINDS,
    MAX_BLOCKS,
    NORM_FP32_WEIGHT_KINDS,
    SHAPE,
    flags,
)

from k3compile.graph import reads_state
from k3compile.rewrite import Pattern, tensor_meta, with_signature

# where a layer's attention or MLP input comes from: the depth mix + norm (fused alone, with the
# o_proj before it, or with the all-reduce), or a plain norm
BOUNDARIES = frozenset({"k3.attn_res_mix_norm.default", "k3.oproj_attn_res_mix_norm.default",
                        "k3.allreduce_attn_res_mix_norm.default", "k3.rms_norm.default"})


def check(match) -> str | None:
    # the dense MLP's down-projection also feeds a mix (the next layer's, as its delta): it is
    # the MLP's GEMM, not this fusion's. The attention's o is computed from a state (the KDA
    # state, the MLA cache); the MLP's activation from the norm before it and no state.
    o_node = match.kwargs["o"]
    if isinstance(o_node, torch.fx.Node) and reads_state(o_node, BOUNDARIES) is False:
        return (f"o ({o_node.name}) reads no state buffer since the norm before it: an MLP's "
                "GEMM, not the attention's o_proj")
    o, w = tensor_meta(match.kwargs["o"]), tensor_meta(match.kwargs["o_proj_weight"])
    if o is None or w is None:
        return "o or W_o has no tensor metadata"
    if w.dim() != 2 or w.shape[1] != o.shape[-1]:
        return f"W_o {list(w.shape)} does not take o's width {o.shape[-1]}"
    if w.dtype != o.dtype:
        return f"W_o {w.dtype} != o {o.dtype}"
    if o.shape[-1] % 8 or w.shape[0] % 8:
        return f"widths {o.shape[-1]} -> {w.shape[0]} are not multiples of 8 (16-byte rows)"
    return None


def _variant(n_blocks: int, with_prefix: bool, dtype: torch.dtype = torch.bfloat16,
             swapped: bool = False, scores_fp32: bool = False, flat: bool = False,
             norm_weight_fp32: bool = False) -> Pattern:
    """`flat`: activations [N, D] (one row per token, vLLM's), o_proj one mm without the views
    F.linear of [B, T, X] traces to."""
    blocks = [f"block{i}" for i in range(n_blocks)]
    names = ["o", "o_proj_weight", *(["prefix"] if with_prefix else []), *blocks,
             "w_mix_norm", "w_mix_proj", "w_norm", "mix_eps", "norm_eps"]
    np_ = 1 if with_prefix else 0

    def split(args):
        prefix = args[2] if with_prefix else None
        return (args[0], args[1], prefix, list(args[2 + np_:2 + np_ + n_blocks]),
                *args[2 + np_ + n_blocks:])

    extra = flags(scores_fp32, norm_weight_fp32)  # the mix's flags

    def search(*args):
        o, w_o, prefix, blks, wmn, wmp, wn, me, ne = split(args)
        a = F.linear(o, w_o)
        if with_prefix:
            first, second = (a, prefix) if swapped else (prefix, a)
            prefix_out, x = torch.ops.k3.attn_res_mix_norm(first, second, blks, wmn, wmp, wn, me,
                                                           ne, *extra)
            return x, prefix_out
        return torch.ops.k3.attn_res_mix_norm(a, None, blks, wmn, wmp, wn, me, ne, *extra)[1], a

    def replace(*args):
        prefix_out, x = torch.ops.k3.oproj_attn_res_mix_norm(*split(args), *extra)
        return x, prefix_out

    shape = (SHAPE[0] * SHAPE[1], SHAPE[-1]) if flat else SHAPE

    def example_inputs():
        d = SHAPE[-1]
        act = [torch.randn(shape, dtype=dtype), torch.randn(d, d, dtype=dtype)]
        act += [torch.randn(shape, dtype=dtype) for _ in range(np_ + n_blocks)]
        w = [torch.randn(d, dtype=dtype), torch.randn(1, d, dtype=dtype), torch.randn(d, dtype=dtype)]
        return [*act, *w, 1.1e-5, 1.3e-5]

    return Pattern(
        name=f"oproj_attn_res_mix_norm[blocks={n_blocks},{'prefix' if with_prefix else 'new_block'}"
             f"{',swapped' if swapped else ''}"
             f"{'' if dtype == torch.bfloat16 else ',' + str(dtype).split('.')[-1]}"
             f"{',flat' if flat else ''}{',scores_fp32' if scores_fp32 else ''}"
             f"{',norm_weight_fp32' if norm_weight_fp32 else ''}]",
        search=with_signature(search, names), replace=with_signature(replace, names),
        example_inputs=example_inputs, op="k3.oproj_attn_res_mix_norm", check=check,
        scalars={"mix_eps": 1.1e-5, "norm_eps": 1.3e-5}, fake_trace=True,
        distinctive=("mm", "attn_res_mix_norm"),
    )


def patterns() -> list[Pattern]:
    out = []
    kinds = [(t, f, False) for t, f in KINDS] + [(t, f, True) for t, f in NORM_FP32_WEIGHT_KINDS]
    for flat, (t, f, w), n in itertools.product((False, True), kinds, range(MAX_BLOCKS, 0, -1)):
        out += [_variant(n, True, t, False, f, flat, w), _variant(n, False, t, False, f, flat, w),
                _variant(n, True, t, True, f, flat, w)]
    return out
