"""Gated MLA's two low-rank RMSNorms -> `k3.mla_lowrank_norm` (spec §3.2 step 2).

Matches `GatedMLA.forward`'s q_a_proj -> q_a_layernorm and kv_a_proj_with_mqa -> split
[c_kv | k_pe] -> kv_a_layernorm. The two GEMMs are part of the search only to tie the two norms
into one site (the matcher reaches a pattern's second output through a shared input, here x);
the replacement keeps them as GEMMs, which `linear_concat[mla]` then fuses into one.

Before: permute, view, mm, view, convert, pow, mean, add, rsqrt, mul, convert, mul (q side);
    permute, view, mm, view, split_with_sizes, convert, pow, mean, add, rsqrt, mul, convert, mul
After:  cq = x·W_qaᵀ; ckv = x·W_kvaᵀ; cq, c_kv, k_pe = k3.mla_lowrank_norm(cq, ckv, w_q, w_kv, eps)

Variants: [B, T, D] activations (F.linear adds a view before and after each mm) and `,rows`:
[N, D] rows (vLLM's flattened tokens, `tests/models/redteam_k3.py`), plain mm. Rows whose GEMM
outputs are viewed [N, 1, .] (`x.unsqueeze(1)` before the linears) have no variant: rule
`token_linear` lifts them to the [B, 1, D] form first (docs/decisions.md, session 36).
The two eps are compared in float32 (`same_eps`). `,weight_fp32` (bf16): both norms multiply
their weight in fp32 before the one rounding to bf16 (a JAX/Flax-style norm, tests/models/
spell9_k3.py; `math.rms_norm_fp32_weight`) -> the op's `weight_fp32=True`; another rounding than
K3's, so a variant, not a canonical rule; the kernel's build for it passed its GPU tests
(H100, 2026-12-05, session 26), so GPU graphs fuse it too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.math import rms_norm, rms_norm_fp32_weight
from k3compile.rewrite import Pattern, tensor_meta

DTYPES = (torch.bfloat16, torch.float32)


def _norm(weight_fp32: bool):
    if weight_fp32:
        return lambda x, w, eps: rms_norm_fp32_weight(x, w, eps, x.dtype)
    return rms_norm


def _search(weight_fp32: bool):
    norm = _norm(weight_fp32)

    def search(x, w_qa, w_kva, w_qn, w_kvn, q_eps, kv_eps):
        cq = F.linear(x, w_qa)
        ckv = F.linear(x, w_kva)
        c = w_kvn.shape[0]
        c_kv, k_pe = ckv.split([c, ckv.shape[-1] - c], dim=-1)
        return norm(c_kv, w_kvn, kv_eps), k_pe, norm(cq, w_qn, q_eps)
    return search


def _replace(weight_fp32: bool):
    flag = (True,) if weight_fp32 else ()

    def replace(x, w_qa, w_kva, w_qn, w_kvn, q_eps, kv_eps):
        cq, c_kv, k_pe = torch.ops.k3.mla_lowrank_norm(
            F.linear(x, w_qa), F.linear(x, w_kva), w_qn, w_kvn, q_eps, *flag)
        return c_kv, k_pe, cq
    return replace


def same_eps(a: float, b: float) -> bool:
    """The same eps as the fused ops use it, in float32: `F.rms_norm(x, eps=1e-5)` hands them
    9.99999975e-06 (float32-rounded), a spelled-out norm 1e-05."""
    return torch.tensor(a, dtype=torch.float32) == torch.tensor(b, dtype=torch.float32)


def check(match) -> str | None:
    q_eps, kv_eps = match.kwargs["q_eps"], match.kwargs["kv_eps"]
    if not isinstance(q_eps, float) or not isinstance(kv_eps, float):
        return "eps is not a compile-time float"
    if not same_eps(q_eps, kv_eps):
        return f"the two norms' eps differ ({q_eps} vs {kv_eps}); the op takes one"
    x, w_qa, w_kva, w_qn, w_kvn = (tensor_meta(match.kwargs[k])
                                   for k in ("x", "w_qa", "w_kva", "w_qn", "w_kvn"))
    if any(t is None for t in (x, w_qa, w_kva, w_qn, w_kvn)):
        return "an input has no tensor metadata"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {x.dtype}"
    if w_qn.shape != (w_qa.shape[0],) or w_kvn.dim() != 1 or w_kvn.shape[0] > w_kva.shape[0]:
        return (f"norm weights {list(w_qn.shape)}, {list(w_kvn.shape)} do not fit projections "
                f"{list(w_qa.shape)}, {list(w_kva.shape)}")
    if {w.dtype for w in (w_qa, w_kva, w_qn, w_kvn)} != {x.dtype}:
        return f"weights are not all {x.dtype}"
    return None


def _variant(dtype: torch.dtype, form: str = "", weight_fp32: bool = False) -> Pattern:
    def example_inputs():
        d, q, c, r = 32, 24, 16, 8
        return [torch.randn(2, *(() if form else (1,)), d, dtype=dtype),
                torch.randn(q, d, dtype=dtype), torch.randn(c + r, d, dtype=dtype),
                torch.randn(q, dtype=dtype), torch.randn(c, dtype=dtype), 1.1e-6, 1.3e-6]

    tags = [t for t in (form, "weight_fp32" if weight_fp32 else "") if t]
    return Pattern(
        name=f"mla_lowrank_norm[{','.join([str(dtype).removeprefix('torch.'), *tags])}]",
        search=_search(weight_fp32), replace=_replace(weight_fp32),
        example_inputs=example_inputs, op="k3.mla_lowrank_norm", check=check,
        scalars={"q_eps": 1.1e-6, "kv_eps": 1.3e-6}, distinctive=("rsqrt", "split_with_sizes"),
        exclusive=("w_qa", "w_kva"), joint_passes=True,
    )


def patterns() -> list[Pattern]:
    # [B, T, D] activations (a view before and after each GEMM), then [N, D] rows (vLLM's
    # flattened tokens: the GEMMs are plain mm and the norms read their outputs); in bf16 each
    # form also with the weights multiplied in fp32 (`weight_fp32`)
    forms = ("", "rows")
    return ([_variant(d, form) for form in forms for d in DTYPES]
            + [_variant(torch.bfloat16, form, True) for form in forms])
