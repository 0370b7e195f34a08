"""MoE routing: sigmoid scores, bias-corrected top-k, unbiased renormalised weights ->
`k3.moe_route` (spec §3.3 steps 1-2, `noaux_tc`; §5.2 row 8).

Matches MoEGate after its GEMM: `s = sigmoid(logits)`, `top_k(s + bias)`, the gather of the
unbiased scores, the renormalisation with 1e-20 and the routed scaling factor. Foreign gates
reach this form through the canonical rules (`topk_sorted`, `broadcast`, `noop_view`,
`group_limit`); the check reads the literals the matcher takes as wildcards (dims, epsilon).

Before: sigmoid, add, topk, getitem, gather, sum, add, div, mul
After:  ids, weights = k3.moe_route(logits, bias, top_k, scaling)
"""

from __future__ import annotations

import torch

from k3compile.ops import registry
from k3compile.rewrite import Pattern, tensor_meta

aten = torch.ops.aten
TOP_K, SCALING = 3, 1.7  # traced with these unique literals, captured as arguments
EPS = 1e-20  # the op's renormalisation epsilon (k3compile.math.route_top_k)


# weights first: the match anchors on the first output, whose input cone then holds every op
def search(logits, bias, top_k, scaling):
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + bias, top_k, dim=-1)
    weights = scores.gather(-1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + EPS)
    return weights * scaling, ids


def replace(logits, bias, top_k, scaling):
    ids, weights = torch.ops.k3.moe_route(logits, bias, top_k, float(scaling))
    return weights, ids


def kernel_refusal(match) -> str | None:
    """The CUDA kernel's limits (experts a multiple of 4 up to its maximum, top_k), from the op
    registry: on GPU graphs a site past them stays with Inductor."""
    m = match.kwargs
    return registry.kernel_refusal("moe_route", tensor_meta(m["logits"]), tensor_meta(m["bias"]),
                                   m["top_k"])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def literal_refusal(match) -> str | None:
    """What the matcher does not compare: it takes int and float literals as wildcards, so a
    gather or sum over another dim, or another renormalisation epsilon, would match too. The op
    gathers and sums over the experts (the last dim, the sum kept as a column) and adds 1e-20."""
    by_target = {n.target: n for n in match.nodes}
    gather, total = by_target[aten.gather.default], by_target[aten.sum.dim_IntList]
    eps = next(n for n in total.users if n.target is aten.add.Tensor)
    if gather.args[1] % 2 != 1:
        return f"{gather.name} gathers along dim {gather.args[1]}, not the experts"
    dims, keepdim = total.args[1], (*total.args[2:], total.kwargs.get("keepdim", False))[0]
    if [d % 2 for d in dims] != [1] or not keepdim:
        return f"{total.name} sums dims {dims} (keepdim {keepdim}), not the experts as a column"
    if eps.args[1] != EPS:
        return f"{eps.name} renormalises with epsilon {eps.args[1]!r}, the op with {EPS}"
    return None


def check(match) -> str | None:
    logits, bias = tensor_meta(match.kwargs["logits"]), tensor_meta(match.kwargs["bias"])
    top_k, scaling = match.kwargs["top_k"], match.kwargs["scaling"]
    if not isinstance(top_k, int) or not _is_number(scaling):
        return f"top_k {top_k!r} / scaling {scaling!r} are not compile-time constants"
    if logits is None or bias is None or logits.dtype != torch.float32:
        return f"logits {getattr(logits, 'dtype', None)} are not fp32"
    if logits.dim() != 2 or tuple(bias.shape) != (logits.shape[-1],):
        return f"logits {tuple(logits.shape)} / bias {tuple(bias.shape)} (want [N, E] / [E])"
    return literal_refusal(match)


def example_inputs():
    return [torch.randn(2, 8), torch.randn(8), TOP_K, SCALING]


def patterns() -> list[Pattern]:
    return [Pattern(
        name="moe_route", search=search, replace=replace, example_inputs=example_inputs,
        op="k3.moe_route", check=check, kernel_refusal=kernel_refusal, scalars={"top_k": TOP_K, "scaling": SCALING},
        # gather + sigmoid mark a router: a top-k spelled otherwise (a sort) is then a near miss
        # naming the node where the top-k was expected
        distinctive=("gather", "sigmoid"),
    )]
