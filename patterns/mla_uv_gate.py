"""Gated MLA's W_UV up-projection + sigmoid output gate -> `k3.mla_uv_gate` (spec §3.2 steps 8-9).

Matches `GatedMLA.forward`'s `einsum("bthc,hvc->bthv", o_lat, W_UV).reshape(B, T, H·V)` and the
product with `sigmoid(g)`, where W_UV [H, V, C] is the second half of kv_b_proj.weight viewed
[H, N + V, C]. Two variants: B == T == 1 changes the einsum's graph. `gate_fp32` (bf16): the
gate product in an fp32 island, one rounding (`(o.float() * sigmoid(g.float())).to(bf16)`: fp32
islands under autocast, tests/models/spell11_k3.py) -> the op's `gate_fp32=True`, another rounding
than K3's (sigmoid(g) rounded first), so a variant, not a canonical rule; its kernel build does
not exist yet (`kernel_refusal` leaves it to Inductor on GPU graphs).

Before: unsqueeze, permute, unsqueeze, unsqueeze, permute, permute, view, permute, view, bmm,
    view, permute, view, clone, view, sigmoid, mul
After:  o = k3.mla_uv_gate(o_lat, W_UV, g)
"""

from __future__ import annotations

import functools

import torch

from k3compile.ops import registry
from k3compile.rewrite import Pattern, tensor_meta

# (B, T) of the examples: the einsum's graph has two forms, one when B == T == 1 and one for every
# other B, T; no casts, so one trace serves every dtype (tests/fusions checks every (B, T, dtype)
# traces to one of these).
SIZES = ((1, 1), (2, 2))
H, N, V, C, L = 2, 8, 8, 12, 6  # tracing sizes; matching ignores sizes


def search(o_lat, w_uv, g):
    B, T = o_lat.shape[:2]
    nh, v = w_uv.shape[:2]
    o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, nh * v)
    return o * torch.sigmoid(g)


def replace(o_lat, w_uv, g):
    return torch.ops.k3.mla_uv_gate(o_lat, w_uv, g)


def search_gate_fp32(o_lat, w_uv, g):
    B, T = o_lat.shape[:2]
    nh, v = w_uv.shape[:2]
    o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, nh * v)
    return (o.float() * torch.sigmoid(g.float())).to(o.dtype)


def replace_gate_fp32(o_lat, w_uv, g):
    return torch.ops.k3.mla_uv_gate(o_lat, w_uv, g, True)


def check(match) -> str | None:
    o_lat, w_uv, g = (tensor_meta(match.kwargs[k]) for k in ("o_lat", "w_uv", "g"))
    if any(t is None for t in (o_lat, w_uv, g)):
        return "an input has no tensor metadata"
    if o_lat.dim() != 4 or w_uv.dim() != 3 or g.dim() != 3:
        return f"ranks o_lat {o_lat.dim()}, W_UV {w_uv.dim()}, g {g.dim()} (want 4, 3, 3)"
    if g.shape[-1] != w_uv.shape[0] * w_uv.shape[1] or o_lat.shape[-1] != w_uv.shape[-1]:
        return f"g {list(g.shape)} / o_lat {list(o_lat.shape)} do not fit W_UV {list(w_uv.shape)}"
    # o_lat is read as [B, T, H, C]: a heads-first [B, H, 1, C] whose permute the matcher took
    # for the pattern's (the same order of the dims longer than 1 at T = 1) is not (spell14)
    if o_lat.shape[2] != w_uv.shape[0] or o_lat.shape[:2] != g.shape[:2]:
        return (f"o_lat {list(o_lat.shape)} is not [B, T, H, C] for g {list(g.shape)} and "
                f"W_UV {list(w_uv.shape)}")
    if o_lat.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {o_lat.dtype}"
    if {o_lat.dtype, w_uv.dtype, g.dtype} != {o_lat.dtype}:
        return f"dtypes o_lat {o_lat.dtype}, W_UV {w_uv.dtype}, g {g.dtype} differ"
    return None


def kernel_refusal(match, gate_fp32: bool = False) -> str | None:
    """On GPU graphs the op's kernel (gemv's gate variant at one row, on by default) says which
    sites it takes; every other site stays with Inductor (the reference would run einsum and gate
    op by op)."""
    return registry.kernel_refusal(
        "mla_uv_gate", *(tensor_meta(match.kwargs[k]) for k in ("o_lat", "w_uv", "g")),
        **({"gate_fp32": True} if gate_fp32 else {}))


def _variant(B: int, T: int, dtype: torch.dtype = torch.bfloat16,
             gate_fp32: bool = False) -> Pattern:
    def example_inputs():
        # o_lat as the model has it: an einsum result (a permuted view), W_UV a view of kv_b
        p = torch.randn(B, T, H, L, dtype=dtype)
        o_lat = torch.einsum("bthl,blc->bthc", p, torch.randn(B, L, C, dtype=dtype))
        w_uv = torch.randn(H, N + V, C, dtype=dtype).split([N, V], dim=1)[1]
        return [o_lat, w_uv, torch.randn(B, T, H * V, dtype=dtype)]

    return Pattern(
        name=f"mla_uv_gate[B={'1' if B == 1 else 'n'},T={'1' if T == 1 else 'n'}"
             f"{',gate_fp32' if gate_fp32 else ''}]",
        search=search_gate_fp32 if gate_fp32 else search,
        replace=replace_gate_fp32 if gate_fp32 else replace, example_inputs=example_inputs,
        op="k3.mla_uv_gate", check=check,
        kernel_refusal=functools.partial(kernel_refusal, gate_fp32=gate_fp32),
        distinctive=("bmm", "sigmoid"), joint_passes=True,
    )


def patterns() -> list[Pattern]:
    # gate_fp32 traced in bf16: its casts name the dtype
    return [_variant(b, t, gate_fp32=f) for f in (False, True) for b, t in SIZES]
