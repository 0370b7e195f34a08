"""Attention-Residual depth mix + the RMSNorm after it -> `k3.attn_res_mix_norm`.

Matches the model's `prefix + delta` (absent when a block starts), the stack of the completed
blocks and the prefix, the RMS-normalised scores against the pseudo-query, the softmax over
sources, the fp32 weighted sum, and the following RMSNorm (input_layernorm, post_attention_layernorm
or the final norm). One variant per number of blocks (1..8, K3 has at most 9 sources), per
presence of the prefix add, per dtype (fp32 traces no casts) and in bf16 per scores: the built-in
model's (`depth_mix_weights`: normalised sources, their product with the norm weight and the
projection rounded to bf16) or fp32 throughout (`depth_mix_scores_fp32`, Moonshot's
`_apply_attn_res`, rule `depth_mix`), which fuses into the op with `scores_fp32=True` (the
kernel's own score math: both variants run one build). `norm_weight_fp32` (bf16, fp32 scores): the
norm after the mix multiplies its weight in fp32 before the one rounding to bf16 (a JAX/Flax-style
norm, tests/models/spell9_k3.py; `math.rms_norm_fp32_weight`) -> `norm_weight_fp32=True`; another
rounding than K3's, so a variant, not a canonical rule. The kernel's build for it passed its GPU
tests (H100, 2026-12-05, session 26), so GPU graphs fuse it too. `mix_weights_fp32` (bf16 sources,
fp32 scores): the mix's norm and projection weights are fp32 tensors, read as they are (fp32 master
weights under `torch.autocast`, tests/models/spell11_k3.py: the fold `w_mix_norm * w_mix_proj`
of the fp32 values, no bf16 rounding of either); the op's reference computes exactly that. The
kernel reads bf16 mix weights only, so GPU graphs leave such a site to Inductor
(`kernel_refusal`; docs/spell11_spelling.md names the build it would need).

Before (per mix, ~25 ATen ops):  add, cat, convert, pow, mean, add, rsqrt, mul, convert, mul, mm,
    convert, amax, sub, exp, sum, div, mul, sum, convert, ... rsqrt, mul, convert, mul
After:  prefix_out, x = k3.attn_res_mix_norm(prefix, delta, [blocks], w_mix_norm, w_mix_proj,
    w_norm, mix_eps, norm_eps)
"""

from __future__ import annotations

import functools
import itertools

import torch

from k3compile.math import (
    depth_mix_scores_fp32,
    depth_mix_weights,
    rms_norm,
    rms_norm_fp32_weight,
)
from k3compile.ops import registry
from k3compile.rewrite import Pattern, tensor_meta, with_signature

MAX_BLOCKS = 8
SHAPE = (2, 1, 64)  # [B, T, D] for tracing; matching ignores sizes


def mix_norm(prefix, delta, blocks, w_mix_norm, w_mix_proj, w_norm, mix_eps, norm_eps,
             scores_fp32=False, norm_weight_fp32=False):
    prefix_out = prefix if delta is None else prefix + delta
    mix = depth_mix_scores_fp32 if scores_fp32 else depth_mix_weights
    h = mix(prefix_out, blocks, w_mix_norm, w_mix_proj, mix_eps)
    if norm_weight_fp32:
        return prefix_out, rms_norm_fp32_weight(h, w_norm, norm_eps, h.dtype)
    return prefix_out, rms_norm(h, w_norm, norm_eps)


def check(match, mix_weights_fp32: bool = False) -> str | None:
    for eps in ("mix_eps", "norm_eps"):
        if not isinstance(match.kwargs[eps], float):
            return (f"{eps} is not a compile-time float (torch.compile(dynamic=True) makes float "
                    "attributes graph inputs; mark only the batch dynamic)")
    prefix = tensor_meta(match.kwargs["prefix"])
    if prefix is None or prefix.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"prefix dtype {getattr(prefix, 'dtype', None)} is not a float type"
    for name in ("w_mix_norm", "w_norm"):
        w = tensor_meta(match.kwargs[name])
        if w is None or w.dim() != 1 or w.shape[0] != prefix.shape[-1]:
            return f"{name} shape {list(getattr(w, 'shape', []))} is not [hidden={prefix.shape[-1]}]"
    proj = tensor_meta(match.kwargs["w_mix_proj"])
    if proj is None or tuple(proj.shape) != (1, prefix.shape[-1]):
        return f"w_mix_proj shape {getattr(proj, 'shape', None)} is not [1, hidden]"
    blocks = [tensor_meta(match.kwargs[k]) for k in match.kwargs if k.startswith("block")]
    if any(b is None or b.shape != prefix.shape for b in blocks):
        return "a block source's shape differs from the prefix"
    if mix_weights_fp32:
        # fp32 weights are what makes the fold exact: bf16 ones multiplied into the fp32 scores
        # by type promotion would trace alike, their fold rounded in bf16 (not the op's math)
        mix_w = [tensor_meta(match.kwargs[k]).dtype for k in ("w_mix_norm", "w_mix_proj")]
        if mix_w != [torch.float32] * 2 or prefix.dtype == torch.float32:
            return (f"mix weights {mix_w} with {prefix.dtype} sources (the variant takes fp32 "
                    "mix weights beside bf16 / fp16 sources)")
    return None


