"""MoE front: the fp32 router GEMM and the latent down-projection on the same input ->
`k3.moe_front` (spec §5.2 row 7: one launch reads x once and writes both).

Matches MoEGate's `sigmoid(F.linear(x.float(), W_router.float()))` and LatentMoE's
`routed_expert_down_proj(x)` on the same 2-D x, where the scores choose experts: the sigmoid
feeds a top-k or sort (through the bias add). Without that anchor two GEMMs on one input with a
sigmoid on the first are not a router: KDA's β (sigmoid(b_proj)) beside q_proj and MLA's output
gate (sigmoid(g_proj)) beside q_a_proj look the same (issue 18).

Before: sigmoid(mm(convert(x, f32), permute(convert(W_r, f32)))); mm(x, permute(W_d))
After:  logits, z = k3.moe_front(x, W_r, W_d); sigmoid(logits)

Variant `router_fp32` (bf16 / fp16 x): the router weight is an fp32 tensor read as it is (fp32
master weights under `torch.autocast`, the router in an fp32 island: tests/models/spell11_k3.py),
so only x is cast; the op's fp32 logits are `F.linear(x.float(), W_r)`, the same computation. Its
CUDA implementation takes an fp32 router through the reference's two GEMMs (one launch reads
bf16 operands only).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from k3compile.graph import feeds_top_k as reaches_top_k
from k3compile.ops.moe_front import moe_front_refusal
from k3compile.rewrite import Pattern, tensor_meta

DTYPES = (torch.bfloat16, torch.float32)
LOW = (torch.bfloat16, torch.float16)  # x's dtypes beside an fp32 router (`router_fp32`)


# The router's sigmoid anchors the match (it is the first output): in an fp32 model the casts
# vanish and the two GEMMs alone would match any GEMM. The sigmoid stays for `moe_route`.
def search(x, router_w, down_w):
    return torch.sigmoid(F.linear(x.float(), router_w.float())), F.linear(x, down_w)


def replace(x, router_w, down_w):
    logits, z = torch.ops.k3.moe_front(x, router_w, down_w)
    return torch.sigmoid(logits), z


# what a router's scores feed within a few steps (the bias add, a cast, a view in between)
_CHOOSER_DEPTH = 3


def feeds_top_k(node) -> bool:
    """node's value reaches a top-k or sort through at most `_CHOOSER_DEPTH` ops."""
    return reaches_top_k(node, _CHOOSER_DEPTH)


def check(match, router_fp32: bool = False) -> str | None:
    x, wr, wd = (tensor_meta(match.kwargs[k]) for k in ("x", "router_w", "down_w"))
    if any(t is None for t in (x, wr, wd)):
        return "an input has no tensor metadata"
    if router_fp32 and (wr.dtype != torch.float32 or x.dtype not in LOW):
        return f"router {wr.dtype} beside {x.dtype} x (the variant: an fp32 router, bf16 / fp16 x)"
    scores = next(n for n in match.nodes if n.target is torch.ops.aten.sigmoid.default)
    if not feeds_top_k(scores):
        return f"the sigmoid {scores.name} feeds no top-k or sort (not a router's scores)"
    return moe_front_refusal(x, wr, wd)


def _variant(dtype: torch.dtype, router_fp32: bool = False) -> Pattern:
    def example_inputs():
        return [torch.randn(2, 64, dtype=dtype),
                torch.randn(16, 64, dtype=torch.float32 if router_fp32 else dtype),
                torch.randn(32, 64, dtype=dtype)]

    return Pattern(
        name=f"moe_front[{str(dtype).removeprefix('torch.')}"
             f"{',router_fp32' if router_fp32 else ''}]",
        search=search, replace=replace, example_inputs=example_inputs, op="k3.moe_front",
        check=functools.partial(check, router_fp32=router_fp32), distinctive=("sigmoid", "mm"),
        exclusive=("router_w", "down_w"),  # fp32: else the router GEMM also matches as the down
    )


def patterns() -> list[Pattern]:
    return [*(_variant(d) for d in DTYPES), _variant(torch.bfloat16, router_fp32=True)]
