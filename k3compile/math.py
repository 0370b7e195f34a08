"""The K3 reference math, written once: the model (`models/k3.py`), the op references
(`k3compile/ops/`) and the pattern searches (`patterns/`) all call these functions.

Each function is written op for op as K3's released modeling code reads, because two things
depend on the exact ATen calls: the patterns match the model's traced graph, and the CPU
references must round like eager (the rewritten graph is compared bit for bit in fp32).
Spelling a line differently here changes both.

    rms_norm(x; w)         = w · (x / sqrt(mean(x²) + eps))        fp32 math, cast back, then · w
    depth_mix(prefix, bs)  = Σ_s softmax_s(proj(norm(s))) · s       over s in [*bs, prefix], fp32
    situ(g, u)             = β·tanh(g/β)·σ(g) · β₂·tanh(u/β₂)       fp32 math, cast to g's dtype
    l2norm(x)              = x / sqrt(Σx² + eps)
    delta_rule_step        S <- Diag(α_t)·S;  S <- S + k_t·(β_t(v_t − Sᵀk_t))ᵀ;  o_t = Sᵀq_t
    route_top_k            ids = top_k(σ(logits) + bias), w = σ[ids] / (Σ σ[ids] + 1e-20) · scaling
                           (another eps, or max(Σ σ[ids], eps) with `clamp`: foreign routers)
    mxfp4_dequant          w = e2m1[nibble] · 2^(scale − 127), one E8M0 scale per 32 inputs
    mxfp4_experts          Σ_k w_k · (situ(z·W1[ids_k]ᵀ, z·W3[ids_k]ᵀ) · W2[ids_k]ᵀ)   fp32 finalize
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# ---- RMSNorm and the Attention-Residual depth mix (spec §2) -------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast to x's dtype, multiply by the weight (Moonshot's reference order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float,
                         dtype: torch.dtype) -> torch.Tensor:
    """Normalise in fp32, multiply by the weight in fp32, one rounding to `dtype` (torch's
    `F.rms_norm` / `nn.RMSNorm` on an upcast input, the weight upcast too). `rms_norm` rounds the
    normalised row first and multiplies in x's dtype instead (the same in fp32)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(dtype)


def rms_norm_gated_fp32(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """RMSNorm(x; weight) ⊙ sigmoid(gate) in fp32 throughout, one rounding to x's dtype (fla's
    `FusedRMSNormGated`, Moonshot's KDA output norm). `rms_norm(x) * sigmoid(gate)` rounds the
    norm, its product with the weight and the gate to x's dtype instead (the same in fp32)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * weight.float()
    return (h * torch.sigmoid(gate.float())).to(x.dtype)


Fn = Callable[[torch.Tensor], torch.Tensor]


def depth_mix(prefix: torch.Tensor, blocks: list[torch.Tensor], norm: Fn, proj: Fn
              ) -> torch.Tensor:
    """Softmax over the sources [*blocks, prefix] of a learned pseudo-query (`proj`, to [.., 1])
    against the RMS-normalised sources (`norm`), applied to the raw sources in fp32; the identity
    with no completed blocks. `norm` and `proj` are callables so that the model passes its
    modules (the graph then names them: the contract and the diff tool read those names)."""
    if not blocks:
        return prefix
    sources = torch.stack([*blocks, prefix])  # [S, ..., D]
    scores = proj(norm(sources)).squeeze(-1).float()  # [S, ...]
    alpha = torch.softmax(scores, dim=0)
    return (alpha.unsqueeze(-1) * sources.float()).sum(0).to(prefix.dtype)


def depth_mix_weights(prefix: torch.Tensor, blocks: list[torch.Tensor], norm_weight: torch.Tensor,
                      proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`depth_mix` given the weights of its RMSNorm and of its pseudo-query [1, D]."""
    return depth_mix(prefix, blocks, lambda s: rms_norm(s, norm_weight, eps),
                     lambda s: F.linear(s, proj_weight))


def depth_mix_scores_fp32(prefix: torch.Tensor, blocks: list[torch.Tensor],
                          norm_weight: torch.Tensor, proj_weight: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """`depth_mix_weights` with the scores in fp32 throughout (Moonshot's `_apply_attn_res`):
    each source normalised in fp32 and dotted with w_norm·w_proj in fp32. `depth_mix_weights`
    rounds the normalised sources, their product with w_norm and the projection to the sources'
    dtype instead (the same in fp32)."""
    if not blocks:
        return prefix
    sources = torch.stack([*blocks, prefix]).float()  # [S, ..., D]
    h = sources * torch.rsqrt(sources.pow(2).mean(-1, keepdim=True) + eps)
    scores = (h * (norm_weight.float() * proj_weight.float().view(-1))).sum(-1)  # [S, ...]
    alpha = torch.softmax(scores, dim=0)
    return (alpha.unsqueeze(-1) * sources).sum(0).to(prefix.dtype)


# ---- SiTU-GLU (spec §3.3) -----------------------------------------------------------------------


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU: beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta), fp32 math."""
    g = gate.float()
    u = up.float()
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    lin = linear_beta * torch.tanh(u / linear_beta)
    return (act * lin).to(gate.dtype)


# ---- KDA (spec §3.1) ----------------------------------------------------------------------------


def l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / ||x|| over the last dim, eps inside the square root."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    beta: torch.Tensor, decay: torch.Tensor, t: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t of the gated delta rule on the fp32 state [B, H, K, V]; q, k, v, decay are
    [B, T, H, K], beta [B, T, H]. Returns (the new state, o_t [B, H, V]).

    Takes the whole [B, T, ...] tensors and t, not the token's rows: k's rows are read twice,
    and the traced graph (which the patterns match) has one select per read."""
    state = state * decay[:, t].unsqueeze(-1)
    kv = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
    u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv)
    state = state + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
    return state, torch.einsum("bhkv,bhk->bhv", state, q[:, t])