def kernel_refusal(match) -> str | None:
    """GPU graphs: the kernel's own word on the site's arguments (it reads bf16 mix weights
    only, so a site with fp32 ones stays with Inductor rather than run the reference op by op)."""
    m = match.kwargs
    blocks = [tensor_meta(m[k]) for k in sorted(m) if k.startswith("block")]
    delta = tensor_meta(m["delta"]) if "delta" in m else None
    return registry.kernel_refusal("attn_res_mix_norm", tensor_meta(m["prefix"]), delta, blocks,
                                   *(tensor_meta(m[k]) for k in ("w_mix_norm", "w_mix_proj",
                                                                 "w_norm")))


def _variant(n_blocks: int, with_delta: bool, dtype: torch.dtype = torch.bfloat16,
             scores_fp32: bool = False, norm_weight_fp32: bool = False,
             mix_weights_fp32: bool = False) -> Pattern:
    blocks = [f"block{i}" for i in range(n_blocks)]
    names = ["prefix", *(["delta"] if with_delta else []), *blocks,
             "w_mix_norm", "w_mix_proj", "w_norm", "mix_eps", "norm_eps"]
    nd = 1 if with_delta else 0

    def split(args):
        delta = args[1] if with_delta else None
        return args[0], delta, list(args[1 + nd:1 + nd + n_blocks]), *args[1 + nd + n_blocks:]

    # x first: the matcher anchors on the first output, which must be computed by the pattern
    extra = flags(scores_fp32, norm_weight_fp32)

    def search(*args):
        prefix_out, x = mix_norm(*split(args), *extra)
        return (x, prefix_out) if with_delta else x

    def replace(*args):
        prefix, delta, blks, wmn, wmp, wn, me, ne = split(args)
        prefix_out, x = torch.ops.k3.attn_res_mix_norm(prefix, delta, blks, wmn, wmp, wn, me, ne,
                                                       *extra)
        return (x, prefix_out) if with_delta else x

    def example_inputs():
        act = [torch.randn(SHAPE, dtype=dtype) for _ in range(1 + nd + n_blocks)]
        d, mix_dtype = SHAPE[-1], torch.float32 if mix_weights_fp32 else dtype
        w = [torch.randn(d, dtype=mix_dtype), torch.randn(1, d, dtype=mix_dtype),
             torch.randn(d, dtype=dtype)]
        return [*act, *w, 1.1e-5, 1.3e-5]

    return Pattern(
        name=f"attn_res_mix_norm[blocks={n_blocks},{'delta' if with_delta else 'no_delta'}"
             f"{'' if dtype == torch.bfloat16 else ',' + str(dtype).split('.')[-1]}"
             f"{',scores_fp32' if scores_fp32 else ''}"
             f"{',norm_weight_fp32' if norm_weight_fp32 else ''}"
             f"{',mix_weights_fp32' if mix_weights_fp32 else ''}]",
        search=with_signature(search, names), replace=with_signature(replace, names),
        example_inputs=example_inputs, op="k3.attn_res_mix_norm",
        check=functools.partial(check, mix_weights_fp32=mix_weights_fp32),
        kernel_refusal=kernel_refusal if mix_weights_fp32 else None,
        scalars={"mix_eps": 1.1e-5, "norm_eps": 1.3e-5}, distinctive=("amax", "rsqrt", "cat", "exp"),
    )


def flags(scores_fp32: bool, norm_weight_fp32: bool) -> tuple:
    """The op's trailing flags (none for the plain call: its trace stays as before)."""
    if norm_weight_fp32:
        return scores_fp32, True
    return (True,) if scores_fp32 else ()


# fp32 models trace without the bf16 casts, so the dtype is a variant of the pattern's graph;
# the fp32 scores differ from the built-in ones only where the sources round (not in fp32)
DTYPES = (torch.bfloat16, torch.float32)
KINDS = ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True))
# (dtype, scores_fp32) with the norm's weight multiplied in fp32 (norm_weight_fp32): spell9's
# mixes (scores in fp32, as a Flax port writes them); the TP form (allreduce_attn_res_mix_norm)
# has no such variant
NORM_FP32_WEIGHT_KINDS = ((torch.bfloat16, True),)
# (dtype, scores_fp32, norm_weight_fp32) with fp32 mix weights (mix_weights_fp32): spell11's
# fp32 masters under autocast (the oproj and all-reduce forms match the op whatever its weights'
# dtype: their searches hold the op, not its math)
MIX_WEIGHTS_FP32_KINDS = ((torch.bfloat16, True, False),)


def patterns() -> list[Pattern]:
    kinds = [(t, f, False, False) for t, f in KINDS]
    kinds += [(t, f, True, False) for t, f in NORM_FP32_WEIGHT_KINDS]
    kinds += [(t, f, w, True) for t, f, w in MIX_WEIGHTS_FP32_KINDS]
    return [_variant(n, d, t, f, w, m) for (t, f, w, m), n, d in
            itertools.product(kinds, range(MAX_BLOCKS, 0, -1), (True, False))]
