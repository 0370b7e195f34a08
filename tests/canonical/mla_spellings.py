"""Non-absorbed Gated MLA, as DeepSeek/HF-style code writes it, over our model's latent cache.

`NonAbsorbedMLA` holds the same weights and state as `k3compile.models.k3.GatedMLA` (kv_b_proj
[H·(N + V), C], a latent cache [slots, max_len, C + R] written with the same index assignment) but
attends the way foreign code does: K/V up-projected from every cached latent, split per head,
k_pe broadcast over the heads. The `Spelling` flags pick the variations stage `canonicalize`
must take (rule `mla_absorb`): softmax dtype, where the scale goes, how the mask is applied, how
the rope part enters the scores, and how kv_b_proj is applied.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from k3compile.models.k3 import GatedMLA


@dataclasses.dataclass(frozen=True)
class Spelling:
    softmax_fp32: bool = True  # softmax(..., dtype=float32).to(dtype), else in the input dtype
    scale_on_q: bool = False  # q·scale before the product, else scores·scale
    additive_mask: bool = False  # scores + (0 | -inf), else masked_fill
    cat_rope: bool = True  # k = cat(k_nope, k_pe), else scores = nope term + rope term
    weight_views: bool = False  # kv_b_proj.weight split into w_kc / w_vc, else the nn.Linear
    heads_first: bool = True  # [B, H, T, *] as HF code, else [B, T, H, *] with einsum
    # cache rows written at slots[:, None], arange(T) + positions.unsqueeze(1), else .view(B, 1)
    unsqueezed_rows: bool = False
    # look-alikes the rule must leave alone (not MLA as the canonical form computes it)
    window: int | None = None  # also mask cache rows older than pos - window (sliding window)
    scale_nope_only: bool = False  # the scale on q_nope only, not on the rope part
    fp32_scores: bool = False  # q and k upcast to fp32 for the scores (other roundings)
    # spell8: q, k, v upcast, softmax and p·v in fp32 (p not cast), the output gate in fp32
    # (`o * sigmoid(g.float())`) and o cast back after it
    fp32_attention: bool = False
    # F.scaled_dot_product_attention over heads-first q, cat(k_nope, k_pe), v (spell6): "bool"
    # (attn_mask, True = attend), "bias" (an additive 0 / -inf mask), "causal" (is_causal: the
    # top-left causal mask, not decode's at T > 1, a look-alike); None: the explicit attention
    sdpa: str | None = None
    sdpa_scale: float | None = None  # SDPA's scale= (None: its default, 1 / sqrt(N + R))
    dropout: float = 0.0  # SDPA's dropout_p (a look-alike: not deterministic)


LOOKALIKES = {
    "sliding_window": Spelling(window=4),
    "scale_nope_only": Spelling(scale_nope_only=True),
}

# bf16 attention products of fp32 upcasts (rule mla_upcast, then mla_absorb; session 28)
UPCAST_SPELLINGS = {
    "fp32_scores": Spelling(fp32_scores=True),
    "fp32_attention": Spelling(fp32_attention=True),  # spell8's
    "fp32_attention_einsum": Spelling(fp32_attention=True, heads_first=False, cat_rope=False),
    "sdpa_bool_mask": Spelling(sdpa="bool"),  # spell6's (SDPA's math path upcasts)
    "sdpa_additive_mask": Spelling(sdpa="bias"),
}
UPCAST_LOOKALIKES = {  # upcast MLA that mla_absorb does not take as MLA
    "fp32_attention_sliding_window": Spelling(fp32_attention=True, window=4),
    "fp32_attention_scale_nope_only": Spelling(fp32_attention=True, scale_nope_only=True),
    "sdpa_sliding_window": Spelling(sdpa="bool", window=4),
}

SPELLINGS = {
    "hf": Spelling(),
    "hf_bf16_softmax": Spelling(softmax_fp32=False),
    "scale_q_additive": Spelling(scale_on_q=True, additive_mask=True),
    "two_terms_weight_views": Spelling(cat_rope=False, weight_views=True),
    "einsum": Spelling(heads_first=False, cat_rope=False, additive_mask=True),
    "unsqueezed_rows": Spelling(unsqueezed_rows=True),
}

# through F.scaled_dot_product_attention (rule sdpa_math, then mla_absorb; in bf16 SDPA's math
# path upcasts q, k, v: rule mla_upcast first, tests/canonical/test_mla_upcast.py)
SDPA_SPELLINGS = {
    "sdpa_bool_mask": Spelling(sdpa="bool"),
    "sdpa_additive_mask": Spelling(sdpa="bias"),
}
SDPA_LOOKALIKES = {
    "sdpa_top_left_causal": Spelling(sdpa="causal"),
    "sdpa_dropout": Spelling(sdpa="bool", dropout=0.25),
    "sdpa_sliding_window": Spelling(sdpa="bool", window=4),
}


class NonAbsorbedMLA(GatedMLA):
    """GatedMLA's weights and cache, the non-absorbed attention of `spelling`."""

    def __init__(self, config, layer_idx: int, spelling: Spelling = Spelling()):
        super().__init__(config, layer_idx)
        self.spelling = spelling

    def forward(self, x, slots, positions, group=None) -> torch.Tensor:
        s, (B, T, _), H = self.spelling, x.shape, self.num_heads
        N, R, V, C = self.nope, self.rope, self.v_dim, self.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, N + R)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([C, R], dim=-1)
        if s.unsqueezed_rows:
            pos, rows = torch.arange(T, device=x.device) + positions.unsqueeze(1), slots[:, None]
        else:
            pos, rows = positions.view(B, 1) + torch.arange(T, device=x.device), slots.view(B, 1)
        self.kv_cache[rows, pos] = torch.cat([self.kv_a_layernorm(c_kv), k_pe], -1)
        latents, rope = self.kv_cache[slots].split([C, R], dim=-1)  # [B, L, C], [B, L, R]
        L = latents.shape[1]
        k_nope, v = self._up_project(latents, B, L)  # [B, L, H, N], [B, L, H, V]
        if s.sdpa is not None:
            return self._sdpa(x, q, k_nope, rope, v, pos)
        if s.scale_on_q:
            q = q * self.softmax_scale
        if s.scale_nope_only:
            q = torch.cat([q[..., :N] * self.softmax_scale, q[..., N:]], dim=-1)
        if s.fp32_scores or s.fp32_attention:
            q, k_nope, rope = q.float(), k_nope.float(), rope.float()
        if s.fp32_attention:
            v = v.float()
        if s.heads_first:
            scores = self._scores_heads_first(q, k_nope, rope)
        else:
            q_nope, q_pe = q.split([N, R], dim=-1)
            scores = (torch.einsum("bthd,blhd->bhtl", q_nope, k_nope)
                      + torch.einsum("bthr,blr->bhtl", q_pe, rope))
        if not (s.scale_on_q or s.scale_nope_only):
            scores = scores * self.softmax_scale
        future = torch.arange(L, device=x.device).view(1, 1, L) > pos.view(B, T, 1)  # [B, T, L]
        if s.window is not None:
            future = future | (torch.arange(L, device=x.device).view(1, 1, L)
                               <= pos.view(B, T, 1) - s.window)
        if s.additive_mask:
            bias = torch.zeros(B, 1, T, L, dtype=scores.dtype, device=x.device)
            scores = scores + bias.masked_fill(future.unsqueeze(1), float("-inf"))
        else:
            scores = scores.masked_fill(future.unsqueeze(1), float("-inf"))
        if s.fp32_attention:
            p = F.softmax(scores, dim=-1)
        elif s.softmax_fp32:
            p = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        else:
            p = F.softmax(scores, dim=-1).to(x.dtype)
        if s.heads_first:
            o = torch.matmul(p, v.transpose(1, 2)).transpose(1, 2)  # [B, T, H, V]
        else:
            o = torch.einsum("bhtl,blhv->bthv", p, v)
        o = o.reshape(B, T, H * V)
        if s.fp32_attention:
            return self.o_proj((o * torch.sigmoid(self.g_proj(x).float())).to(x.dtype))
        o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _sdpa(self, x, q, k_nope, rope, v, pos):
        s, (B, T, H, _), L = self.spelling, q.shape, k_nope.shape[1]
        k = torch.cat([k_nope, rope.unsqueeze(2).expand(-1, -1, H, -1)], -1)  # [B, L, H, N + R]
        visible = torch.arange(L, device=x.device).view(1, 1, L) <= pos.view(B, T, 1)
        if s.window is not None:
            visible = visible & (torch.arange(L, device=x.device).view(1, 1, L)
                                 > pos.view(B, T, 1) - s.window)
        mask = visible.unsqueeze(1)  # [B, 1, T, L]
        if s.sdpa == "bias":
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=x.device) \
                .masked_fill(~mask, float("-inf"))
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=None if s.sdpa == "causal" else mask, is_causal=s.sdpa == "causal",
            dropout_p=s.dropout, scale=s.sdpa_scale)  # [B, H, T, V]
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _up_project(self, latents, B, L):
        H, N, V = self.num_heads, self.nope, self.v_dim
        if self.spelling.weight_views:
            w_kc, w_vc = self.kv_b_proj.weight.view(H, N + V, -1).split([N, V], dim=1)
            return (torch.einsum("blc,hdc->blhd", latents, w_kc),
                    torch.einsum("blc,hvc->blhv", latents, w_vc))
        kv = self.kv_b_proj(latents).view(B, L, H, N + V)
        return kv.split([N, V], dim=-1)

    def _scores_heads_first(self, q, k_nope, rope):
        H, N = self.num_heads, self.nope
        q = q.transpose(1, 2)  # [B, H, T, N + R]
        k_nope = k_nope.transpose(1, 2)  # [B, H, L, N]
        k_pe = rope.unsqueeze(1).expand(-1, H, -1, -1)  # [B, H, L, R]
        if self.spelling.cat_rope:
            return torch.matmul(q, torch.cat([k_nope, k_pe], dim=-1).transpose(-1, -2))
        q_nope, q_pe = q.split([N, q.shape[-1] - N], dim=-1)
        return (torch.matmul(q_nope, k_nope.transpose(-1, -2))
                + torch.matmul(q_pe, k_pe.transpose(-1, -2)))