# ---- LatentMoE routing and MXFP4 experts (spec §3.3) --------------------------------------------


def route_top_k(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                eps: float = 1e-20, clamp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [N, E] -> (ids [N, k] chosen by score + bias, their unbiased scores
    renormalised and scaled [N, k]). The renormalisation divides by Σ + eps, or by max(Σ, eps)
    with `clamp`."""
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + bias, top_k, dim=-1)
    weights = scores.gather(-1, ids)  # unbiased scores of the biased choice
    total = weights.sum(-1, keepdim=True)
    weights = weights / (total.clamp_min(eps) if clamp else total + eps)
    return ids, weights * scaling


# MXFP4 (OCP microscaling FP4) as stored in K3's routed experts: `packed` uint8 [out, in/2], two
# E2M1 nibbles per byte, the low nibble the even input; `scale` uint8 [out, in/32], one E8M0
# exponent per 32 inputs.
GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """[..., out, in/2] uint8 + [..., out, in/32] uint8 -> [..., out, in] in lut's dtype."""
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    vals = torch.stack((lut[lo], lut[hi]), dim=-1).flatten(-2)  # [..., out, in]
    *lead, out, width = vals.shape
    grouped = vals.view(*lead, out, width // GROUP, GROUP)
    factor = torch.exp2(scale.to(torch.float32) - 127.0).to(lut.dtype).unsqueeze(-1)
    return (grouped * factor).view(*lead, out, width)


def mxfp4_experts(z, ids, weights, lut, w1_packed, w1_scale, w3_packed, w3_scale, w2_packed,
                  w2_scale, beta: float, linear_beta: float,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The routed experts, W4A16: z [N, L], ids/weights [N, k], stacked MXFP4 experts, `lut` the
    E2M1 table in z's dtype. Dequantise the selected experts, GEMMs in z's dtype, fp32 finalize,
    rounded to `out_dtype` (default z's; fp32: the finalize's sum unrounded)."""
    w1 = mxfp4_dequant(w1_packed[ids], w1_scale[ids], lut)  # [N, k, I, L]
    w3 = mxfp4_dequant(w3_packed[ids], w3_scale[ids], lut)
    w2 = mxfp4_dequant(w2_packed[ids], w2_scale[ids], lut)  # [N, k, L, I]
    hg = torch.einsum("nl,nkil->nki", z, w1)
    hu = torch.einsum("nl,nkil->nki", z, w3)
    act = situ(hg, hu, beta, linear_beta)
    y = torch.einsum("nki,nkli->nkl", act, w2)
    return (weights.unsqueeze(-1) * y.float()).sum(1).to(out_dtype or z.dtype)
