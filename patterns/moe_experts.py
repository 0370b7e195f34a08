"""Routed experts over MXFP4: per selected expert dequantise W1/W3/W2, FC1, SiTU, FC2, and the
weighted finalize -> `k3.moe_experts` (spec §3.3 steps 4-5; §5.2 row 11).

Matches MXFP4Experts.forward: gathers of the packed nibbles and E8M0 scales by the routed ids,
the E2M1 lookup (the model's `e2m1` buffer, a [16] table in z's dtype), the three einsums with
SiTU between, and Σ_k w_k·y_k in fp32. The fused op builds the E2M1 table itself, so the check
reads the matched table's real value (a graph constant, or a graph input whose real tensor the
compile handed over in `gm.meta["real_inputs"]`) and refuses any table that is not E2M1.

Variant `fp32_out` (traced for bf16 z): the finalize's fp32 sum returned unrounded, where a
spelling feeds it to the latent norm in fp32 (tests/models/redteam_k3.py, spell5_k3.py) -> the
op's `out_fp32`. Rounding it to bf16 instead would change the spelling's values, so the variant keeps
the rounding and the check reads it from the match (z's dtype; the output's is the engine's).

einsum lowers to permute/view/bmm chains whose shape depends on whether there is one token row
(N = 1: a size-1 batch dim of the bmm is moved differently), so there is a variant per case,
traced through Inductor's joint-graph passes as the model's graph is.

Before (~90 ATen ops): index, bitwise_and, rshift, index(lut), cat, exp2, mul, ... bmm,
    tanh, sigmoid, ..., bmm, mul, sum, convert
After:  u = k3.moe_experts(z, ids, weights, w1p, w1s, w3p, w3s, w2p, w2s, beta, linear_beta
                            [, out_fp32=True])
"""

from __future__ import annotations

import itertools

import torch

from k3compile.canonical.mxfp4_dequant import known_value
from k3compile.math import E2M1_VALUES, e2m1_table, mxfp4_experts
from k3compile.ops import registry
from k3compile.ops.moe_experts import moe_experts_refusal
from k3compile.rewrite import Pattern, inductor, tensor_meta

DTYPES = (torch.bfloat16, torch.float32)
ROWS = (1, 3)  # token rows N traced: one row, or several (the einsum lowering differs)
LOW = (torch.bfloat16, torch.float16)  # z dtypes where an fp32 finalize is another rounding
NAMES = ("z", "ids", "weights", "w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed",
         "w2_scale")


def search(z, ids, weights, lut, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
           beta, linear_beta):
    return mxfp4_experts(z, ids, weights, lut.to(z.dtype), w1_packed, w1_scale, w3_packed,
                         w3_scale, w2_packed, w2_scale, beta, linear_beta)


def replace(z, ids, weights, lut, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale,
            beta, linear_beta):
    return torch.ops.k3.moe_experts(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale,
                                    w2_packed, w2_scale, beta, linear_beta)


def search_fp32_out(z, ids, weights, lut, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                    w2_scale, beta, linear_beta):
    return mxfp4_experts(z, ids, weights, lut.to(z.dtype), w1_packed, w1_scale, w3_packed,
                         w3_scale, w2_packed, w2_scale, beta, linear_beta, torch.float32)


def replace_fp32_out(z, ids, weights, lut, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                     w2_scale, beta, linear_beta):
    return torch.ops.k3.moe_experts(z, ids, weights, w1_packed, w1_scale, w3_packed, w3_scale,
                                    w2_packed, w2_scale, beta, linear_beta, True)


def check_fp32_out(match) -> str | None:
    z = tensor_meta(match.kwargs["z"])
    if z is not None and z.dtype not in LOW:
        return f"z {z.dtype}: the finalize's fp32 sum is z's dtype (the plain variant)"
    return check(match)


def check(match) -> str | None:
    for name in ("beta", "linear_beta"):
        if not isinstance(match.kwargs[name], float):
            return f"{name} is not a compile-time float"
    metas = [tensor_meta(match.kwargs[k]) for k in NAMES]
    if any(t is None for t in metas):
        return "an input has no tensor metadata"
    z, lut = metas[0], tensor_meta(match.kwargs["lut"])
    if lut is None or tuple(lut.shape) != (16,) or not lut.dtype.is_floating_point:
        return f"the nibble table {getattr(lut, 'shape', None)} is not a 16-entry E2M1 table"
    if (why := _not_e2m1(match.kwargs["lut"])) is not None:
        return why
    if z.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"z dtype {z.dtype} is not a float type"
    if any(t.dtype != torch.uint8 for t in metas[3:]):
        return "expert weights are not uint8 MXFP4 (packed E2M1 + E8M0 scales)"
    return moe_experts_refusal(*metas)


def _not_e2m1(lut_node) -> str | None:
    """The fused op builds the E2M1 table itself: any other table (or one whose value the compile
    cannot read) would be fused into wrong values."""
    with inductor.unset_fake_temporarily():  # real tensors, inside the compile's fake mode
        table = known_value(lut_node)
        if table is None:
            return "the nibble table's value is unknown at compile time (not a constant or input)"
        if not torch.equal(table.detach().double().cpu(), e2m1_table(dtype=torch.float64)):
            return f"the nibble table {table.tolist()} is not E2M1 {list(E2M1_VALUES)}"
    return None


def kernel_refusal(match) -> str | None:
    """The CUDA kernel's limits (e.g. intermediate sizes past its register plan, as at TP 2)."""
    return registry.kernel_refusal("moe_experts", *(tensor_meta(match.kwargs[k]) for k in NAMES))


def _variant(dtype: torch.dtype, rows: int, fp32_out: bool = False) -> Pattern:
    def example_inputs():  # distinct sizes, so no view of the trace is a no-op by accident
        n, k, e, inter, latent = rows, 2, 5, 64, 96
        u8 = {"dtype": torch.uint8}
        return [
            torch.randn(n, latent, dtype=dtype), torch.randint(0, e, (n, k)), torch.rand(n, k),
            e2m1_table(dtype=dtype),
            torch.randint(0, 255, (e, inter, latent // 2), **u8),
            torch.randint(120, 130, (e, inter, latent // 32), **u8),
            torch.randint(0, 255, (e, inter, latent // 2), **u8),
            torch.randint(120, 130, (e, inter, latent // 32), **u8),
            torch.randint(0, 255, (e, latent, inter // 2), **u8),
            torch.randint(120, 130, (e, latent, inter // 32), **u8),
            4.1, 25.3,
        ]

    name = f"{str(dtype).removeprefix('torch.')},{'one_row' if rows == 1 else 'rows'}"
    return Pattern(
        name=f"moe_experts[{name}{',fp32_out' if fp32_out else ''}]",
        search=search_fp32_out if fp32_out else search,
        replace=replace_fp32_out if fp32_out else replace,
        example_inputs=example_inputs, op="k3.moe_experts",
        check=check_fp32_out if fp32_out else check,
        kernel_refusal=kernel_refusal,
        scalars={"beta": 4.1, "linear_beta": 25.3}, distinctive=("exp2", "bitwise_and", "tanh"),
        joint_passes=True,
    )


def patterns() -> list[Pattern]:
    return [*(_variant(d, r) for d, r in itertools.product(DTYPES, ROWS)),
            *(_variant(torch.bfloat16, r, fp32_out=True) for r in ROWS)]
