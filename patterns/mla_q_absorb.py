"""Gated MLA's q_b GEMM + the W_UK absorption -> `k3.mla_q_absorb` (spec §3.2 steps 3 and 5).

Matches `GatedMLA.forward`'s `q_b_proj(cq).view(B, T, H, N + R)`, the split into q_nope | q_pe and
`einsum("bthd,hdc->bthc", q_nope, W_UK)`, where W_UK [H, N, C] is the first half of
kv_b_proj.weight viewed [H, N + V, C] (an input of the pattern: its shape gives H and N).
Size-1 batch or token dims change the einsum's graph: two variants (B or T is 1, neither is).

Before: permute, view, mm, view, view, split_with_sizes, unsqueeze, permute, unsqueeze, unsqueeze,
    permute, view, view, bmm, view, permute, view
After:  q_lat, q_pe = k3.mla_q_absorb(cq, W_qb, W_UK)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.ops import registry
from k3compile.rewrite import Pattern, tensor_meta

# (B, T) of the examples: the einsum's graph has two forms, one when B or T is 1 and one when
# neither is; no casts, so one trace serves every dtype (tests/fusions checks every (B, T, dtype)
# traces to one of these).
SIZES = ((1, 1), (2, 2))
H, N, R, V, Q, C = 2, 8, 4, 8, 16, 12  # tracing sizes; matching ignores sizes


def search(cq, w_qb, w_uk):
    B, T = cq.shape[:2]
    nh, nope = w_uk.shape[:2]
    q = F.linear(cq, w_qb).view(B, T, nh, -1)
    q_nope, q_pe = q.split([nope, q.shape[-1] - nope], dim=-1)
    return torch.einsum("bthd,hdc->bthc", q_nope, w_uk), q_pe


def replace(cq, w_qb, w_uk):
    return torch.ops.k3.mla_q_absorb(cq, w_qb, w_uk)


def check(match) -> str | None:
    cq, w_qb, w_uk = (tensor_meta(match.kwargs[k]) for k in ("cq", "w_qb", "w_uk"))
    if any(t is None for t in (cq, w_qb, w_uk)):
        return "an input has no tensor metadata"
    if cq.dim() != 3 or w_qb.dim() != 2 or w_uk.dim() != 3:
        return f"ranks cq {cq.dim()}, W_qb {w_qb.dim()}, W_UK {w_uk.dim()} (want 3, 2, 3)"
    nh, nope, _ = w_uk.shape
    if w_qb.shape[1] != cq.shape[-1] or w_qb.shape[0] % nh or w_qb.shape[0] // nh <= nope:
        return f"W_qb {list(w_qb.shape)} does not give {nh} heads of > {nope} from {cq.shape[-1]}"
    if cq.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {cq.dtype}"
    if w_qb.dtype != cq.dtype or w_uk.dtype != cq.dtype:
        return f"weights {w_qb.dtype}, {w_uk.dtype} != activations {cq.dtype}"
    return None


def kernel_refusal(match) -> str | None:
    """On GPU graphs the op's kernel (opt-in: K3_KERNELS_EXTRA) says which sites it takes (at
    most 64 bf16 rows); every other site stays with Inductor (mm and bmm, as the reference would
    run them). Without the kernel every site fuses as before and the op runs its reference: the
    MLA patterns after it (mla_decode) read its outputs."""
    if registry.entry("mla_q_absorb") is None:
        return None
    return registry.kernel_refusal(
        "mla_q_absorb", *(tensor_meta(match.kwargs[k]) for k in ("cq", "w_qb", "w_uk")))


def _variant(B: int, T: int, dtype: torch.dtype = torch.bfloat16) -> Pattern:
    def example_inputs():
        w_kvb = torch.randn(H, N + V, C, dtype=dtype)  # W_UK is a view of it, as in the model
        return [torch.randn(B, T, Q, dtype=dtype), torch.randn(H * (N + R), Q, dtype=dtype),
                w_kvb.split([N, V], dim=1)[0]]

    return Pattern(
        name=f"mla_q_absorb[B={'1' if B == 1 else 'n'},T={'1' if T == 1 else 'n'}]",
        search=search, replace=replace, example_inputs=example_inputs, op="k3.mla_q_absorb",
        check=check, kernel_refusal=kernel_refusal, distinctive=("mm", "bmm", "split_with_sizes"),
        joint_passes=True,
    )


def patterns() -> list[Pattern]:
    return [_variant(b, t) for b, t in SIZES]
