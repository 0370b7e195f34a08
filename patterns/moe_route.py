"""MoE routing: sigmoid scores, bias-corrected top-k, unbiased renormalised weights ->
`k3.moe_route` (spec §3.3 steps 1-2, `noaux_tc`; §5.2 row 8).

Matches MoEGate after its GEMM: `s = sigmoid(logits)`, `top_k(s + bias)`, the gather of the
unbiased scores, their renormalisation and the routed scaling factor. Foreign gates reach this
form through the canonical rules (`topk_sorted`, `broadcast`, `noop_view`, `group_limit`). The
renormalisation comes in three spellings, each a variant that the op carries exactly:
`w / (w.sum(-1, keepdim=True) + eps)` (K3 and DeepSeek-V3: eps 1e-20; any eps is captured),
`w / w.sum(-1, keepdim=True).clamp_min(eps)` (`clamp(min=eps)` traces to it) and `w / w.sum(..)`
(eps 0, added: the same values, see `k3compile.ops.moe_route`). `div` / `/` / `/=` are one ATen
op. The check wants every captured scalar a compile-time number; the engine compares the gather's
and the sum's dims, which Inductor's matcher takes as wildcards (`inductor.disagreement`).

Before: sigmoid, add, topk, getitem, gather, sum, add | clamp_min | -, div, mul
After:  ids, weights = k3.moe_route(logits, bias, top_k, scaling, eps, clamp)
"""

from __future__ import annotations

import functools

import torch

from k3compile.ops import registry
from k3compile.rewrite import Pattern, tensor_meta

aten = torch.ops.aten
# traced with these unique literals, captured as arguments
TOP_K, SCALING, EPS = 3, 1.7, 1.3e-19


def _route(logits, bias, top_k, scaling, renormalise):
    # weights first: the match anchors on the first output, whose input cone then holds every op
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + bias, top_k, dim=-1)
    weights = scores.gather(-1, ids)
    return renormalise(weights) * scaling, ids


def search_add(logits, bias, top_k, scaling, eps):
    return _route(logits, bias, top_k, scaling, lambda w: w / (w.sum(-1, keepdim=True) + eps))


def search_clamp(logits, bias, top_k, scaling, eps):
    return _route(logits, bias, top_k, scaling, lambda w: w / w.sum(-1, keepdim=True).clamp_min(eps))


def search_plain(logits, bias, top_k, scaling):
    return _route(logits, bias, top_k, scaling, lambda w: w / w.sum(-1, keepdim=True))


def _replace(logits, bias, top_k, scaling, eps, clamp):
    ids, weights = torch.ops.k3.moe_route(logits, bias, top_k, float(scaling), float(eps), clamp)
    return weights, ids


def replace_add(logits, bias, top_k, scaling, eps):
    return _replace(logits, bias, top_k, scaling, eps, False)


def replace_clamp(logits, bias, top_k, scaling, eps):
    return _replace(logits, bias, top_k, scaling, eps, True)


def replace_plain(logits, bias, top_k, scaling):
    return _replace(logits, bias, top_k, scaling, 0.0, False)


def kernel_refusal(match, clamp: bool = False) -> str | None:
    """The CUDA kernel's limits (experts a multiple of 4 up to its maximum, top_k, K3's
    renormalisation), from the op registry: on GPU graphs a site past them stays with Inductor."""
    m = match.kwargs
    return registry.kernel_refusal("moe_route", tensor_meta(m["logits"]), tensor_meta(m["bias"]),
                                   m["top_k"], m["scaling"], float(m.get("eps", 0.0)), clamp)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(match) -> str | None:
    logits, bias = tensor_meta(match.kwargs["logits"]), tensor_meta(match.kwargs["bias"])
    top_k, scaling = match.kwargs["top_k"], match.kwargs["scaling"]
    if not isinstance(top_k, int) or not _is_number(scaling):
        return f"top_k {top_k!r} / scaling {scaling!r} are not compile-time constants"
    if "eps" in match.kwargs and not _is_number(match.kwargs["eps"]):
        return f"the renormalisation's epsilon {match.kwargs['eps']!r} is not a compile-time number"
    if logits is None or bias is None or logits.dtype != torch.float32:
        return f"logits {getattr(logits, 'dtype', None)} are not fp32"
    if logits.dim() != 2 or tuple(bias.shape) != (logits.shape[-1],):
        return f"logits {tuple(logits.shape)} / bias {tuple(bias.shape)} (want [N, E] / [E])"
    return None


def example_inputs():
    return [torch.randn(2, 8), torch.randn(8), TOP_K, SCALING, EPS]


def patterns() -> list[Pattern]:
    def variant(name, search, replace, eps=True, clamp=False):
        scalars = {"top_k": TOP_K, "scaling": SCALING} | ({"eps": EPS} if eps else {})
        return Pattern(
            name=name, search=search, replace=replace,
            example_inputs=example_inputs if eps else lambda: example_inputs()[:-1],
            op="k3.moe_route", check=check, scalars=scalars,
            kernel_refusal=functools.partial(kernel_refusal, clamp=clamp),
            # gather + sigmoid mark a router: a top-k spelled otherwise (a sort) is then a near
            # miss naming the node where the top-k was expected
            distinctive=("gather", "sigmoid"))

    return [variant("moe_route", search_add, replace_add),
            variant("moe_route[clamp]", search_clamp, replace_clamp, clamp=True),
            variant("moe_route[no_eps]", search_plain, replace_plain, eps=False)]
