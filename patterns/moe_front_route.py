"""The MoE front feeding the routing -> `k3.moe_front_route` (issue 21: "moe_front in one launch"
with the routing; spec §3.3 steps 1-3).

Runs after `moe_front` and `moe_route` and matches moe_route's op reading moe_front's logits,
where nothing else reads them (the engine refuses a match whose logits escape). On CUDA one
launch then writes z and, from its last CTA, ids and weights; it routes up to the kernel's row
limit (`kernel_refusal`: more rows keep the two launches). Option `front_route` (K3_FRONT_ROUTE)
turns it on; off by default.

Before: logits, z = k3.moe_front(x, W_r, W_d); ids, w = k3.moe_route(logits, bias, k, s, eps, c)
After:  ids, w, z = k3.moe_front_route(x, W_r, W_d, bias, k, s, eps, c)
"""

from __future__ import annotations

import functools

import torch

from k3compile.ops import registry
from k3compile.ops.moe_front_route import moe_front_route_refusal
from k3compile.ops.moe_route import EPS as EPS_K3
from k3compile.rewrite import Pattern, tensor_meta

# traced with these unique literals, captured as arguments
TOP_K, SCALING, EPS = 3, 1.7, 1.3e-19


def _search(x, router_w, down_w, bias, top_k, scaling, *renormalisation):
    logits, z = torch.ops.k3.moe_front(x, router_w, down_w)
    ids, weights = torch.ops.k3.moe_route(logits, bias, top_k, scaling, *renormalisation)
    return weights, ids, z  # weights first: its cone holds both ops


def _replace(x, router_w, down_w, bias, top_k, scaling, eps=EPS_K3, clamp=False):
    ids, weights, z = torch.ops.k3.moe_front_route(x, router_w, down_w, bias, top_k,
                                                   float(scaling), float(eps), clamp)
    return weights, ids, z


def check(match) -> str | None:
    x, wr, wd, bias = (tensor_meta(match.kwargs[k]) for k in ("x", "router_w", "down_w", "bias"))
    if any(t is None for t in (x, wr, wd, bias)):
        return "an input has no tensor metadata"
    return moe_front_route_refusal(x, wr, wd, bias)


def kernel_refusal(match, clamp: bool) -> str | None:
    """The CUDA kernel's limits (rows, the split gemv's and moe_route's), from the op registry:
    on GPU graphs a site past them keeps moe_front and moe_route."""
    m = match.kwargs
    return registry.kernel_refusal(
        "moe_front_route", *(tensor_meta(m[k]) for k in ("x", "router_w", "down_w", "bias")),
        m["top_k"], m["scaling"], float(m.get("eps", EPS_K3)), clamp)


def example_inputs():
    return [torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16),
            torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(16), TOP_K, SCALING, EPS]


def _variant(eps: bool, clamp: bool = False) -> Pattern:
    """moe_route's op as the graph holds it: trailing default arguments dropped (K3's eps and no
    clamp: four arguments), another eps (five), a clamp (six)."""
    extra = (True,) if clamp else ()
    if eps:
        def search(x, router_w, down_w, bias, top_k, scaling, eps):
            return _search(x, router_w, down_w, bias, top_k, scaling, eps, *extra)

        def replace(x, router_w, down_w, bias, top_k, scaling, eps):
            return _replace(x, router_w, down_w, bias, top_k, scaling, eps, clamp)
    else:
        def search(x, router_w, down_w, bias, top_k, scaling):
            return _search(x, router_w, down_w, bias, top_k, scaling)

        def replace(x, router_w, down_w, bias, top_k, scaling):
            return _replace(x, router_w, down_w, bias, top_k, scaling)

    scalars = {"top_k": TOP_K, "scaling": SCALING} | ({"eps": EPS} if eps else {})
    return Pattern(
        name="moe_front_route" + ("[clamp]" if clamp else "[eps]" if eps else ""),
        search=search, replace=replace,
        example_inputs=example_inputs if eps else lambda: example_inputs()[:-1],
        op="k3.moe_front_route", check=check, scalars=scalars, fake_trace=True,
        kernel_refusal=functools.partial(kernel_refusal, clamp=clamp),
        distinctive=("moe_front", "moe_route"))


def patterns() -> list[Pattern]:
    # the dtypes hide inside the two ops: one variant per renormalisation the graph spells
    return [_variant(False), _variant(True), _variant(True, clamp=True)]
