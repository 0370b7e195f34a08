"""Gated MLA already absorbed, as DeepSeek-inference-style code writes it, over our model's latent
cache (rule `mla_absorbed`).

`AbsorbedMLA` holds the same weights and state as `k3compile.models.k3.GatedMLA` and computes the
same absorbed attention (W_UK into q, W_UV after p·c) in the spelling of `Spelling`: q_nope | q_pe
and the cache parts by slicing or by split, W_UK / W_UV as slices or a split of kv_b's weight,
the scale before or after the cast to fp32, the mask by `torch.where` on a [B, T, 1, L]
comparison or by masked_fill, the cache rows at `slots.unsqueeze(1)` or `.view(B, 1)`, the score and p·c products of bf16
tensors or of their fp32 upcasts (rule `mla_upcast`); or the attention by
`F.scaled_dot_product_attention` of [q_lat | q_pe] over one latent "KV head" [c_kv | k_pe] with V
its first C columns and a boolean mask (spell11's, `tests/models/spell11_k3.py`), the head by
`enable_gqa` or broadcast; or the scores by one `baddbmm` of an additive where(visible, 0, -inf)
bias with alpha the scale over [B, T·H, C + R] queries, p·c a `bmm`, the cache written out of
place by `Tensor.put` at flat indices (spell12's, `tests/models/spell12_k3.py`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from k3compile.models.k3 import GatedMLA


@dataclasses.dataclass(frozen=True)
class Spelling:
    sliced: bool = True  # x[..., :N], x[..., N:] for every part, else split
    scale_before_cast: bool = True  # (s * scale).float(), else s.float() * scale
    where_mask: bool = True  # where(visible, s, -inf) [B, T, 1, L], else masked_fill(~visible)
    unsqueezed_rows: bool = True  # slots.unsqueeze(1), positions.unsqueeze(1) + arange
    # the score and p·c products read fp32 upcasts (q_lat.float(), latents.float(); softmax and
    # p·c in fp32, o_lat cast back): a bf16 spelling's (rule mla_upcast)
    upcast: bool = False
    # the attention by SDPA over one latent head (rule sdpa_math reads its math path), the head
    # repeated by enable_gqa, else the keys and values expanded over the query heads
    sdpa: bool = False
    sdpa_gqa: bool = True
    # spell12's (tests/models/spell12_k3.py): the scores one `baddbmm(bias, q, cacheᵀ, alpha=
    # scale)` of an additive where(visible, 0, -inf) bias over [B, T·H, C + R] queries, p·c a bmm
    baddbmm_bias: bool = False
    beta: float = 1.0  # the baddbmm's beta
    # the cache written out of place by `Tensor.put` at flat indices
    # `(slot * L + pos) * (C + R) + arange(C + R)` (spell12's)
    put_write: bool = False
    # look-alikes the rule must leave alone (not the attention the canonical form computes)
    window: int | None = None  # also hide cache rows older than pos - window
    scale_rope_twice: bool = False  # the rope term scaled once more
    mask_ahead: bool = False  # the mask shows one key past each query's position
    pv_other_slots: bool = False  # p·c reads the cache at other slots (slots.flip(0))
    values_offset: bool = False  # SDPA's V the cache's last C columns, not its first
    bias_values: tuple = (0.0, float("-inf"))  # the additive bias where visible, where not
    # kv_b's weight as stored: "flat" [H·(N + V), C] viewed [H, N + V, C] (the checkpoint's),
    # "hnc" a 3-D Parameter [H, N + V, C] (spell13's), "nhc" one [N + V, H, C] read transposed
    kvb: str = "flat"


SPELLINGS = {
    "deepseek_inference": Spelling(),  # the blind spelling's (tests/spellings/blind_k3.py)
    "split_where": Spelling(sliced=False, scale_before_cast=False),
    "sliced_masked_fill": Spelling(where_mask=False, unsqueezed_rows=False),
    "sdpa_gqa": Spelling(sdpa=True),  # spell11's
    "sdpa_broadcast": Spelling(sdpa=True, sdpa_gqa=False, sliced=False, unsqueezed_rows=False),
    "baddbmm_bias": Spelling(baddbmm_bias=True),
    "baddbmm_bias_put": Spelling(baddbmm_bias=True, put_write=True),  # spell12's
}
KVB_3D = Spelling(kvb="hnc")  # spell13's: our graph but for the weight's view to 3-D
UPCAST_SPELLINGS = {
    "upcast_products": Spelling(upcast=True),
    "upcast_split_masked_fill": Spelling(sliced=False, scale_before_cast=False, where_mask=False,
                                         unsqueezed_rows=False, upcast=True),
}
LOOKALIKES = {
    "sliding_window": Spelling(window=4),
    "rope_scaled_twice": Spelling(scale_rope_twice=True),
    "sdpa_values_offset": Spelling(sdpa=True, values_offset=True),
    "sdpa_mask_ahead": Spelling(sdpa=True, mask_ahead=True),
    "sdpa_sliding_window": Spelling(sdpa=True, window=4),
    # spell12's baddbmm: a bias of -1e4 (not -inf: rule baddbmm_mask leaves it); -inf one key ahead
    "baddbmm_finite_mask": Spelling(baddbmm_bias=True, bias_values=(0.0, -1e4)),
    "baddbmm_mask_ahead": Spelling(baddbmm_bias=True, mask_ahead=True),
    # kv_b 3-D in another layout, [N + V, H, C] (the same attention: the canonical form would
    # read that weight as [H, N + V, C])
    "kvb_3d_heads_second": Spelling(kvb="nhc"),
}
UPCAST_LOOKALIKES = {
    "upcast_sliding_window": Spelling(window=4, upcast=True),
    "upcast_rope_scaled_twice": Spelling(scale_rope_twice=True, upcast=True),
    "upcast_mask_ahead": Spelling(mask_ahead=True, upcast=True),
    "upcast_pv_other_slots": Spelling(pv_other_slots=True, upcast=True),
    # bf16 SDPA (its math path upcasts q, k and v): the same look-alikes as in fp32
    "sdpa_values_offset_bf16": Spelling(sdpa=True, values_offset=True),
    "sdpa_mask_ahead_bf16": Spelling(sdpa=True, mask_ahead=True),
}


def _parts(x, n: int, dim: int, s: Spelling):
    if s.sliced:
        return x.narrow(dim, 0, n), x.narrow(dim, n, x.shape[dim] - n)
    return x.split([n, x.shape[dim] - n], dim=dim)


class AbsorbedMLA(GatedMLA):
    """GatedMLA's weights and cache, the absorbed attention in `spelling`."""

    def __init__(self, config, layer_idx: int, spelling: Spelling = Spelling()):
        super().__init__(config, layer_idx)
        self.spelling = spelling

    def forward(self, x, slots, positions, group=None) -> torch.Tensor:
        s, (B, T, _), H = self.spelling, x.shape, self.num_heads
        N, R, V, C = self.nope, self.rope, self.v_dim, self.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, N + R)
        q_nope, q_pe = _parts(q, N, -1, s)
        c_kv, k_pe = _parts(self.kv_a_proj_with_mqa(x), C, -1, s)
        if s.unsqueezed_rows:
            pos, rows = positions.unsqueeze(1) + torch.arange(T), slots.unsqueeze(1)
        else:
            pos, rows = positions.view(B, 1) + torch.arange(T), slots.view(B, 1)
        row = torch.cat([self.kv_a_layernorm(c_kv), k_pe], -1)
        if s.put_write:
            L, W = self.kv_cache.shape[1:]
            flat = (rows * L + pos)[..., None] * W + torch.arange(W)
            new = self.kv_cache.put(flat, row)
            cache = new[slots]
            self.kv_cache.copy_(new)
        else:
            self.kv_cache[rows, pos] = row
            cache = self.kv_cache[slots]
        w_uk, w_uv = _parts(self._kv_b(), N, 1, s)
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)
        if s.sdpa:
            return self.o_proj(self._sdpa(q_lat, q_pe, cache, pos, w_uv) * torch.sigmoid(
                self.g_proj(x)))
        if s.baddbmm_bias:
            return self.o_proj(self._baddbmm(q_lat, q_pe, cache, pos, w_uv) * torch.sigmoid(
                self.g_proj(x)))
        latents, rope = _parts(cache, C, -1, s)
        up = (lambda t: t.float()) if s.upcast else (lambda t: t)
        rope_term = torch.einsum("bthr,blr->bthl", up(q_pe), up(rope))
        if s.scale_rope_twice:
            rope_term = rope_term * self.softmax_scale
        scores = torch.einsum("bthc,blc->bthl", up(q_lat), up(latents)) + rope_term
        if s.scale_before_cast:
            scores = (scores * self.softmax_scale).float()
        else:
            scores = scores.float() * self.softmax_scale
        keys = torch.arange(cache.shape[1])
        last = pos + 1 if s.mask_ahead else pos
        visible = keys.view(1, 1, 1, -1) <= last.view(B, T, 1, 1)
        if s.window is not None:
            visible = visible & (keys.view(1, 1, 1, -1) > pos.view(B, T, 1, 1) - s.window)
        if s.where_mask:
            scores = torch.where(visible, scores, torch.full_like(scores, float("-inf")))
        else:
            scores = scores.masked_fill(~visible, float("-inf"))
        p = scores.softmax(dim=-1)
        p = p if s.upcast else p.to(x.dtype)
        values = self.kv_cache[slots.flip(0)] if s.pv_other_slots else cache
        o_lat = torch.einsum("bthl,blc->bthc", p, up(_parts(values, C, -1, s)[0])).to(x.dtype)
        o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * V)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))

    def _kv_b(self) -> torch.Tensor:
        """kv_b's weight [H, N + V, C], read from the layout the spelling stores it in."""
        if self.spelling.kvb == "hnc":
            return self.kv_b
        if self.spelling.kvb == "nhc":
            return self.kv_b.transpose(0, 1)
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, -1)

    def _baddbmm(self, q_lat, q_pe, cache, pos, w_uv):
        """o [B, T, H·V] as spell12 writes it: scores = baddbmm(bias, q, cacheᵀ, alpha=scale)
        over [B, T·H, C + R] queries, the bias where(visible, 0, -inf) over [B, T·H, L]."""
        s, (B, T, H, _), C = self.spelling, q_lat.shape, self.kv_lora_rank
        L = cache.shape[1]
        visible = torch.arange(L) <= (pos + 1 if s.mask_ahead else pos)[..., None]  # [B, T, L]
        bias = torch.where(visible, *s.bias_values).to(q_lat.dtype)
        bias = bias[:, :, None, :].expand(B, T, H, L).reshape(B, T * H, L)
        qm = torch.cat([q_lat, q_pe], -1).reshape(B, T * H, -1)
        scores = torch.baddbmm(bias, qm, cache.transpose(1, 2), beta=s.beta,
                               alpha=self.softmax_scale)
        p = scores.float().softmax(-1).to(q_lat.dtype)
        o_lat = torch.bmm(p, cache[..., :C]).unflatten(1, (T, H))  # [B, T, H, C]
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv).flatten(-2)

    def _sdpa(self, q_lat, q_pe, cache, pos, w_uv):
        """o [B, T, H·V] by SDPA of [q_lat | q_pe] over the cache as one latent head."""
        s, (B, T, H, _), C, R = self.spelling, q_lat.shape, self.kv_lora_rank, self.rope
        query = torch.cat([q_lat, q_pe], -1).transpose(1, 2)  # [B, H, T, C + R]
        keys = cache.unsqueeze(1)  # [B, 1, L, C + R]
        values = keys[..., R:] if s.values_offset else keys[..., :C]
        column = torch.arange(cache.shape[1])
        mask = column <= (pos + 1 if s.mask_ahead else pos)[:, None, :, None]  # [B, 1, T, L]
        if s.window is not None:
            mask = mask & (column > (pos - s.window)[:, None, :, None])
        if not s.sdpa_gqa:
            keys, values = keys.expand(-1, H, -1, -1), values.expand(-1, H, -1, -1)
        o_lat = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                               scale=self.softmax_scale, enable_gqa=s.sdpa_gqa)
        return torch.einsum("bhtc,hvc->bthv", o_lat, w_uv).reshape(B, T, -1)


def absorbed(reference: GatedMLA, config, spelling: Spelling) -> AbsorbedMLA:
    """An AbsorbedMLA of `config` with `reference`'s weights and a copy of its cache."""
    m = AbsorbedMLA(config, reference.layer_idx, spelling)
    m.load_state_dict(reference.state_dict())
    m = m.to(reference.q_a_proj.weight.dtype).requires_grad_(False)
    m.register_buffer("kv_cache", reference.kv_cache.clone(), persistent=False)
    if spelling.kvb != "flat":  # kv_b a 3-D Parameter of its own (kv_b_proj then unread)
        w = m.kv_b_proj.weight.view(m.num_heads, m.nope + m.v_dim, -1)
        w = w if spelling.kvb == "hnc" else w.transpose(0, 1)
        m.kv_b = torch.nn.Parameter(w.contiguous(), requires_grad=False)
    return m