def non_absorbed(reference: GatedMLA, config, spelling: Spelling) -> NonAbsorbedMLA:
    """A NonAbsorbedMLA of `config` with `reference`'s weights and a copy of its cache."""
    m = NonAbsorbedMLA(config, reference.layer_idx, spelling)
    m.load_state_dict(reference.state_dict())
    m = m.to(reference.q_a_proj.weight.dtype).requires_grad_(False)
    m.register_buffer("kv_cache", reference.kv_cache.clone(), persistent=False)
    return m


class CachedMHA(nn.Module):
    """Ordinary multi-head attention over a K/V cache [slots, max_len, H·D] (3-D and written
    with the same index assignment as the latent cache): the look-alike whose K/V are no
    projection of latents."""

    def __init__(self, hidden: int, heads: int, head_dim: int, slots: int, max_len: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(hidden, 3 * heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        for name in ("k_cache", "v_cache"):
            self.register_buffer(name, torch.zeros(slots, max_len, heads * head_dim),
                                 persistent=False)

    def forward(self, x, positions, slots):
        (B, T, _), H, D = x.shape, self.heads, self.head_dim
        q, k, v = self.qkv(x).split(H * D, dim=-1)
        pos = positions.view(B, 1) + torch.arange(T, device=x.device)
        self.k_cache[slots.view(B, 1), pos] = k
        self.v_cache[slots.view(B, 1), pos] = v
        L = self.k_cache.shape[1]
        q = q.view(B, T, H, D)
        keys = self.k_cache[slots].view(B, L, H, D)
        values = self.v_cache[slots].view(B, L, H, D)
        scores = torch.einsum("bthd,blhd->bhtl", q, keys) * D ** -0.5
        future = torch.arange(keys.shape[1]).view(1, 1, -1) > pos.unsqueeze(-1)
        scores = scores.masked_fill(future.unsqueeze(1), float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        o = torch.einsum("bhtl,blhd->bthd", p, values).reshape(B, T, H * D)
        return self.o_proj(o)


@dataclasses.dataclass(frozen=True)
class TokenlessSpelling:
    cat_rope: bool = False  # k = cat(k_nope, k_pe), scores = matmul(k, q[..., None]), else einsums
    # look-alikes the rules must leave alone
    window: int | None = None  # also mask cache rows older than position - window
    mask_ahead: bool = False  # the mask shows one key past the position
    scale_nope_only: bool = False  # the scale on the nope term only
    v_other_slots: bool = False  # v up-projected from the cache read at other slots


TOKENLESS_SPELLINGS = {
    "einsum": TokenlessSpelling(),
    "cat_rope_matmul": TokenlessSpelling(cat_rope=True),
}
TOKENLESS_LOOKALIKES = {
    "sliding_window": TokenlessSpelling(window=4),
    "mask_ahead": TokenlessSpelling(mask_ahead=True),
    "scale_nope_only": TokenlessSpelling(scale_nope_only=True),
    "v_other_slots": TokenlessSpelling(v_other_slots=True),
}


class TokenlessMLA(GatedMLA):
    """GatedMLA's weights and cache, the non-absorbed attention of one token per request on
    [B, X] rows, as vLLM's flattened [num_tokens, D] decode has it: x [B, D], the cache written
    at 1-D (slots, positions), q [B, H, N + R], scores [B, H, L] (rule token_dim, then
    mla_absorb)."""

    def __init__(self, config, layer_idx: int, spelling: TokenlessSpelling = TokenlessSpelling()):
        super().__init__(config, layer_idx)
        self.spelling = spelling

    def forward(self, x, slots, positions) -> torch.Tensor:
        s, B, H = self.spelling, x.shape[0], self.num_heads
        N, R, V, C = self.nope, self.rope, self.v_dim, self.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, H, N + R)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([C, R], dim=-1)
        self.kv_cache[slots, positions] = torch.cat([self.kv_a_layernorm(c_kv), k_pe], -1)
        latents, rope = self.kv_cache[slots].split([C, R], dim=-1)  # [B, L, C], [B, L, R]
        L = latents.shape[1]
        k_nope, v = self.kv_b_proj(latents).view(B, L, H, N + V).split([N, V], dim=-1)
        if s.v_other_slots:
            other = self.kv_cache[slots.flip(0)][..., :C]
            v = self.kv_b_proj(other).view(B, L, H, N + V)[..., N:]
        if s.cat_rope:
            k = torch.cat([k_nope, rope.unsqueeze(2).expand(-1, -1, H, -1)], -1)
            scores = torch.matmul(k.transpose(1, 2), q.unsqueeze(-1)).squeeze(-1)  # [B, H, L]
        else:
            q_nope, q_pe = q.split([N, R], dim=-1)
            nope = torch.einsum("bhd,blhd->bhl", q_nope, k_nope)
            rope_term = torch.einsum("bhr,blr->bhl", q_pe, rope)
            if s.scale_nope_only:
                rope_term = rope_term / self.softmax_scale
            scores = nope + rope_term
        scores = scores * self.softmax_scale
        keys = torch.arange(L, device=x.device).view(1, 1, L)
        last = positions + 1 if s.mask_ahead else positions
        future = keys > last.view(B, 1, 1)
        if s.window is not None:
            future = future | (keys <= positions.view(B, 1, 1) - s.window)
        p = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1, dtype=torch.float32)
        o = torch.einsum("bhl,blhv->bhv", p.to(x.dtype), v).reshape(B, H * V)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))


def tokenless(reference: GatedMLA, config, spelling: TokenlessSpelling) -> TokenlessMLA:
    """A TokenlessMLA of `config` with `reference`'s weights and a copy of its cache."""
    m = TokenlessMLA(config, reference.layer_idx, spelling)
    m.load_state_dict(reference.state_dict())
    m = m.to(reference.q_a_proj.weight.dtype).requires_grad_(False)
    m.register_buffer("kv_cache", reference.kv_cache.clone(), persistent=False)
    return m
