"""Kimi K3 decode written a tenth time, blind, as a port into a serving engine's model file
(spell10), from `../shared/k3_arch.md` §2-3 alone.

Written without reading `k3compile/models/k3.py`, `k3compile/math.py`, `patterns/`,
`k3compile/canonical/` or the other spellings' code. Taken from outside the spec: the harness
(`tests/spellings/foreign.py`, `tests/e2e/test_spell5_spelling.py`): the decode-step interface
`model(input_ids [B] or [B, T], positions [B], slots [B]) -> logits [B, (T,) V]`, state per slot
(the last slot the scratch slot); the built-in model's state-dict and buffer names and shapes
(printed); README's MXFP4 conventions (low nibble first, `2^(s - 127)`); the idiom lists of
spell5-9 and the red-team spelling (docstrings only, to pick different ones). Single rank.

Idioms: a port into a vLLM / SGLang-style model file, by someone who thinks in flat token
batches, in-place buffers and CUDA-graph-safe static shapes.

* **flat tokens and a metadata object**: every layer takes `hidden [N, D]` (N = B*T) and a
  `DecodeMetadata` dataclass built once per step (`positions [N]`, `slot_mapping [N]` = a flat
  row of the MLA cache, `req_state_idx [B]` = each request's state row, `num_reqs`, `rows`);
  only the KDA recurrence and conv view tokens per request.
* merged projections as a serving loader packs them: KDA `qkv_proj` (q|k|v) beside separate
  `g_proj`, `f_a_proj`, `b_proj`; MLA `fused_qkv_a_proj` (q_a|kv_a); `gate_up_proj` for the dense
  MLP and the shared experts; routed experts **w13** (gate|up) per expert. All applied with
  `F.linear` and cut with `.split([...], dim=-1)`.
* residual stream in place: the AttnRes prefix carried with `prefix.add_(delta)`; in-place
  activations (`sigmoid_`, `mul_`) on temporaries; the step stays functional from the caller's
  view (its only writes are the declared state buffers).
* `RMSNorm` a module with `forward(x, residual=None) -> (normed, residual)` (vLLM's fused
  add + norm signature; fp32 upcast inside only, cast back, then `* weight`), reused for every
  norm: input / post-attention / final, MLA low-rank (eps 1e-6), the KDA head norm, the latent
  MoE norm (on its fp32 sum), the AttnRes source norms (weight `w_norm`, score by `F.linear`
  against the pseudo-query).
* AttnRes: the depth bank a Python list of [N, D] tensors appended at block boundaries and
  `torch.stack`ed on dim 1 with the prefix when read ([N, S, D]); softmax over the sources in
  fp32; the mix `torch.einsum("ns,nsd->nd")` in fp32; n = 0 skipped (identity).
* KDA: the short conv as vLLM's `causal_conv1d_update` reference, **one token at a time**:
  the conv state channel-major [slots, 3W, K-1], the taps one [3W, K] tensor (vLLM's squeezed
  conv weight), per token `window = cat(state, x_t[..., None])`, `(window * taps).sum(-1)`,
  `F.silu`, `state = window[..., 1:]`; the state written back with `index_copy_`; l2 norm
  `x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)`, q's d^-1/2 folded into the same
  multiply; decay `exp(-5 * sigmoid_(exp(A_log) * (g + dt_bias)))`; beta
  `F.logsigmoid(b).exp()`; the recurrent state **K-major** [slots, H, K, V] fp32 read with
  `index_select`, the delta rule per token in einsum strings without ellipsis
  (`"bhk,bhkv->bhv"`, `"bhk,bhv->bhkv"`) with the decay `mul_` in place and the rank-1 write
  `add_`, written back with `index_copy_`; gated head norm `RMSNorm` times `sigmoid(g)`.
* Gated MLA, absorbed: W_UK / W_UV as einsums against `kv_b_proj.weight.view(H, nope + v, C)`
  (`"nhd,hdc->nhc"`, `"nhc,hvc->nhv"`); the cache row `cat(c_kv, k_pe)` written
  **`flat_cache[slot_mapping] = row`** on `kv_cache.view(-1, C + R)`; each token's request block
  read with `kv_cache.index_select(0, req_idx)`; `cat(q_lat, q_pe)` scored with one einsum,
  scaled in fp32, future rows masked in place (`masked_fill_`), `softmax(dtype=float32)`; the
  gate applied in place (`o.mul_(sigmoid(g))`).
* LatentMoE: router `F.linear` in fp32, `sigmoid`, `torch.topk` of the biased scores,
  `gather` of the unbiased ones, renormalised; experts dispatched with static shapes by
  **gathering the k experts' packed w13 / w2 per token** (`w13_packed[topk_ids]`, [N, k, 2I,
  L/2]); MXFP4 decoded by `torch.stack((p & 0xF, p >> 4), -1)` nibbles into a 16-entry fp32
  LUT (`lut[idx]`) and the E8M0 scale `torch.exp2(s - 127)` on 32-blocks; expert GEMMs as
  einsums `"nl,nkil->nki"` / `"nki,nkli->nkl"`, gate|up cut with `.split`; the finalize an
  fp32 `scatter_add_` of the weighted (token, slot) rows into their token ids.
* SiTU-GLU in fp32: `tanh(g / b1).mul_(b1).mul_(sigmoid(g))` times `tanh(u / b2).mul_(b2)`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

# idioms `Spell10K3.set_probe` can switch to another spelling of the same math (added after the
# blind commit, to bisect lost fusions; all off is the blind spelling)
PROBES = ("conv1d", "beta_sigmoid", "delta_out_of_place", "decay_per_head", "q_scale_after",
          "moe_index_add", "moe_weighted_sum", "lut_take", "w13_split", "nibble_cat",
          "situ_functional", "situ_chunk_first", "kda_split_rows",
          "kda_split_int", "kda_o_rows", "kda_cast_pieces")


def probed(module: nn.Module, name: str) -> bool:
    return name in getattr(module, "probes", ())


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclasses.dataclass
class DecodeMetadata:
    num_reqs: int
    rows: int                  # tokens per request (1: decode, T: verify rows)
    positions: torch.Tensor    # [N] position of each token
    req_state_idx: torch.Tensor  # [B] each request's state row
    token_req_idx: torch.Tensor  # [N] each token's request state row
    slot_mapping: torch.Tensor   # [N] flat MLA cache row of each token
    max_len: int


def situ_and_mul(gate_up: torch.Tensor, b1: float, b2: float, probes=()) -> torch.Tensor:
    if "situ_chunk_first" in probes:
        g, u = (t.float() for t in gate_up.chunk(2, dim=-1))
    else:
        g, u = gate_up.float().chunk(2, dim=-1)
    functional = "situ_functional" in probes
    if functional:
        return (b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))).to(
            gate_up.dtype)
    act = torch.tanh(g / b1).mul_(b1).mul_(torch.sigmoid(g))
    return act.mul_(torch.tanh(u / b2).mul_(b2)).to(gate_up.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x.add_(residual)
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = xf.to(x.dtype) * self.weight
        return out if residual is None else (out, residual)


class AttnRes(nn.Module):
    """softmax over depth of the raw sources, scored by RMS-normalised source . pseudo-query."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.proj = nn.Parameter(torch.zeros(1, dim))

    def forward(self, prefix: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        if not bank:
            return prefix
        src = torch.stack(bank + [prefix], dim=1).float()  # [N, S, D]
        xf = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        score = F.linear(xf * self.norm.weight.float(), self.proj.float()).squeeze(-1)
        alpha = torch.softmax(score, dim=-1)
        return torch.einsum("ns,nsd->nd", alpha, src).to(prefix.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg, slots: int, dtype):
        super().__init__()
        d, h, dk = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        w, k = h * dk, cfg.short_conv_kernel_size
        self.h, self.dk, self.w, self.k = h, dk, w, k
        self.l2_eps, self.bound = cfg.l2norm_eps, cfg.gate_lower_bound
        self.qkv_proj = nn.Parameter(torch.empty(3 * w, d))
        self.g_proj = nn.Parameter(torch.empty(w, d))
        self.f_a_proj = nn.Parameter(torch.empty(cfg.kda_head_dim, d))
        self.f_b_proj = nn.Parameter(torch.empty(w, cfg.kda_head_dim))
        self.b_proj = nn.Parameter(torch.empty(h, d))
        self.conv1d = nn.Parameter(torch.empty(3 * w, k))
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(w, dtype=torch.float32))
        self.o_norm = RMSNorm(dk, cfg.rms_norm_eps)
        self.o_proj = nn.Parameter(torch.empty(d, w))
        self.register_buffer("conv_state", torch.zeros(slots, 3 * w, k - 1, dtype=dtype))
        self.register_buffer("ssm_state", torch.zeros(slots, h, dk, dk, dtype=torch.float32))

    def _conv_update(self, x: torch.Tensor, md: DecodeMetadata) -> torch.Tensor:
        """causal_conv1d_update: x [B, T, 3W] -> SiLU(conv) [B, T, 3W], token by token."""
        state = self.conv_state.index_select(0, md.req_state_idx)  # [B, 3W, K-1]
        if probed(self, "conv1d"):
            window = torch.cat([state, x.transpose(1, 2)], dim=-1)  # [B, 3W, K-1+T]
            self.conv_state.index_copy_(0, md.req_state_idx, window[:, :, md.rows:])
            y = F.conv1d(window, self.conv1d[:, None, :], groups=3 * self.w)
            return F.silu(y).transpose(1, 2)
        outs = []
        for t in range(md.rows):
            window = torch.cat([state, x[:, t, :, None]], dim=-1)  # [B, 3W, K]
            outs.append(F.silu((window * self.conv1d).sum(-1)))
            state = window[:, :, 1:]
        self.conv_state.index_copy_(0, md.req_state_idx, state)
        return torch.stack(outs, dim=1)

    def forward(self, hidden: torch.Tensor, md: DecodeMetadata) -> torch.Tensor:
        b, t, h, dk = md.num_reqs, md.rows, self.h, self.dk
        qkv = F.linear(hidden, self.qkv_proj)
        g2 = F.linear(hidden, self.g_proj)
        graw = F.linear(F.linear(hidden, self.f_a_proj), self.f_b_proj)
        beta = F.logsigmoid(F.linear(hidden, self.b_proj).float()).exp()  # [N, H]
        if probed(self, "beta_sigmoid"):
            beta = torch.sigmoid(F.linear(hidden, self.b_proj).float())

        qkv = self._conv_update(qkv.view(b, t, 3 * self.w), md)
        if not probed(self, "kda_split_rows"):
            qkv = qkv.view(b * t, 3 * self.w)
        if probed(self, "kda_cast_pieces"):
            cut = self.w if probed(self, "kda_split_int") else [self.w, self.w, self.w]
            q, k, v = (x.float() for x in qkv.split(cut, dim=-1))
        elif probed(self, "kda_split_int"):
            q, k, v = qkv.float().split(self.w, dim=-1)
        else:
            q, k, v = qkv.float().split([self.w, self.w, self.w], dim=-1)
        q = q.view(b, t, h, dk)
        k = k.view(b, t, h, dk)
        v = v.view(b, t, h, dk)
        if probed(self, "q_scale_after"):
            q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + self.l2_eps) * dk ** -0.5
        else:
            q = q * (torch.rsqrt(q.square().sum(-1, keepdim=True) + self.l2_eps) * dk ** -0.5)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + self.l2_eps)
        z = torch.exp(self.A_log).repeat_interleave(dk) * (graw.float() + self.dt_bias)
        alpha = torch.exp(z.sigmoid_().mul_(self.bound))
        alpha = alpha.view(b, t, h, dk)
        if probed(self, "decay_per_head"):
            zh = torch.exp(self.A_log)[:, None] * (graw.float().view(b, t, h, dk)
                                                   + self.dt_bias.view(h, dk))
            alpha = torch.exp(self.bound * torch.sigmoid(zh))
        beta = beta.view(b, t, h)

        s = self.ssm_state.index_select(0, md.req_state_idx)  # [B, H, K, V] fp32
        outs = []
        for i in range(t):
            if probed(self, "delta_out_of_place"):
                s = s * alpha[:, i, :, :, None]
            else:
                s.mul_(alpha[:, i, :, :, None])
            kv_old = torch.einsum("bhk,bhkv->bhv", k[:, i], s)
            u = (v[:, i] - kv_old) * beta[:, i, :, None]
            if probed(self, "delta_out_of_place"):
                s = s + torch.einsum("bhk,bhv->bhkv", k[:, i], u)
            else:
                s.add_(torch.einsum("bhk,bhv->bhkv", k[:, i], u))
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], s))
        self.ssm_state.index_copy_(0, md.req_state_idx, s)

        if probed(self, "kda_o_rows"):
            o = torch.stack(outs, dim=1).to(hidden.dtype)
            o = self.o_norm(o) * torch.sigmoid(g2.view(b, t, h, dk))
            return F.linear(o.reshape(b * t, self.w), self.o_proj)
        o = torch.stack(outs, dim=1).reshape(b * t, h, dk).to(hidden.dtype)
        o = self.o_norm(o) * torch.sigmoid(g2.view(b * t, h, dk))
        return F.linear(o.reshape(b * t, self.w), self.o_proj)


class GatedMLA(nn.Module):
    def __init__(self, cfg, slots: int, max_len: int, dtype):
        super().__init__()
        d, self.h = cfg.hidden_size, cfg.num_attention_heads
        self.q_lora, self.c, self.r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope, self.v = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.fused_qkv_a_proj = nn.Parameter(torch.empty(self.q_lora + self.c + self.r, d))
        self.q_a_layernorm = RMSNorm(self.q_lora, cfg.mla_norm_eps)
        self.kv_a_layernorm = RMSNorm(self.c, cfg.mla_norm_eps)
        self.q_b_proj = nn.Parameter(torch.empty(self.h * (self.nope + self.r), self.q_lora))
        self.kv_b_proj = nn.Parameter(torch.empty(self.h * (self.nope + self.v), self.c))
        self.g_proj = nn.Parameter(torch.empty(self.h * self.v, d))
        self.o_proj = nn.Parameter(torch.empty(d, self.h * self.v))
        self.scale = (self.nope + self.r) ** -0.5
        self.register_buffer("kv_cache", torch.zeros(slots, max_len, self.c + self.r, dtype=dtype))

    def forward(self, hidden: torch.Tensor, md: DecodeMetadata) -> torch.Tensor:
        n, h, c = hidden.shape[0], self.h, self.c
        cq, ckv, k_pe = F.linear(hidden, self.fused_qkv_a_proj).split(
            [self.q_lora, c, self.r], dim=-1)
        cq = self.q_a_layernorm(cq)
        c_kv = self.kv_a_layernorm(ckv)
        q = F.linear(cq, self.q_b_proj).view(n, h, self.nope + self.r)
        q_nope, q_pe = q.split([self.nope, self.r], dim=-1)
        g = F.linear(hidden, self.g_proj)

        w_kvb = self.kv_b_proj.view(h, self.nope + self.v, c)
        w_uk, w_uv = w_kvb.split([self.nope, self.v], dim=1)
        q_lat = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)

        self.kv_cache.view(-1, c + self.r)[md.slot_mapping] = torch.cat([c_kv, k_pe], dim=-1)
        rows = self.kv_cache.index_select(0, md.token_req_idx)  # [N, L, C + R]
        q_mqa = torch.cat([q_lat, q_pe], dim=-1)
        scores = torch.einsum("nhr,nlr->nhl", q_mqa, rows).float() * self.scale
        future = torch.arange(md.max_len, device=hidden.device)[None, :] > md.positions[:, None]
        scores.masked_fill_(future[:, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(hidden.dtype)
        o_lat = torch.einsum("nhl,nlc->nhc", p, rows[:, :, :c])
        o = torch.einsum("nhc,hvc->nhv", o_lat, w_uv).reshape(n, h * self.v)
        o.mul_(torch.sigmoid(g))
        return F.linear(o, self.o_proj)


class DenseMLP(nn.Module):
    def __init__(self, d: int, inter: int, cfg):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, d))
        self.down_proj = nn.Parameter(torch.empty(d, inter))
        self.b1, self.b2 = cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, x):
        act = situ_and_mul(F.linear(x, self.gate_up_proj), self.b1, self.b2,
                           getattr(self, "probes", ()))
        return F.linear(act, self.down_proj)


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor, lut: torch.Tensor,
                 probes=()) -> torch.Tensor:
    """[..., out, in/2] uint8 codes + [..., out, in/32] E8M0 -> [..., out, in] fp32."""
    if "nibble_cat" in probes:
        pair = torch.cat([(packed & 15).unsqueeze(-1), (packed >> 4).unsqueeze(-1)], -1)
        idx = pair.view(*packed.shape[:-1], 2 * packed.shape[-1]).long()
    else:
        idx = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    vals = torch.take(lut, idx) if "lut_take" in probes else lut[idx]
    vals = vals.unflatten(-1, (scale.shape[-1], 32)) * torch.exp2(scale.float() - 127)[..., None]
    return vals.flatten(-2)


class LatentMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, e, lat, inter = (cfg.hidden_size, cfg.num_experts, cfg.routed_expert_hidden_size,
                            cfg.moe_intermediate_size)
        self.top_k, self.inter, self.scaling = (cfg.num_experts_per_token, inter,
                                                cfg.routed_scaling_factor)
        self.gate = nn.Parameter(torch.empty(e, d))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.latent_down_proj = nn.Parameter(torch.empty(lat, d))
        self.latent_norm = RMSNorm(lat, cfg.rms_norm_eps)
        self.latent_up_proj = nn.Parameter(torch.empty(d, lat))
        self.register_buffer("w13_packed", torch.zeros(e, 2 * inter, lat // 2, dtype=torch.uint8))
        self.register_buffer("w13_scale", torch.zeros(e, 2 * inter, lat // 32, dtype=torch.uint8))
        self.register_buffer("w2_packed", torch.zeros(e, lat, inter // 2, dtype=torch.uint8))
        self.register_buffer("w2_scale", torch.zeros(e, lat, inter // 32, dtype=torch.uint8))
        self.register_buffer("lut", torch.tensor(E2M1, dtype=torch.float32))
        shared = cfg.num_shared_experts * inter
        self.shared_experts = DenseMLP(d, shared, cfg)
        self.b1, self.b2 = cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = x.shape[0], self.top_k
        scores = torch.sigmoid(F.linear(x.float(), self.gate.float()))
        _, topk_ids = torch.topk(scores + self.e_score_correction_bias, k, dim=-1)
        topk_w = scores.gather(1, topk_ids)
        topk_w = topk_w / (topk_w.sum(-1, keepdim=True) + 1e-20) * self.scaling

        z = F.linear(x, self.latent_down_proj)  # [N, L]
        probes = getattr(self, "probes", ())
        w13 = mxfp4_decode(self.w13_packed[topk_ids], self.w13_scale[topk_ids], self.lut, probes)
        w2 = mxfp4_decode(self.w2_packed[topk_ids], self.w2_scale[topk_ids], self.lut, probes)
        if "w13_split" in probes:
            w1, w3 = w13.to(x.dtype).split([self.inter, self.inter], dim=2)
            gate_up = torch.cat([torch.einsum("nl,nkil->nki", z, w1),
                                 torch.einsum("nl,nkil->nki", z, w3)], dim=-1)
        else:
            gate_up = torch.einsum("nl,nkil->nki", z, w13.to(x.dtype))
        act = situ_and_mul(gate_up, self.b1, self.b2, probes)
        y = torch.einsum("nki,nkli->nkl", act, w2.to(x.dtype))  # [N, k, L]

        lat = y.shape[-1]
        rows = (y.float() * topk_w[:, :, None]).view(n * k, lat)
        tok = torch.arange(n, device=x.device).repeat_interleave(k)
        u = torch.zeros(n, lat, dtype=torch.float32, device=x.device)
        if "moe_weighted_sum" in probes:
            u = (y.float() * topk_w[:, :, None]).sum(1)
        elif "moe_index_add" in probes:
            u.index_add_(0, tok, rows)
        else:
            u.scatter_add_(0, tok[:, None].expand(n * k, lat), rows)
        routed = F.linear(self.latent_norm(u).to(x.dtype), self.latent_up_proj)
        return routed.add_(self.shared_experts(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, i: int, slots: int, max_len: int, dtype):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.is_mla = i in cfg.full_attn_layers
        self.self_attn = (GatedMLA(cfg, slots, max_len, dtype) if self.is_mla
                          else KimiDeltaAttention(cfg, slots, dtype))
        self.mlp = (DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg)
                    if i < cfg.first_k_dense_replace else LatentMoE(cfg))
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_attn_res = AttnRes(cfg.hidden_size, eps)
        self.pre_mlp_res = AttnRes(cfg.hidden_size, eps)
        self.block_start = i % cfg.attn_res_block_size == 0

    def forward(self, prefix, delta, bank, md):
        if delta is not None:
            prefix.add_(delta)
        if self.block_start:
            bank.append(prefix)
        h = self.pre_attn_res(prefix, bank[:-1] if self.block_start else bank)
        a = self.self_attn(self.input_layernorm(h), md)
        if self.block_start:
            prefix = a
        else:
            prefix.add_(a)
        h2 = self.pre_mlp_res(prefix, bank)
        return prefix, self.mlp(self.post_attention_layernorm(h2))


class Spell10K3(nn.Module):
    def __init__(self, cfg, max_batch: int = 4, max_seq_len: int = 64, dtype=torch.float32):
        super().__init__()
        self.cfg, self.max_len = cfg, max_seq_len
        slots = max_batch + 1  # the last row is the scratch slot
        eps = cfg.rms_norm_eps
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, slots, max_seq_len, dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.final_res = AttnRes(cfg.hidden_size, eps)
        self.norm = RMSNorm(cfg.hidden_size, eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def set_probe(self, *names: str) -> Spell10K3:
        """Switch the named idioms (PROBES) to another spelling of the same math."""
        assert set(names) <= set(PROBES), names
        for m in self.modules():
            m.probes = frozenset(names)
        return self

    def metadata(self, input_ids, positions, slots) -> DecodeMetadata:
        b = input_ids.shape[0]
        t = input_ids.shape[1] if input_ids.dim() == 2 else 1
        offs = torch.arange(t, device=input_ids.device)
        pos = (positions[:, None] + offs[None, :]).reshape(-1)
        tok_req = slots.repeat_interleave(t)
        return DecodeMetadata(b, t, pos, slots, tok_req, tok_req * self.max_len + pos,
                              self.max_len)

    def forward(self, input_ids, positions, slots):
        md = self.metadata(input_ids, positions, slots)
        prefix = F.embedding(input_ids.reshape(-1), self.embed_tokens)
        delta, bank = None, []
        for layer in self.layers:
            prefix, delta = layer(prefix, delta, bank, md)
        prefix.add_(delta)
        h = self.final_res(prefix, bank)
        logits = F.linear(self.norm(h), self.lm_head)
        return logits.view(*input_ids.shape, -1)


# --- loading from the built-in model ------------------------------------------------------

def from_builtin(model) -> Spell10K3:
    """A Spell10K3 holding `model`'s (k3compile.models.build_model) weights and states."""
    cfg = model.config if hasattr(model, "config") else model.cfg
    sd = {**model.state_dict(), **dict(model.named_buffers())}
    conv = sd["language_model.model.layers.0.self_attn.conv_state"]
    dtype = sd["language_model.model.embed_tokens.weight"].dtype
    max_len = next(v.shape[1] for n, v in sd.items() if n.endswith("kv_cache"))
    ours = Spell10K3(cfg, max_batch=conv.shape[0] - 1, max_seq_len=max_len, dtype=dtype)
    new = {}
    p = "language_model.model."
    new["embed_tokens"] = sd[p + "embed_tokens.weight"]
    new["lm_head"] = sd["language_model.lm_head.weight"]
    new["norm.weight"] = sd[p + "norm.weight"]
    new["final_res.norm.weight"] = sd[p + "output_attn_res_norm.weight"]
    new["final_res.proj"] = sd[p + "output_attn_res_proj.weight"]
    for i, layer in enumerate(ours.layers):
        s, o = f"{p}layers.{i}.", f"layers.{i}."
        for a, b in (("input_layernorm", "input_layernorm"),
                     ("post_attention_layernorm", "post_attention_layernorm"),
                     ("pre_attn_res.norm", "self_attention_res_norm"),
                     ("pre_mlp_res.norm", "mlp_res_norm")):
            new[o + a + ".weight"] = sd[s + b + ".weight"]
        new[o + "pre_attn_res.proj"] = sd[s + "self_attention_res_proj.weight"]
        new[o + "pre_mlp_res.proj"] = sd[s + "mlp_res_proj.weight"]
        sa, oa = s + "self_attn.", o + "self_attn."
        if layer.is_mla:
            new[oa + "fused_qkv_a_proj"] = torch.cat(
                [sd[sa + "q_a_proj.weight"], sd[sa + "kv_a_proj_with_mqa.weight"]])
            for name in ("q_a_layernorm", "kv_a_layernorm"):
                new[oa + name + ".weight"] = sd[sa + name + ".weight"]
            for name in ("q_b_proj", "kv_b_proj", "g_proj", "o_proj"):
                new[oa + name] = sd[sa + name + ".weight"]
            new[oa + "kv_cache"] = sd[sa + "kv_cache"]
        else:
            new[oa + "qkv_proj"] = torch.cat([sd[sa + f"{x}_proj.weight"] for x in "qkv"])
            for name in ("g_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj"):
                new[oa + name] = sd[sa + name + ".weight"]
            new[oa + "conv1d"] = torch.cat(
                [sd[sa + f"{x}_conv1d.weight"] for x in "qkv"]).squeeze(1)
            new[oa + "A_log"] = sd[sa + "A_log"][: layer.self_attn.h]
            new[oa + "dt_bias"] = sd[sa + "dt_bias"]
            new[oa + "o_norm.weight"] = sd[sa + "o_norm.weight"]
            new[oa + "conv_state"] = sd[sa + "conv_state"]
            new[oa + "ssm_state"] = sd[sa + "recurrent_state"]
        sm, om = s + "mlp.", o + "mlp."
        if isinstance(layer.mlp, DenseMLP):
            new[om + "gate_up_proj"] = torch.cat([sd[sm + "gate_proj.weight"],
                                                  sd[sm + "up_proj.weight"]])
            new[om + "down_proj"] = sd[sm + "down_proj.weight"]
            continue
        new[om + "gate"] = sd[sm + "gate.weight"]
        new[om + "e_score_correction_bias"] = sd[sm + "gate.e_score_correction_bias"]
        new[om + "latent_down_proj"] = sd[sm + "routed_expert_down_proj.weight"]
        new[om + "latent_norm.weight"] = sd[sm + "routed_expert_norm.weight"]
        new[om + "latent_up_proj"] = sd[sm + "routed_expert_up_proj.weight"]
        for part in ("packed", "scale"):
            new[om + f"w13_{part}"] = torch.cat([sd[sm + f"experts.w1_{part}"],
                                                 sd[sm + f"experts.w3_{part}"]], dim=1)
            new[om + f"w2_{part}"] = sd[sm + f"experts.w2_{part}"]
        new[om + "lut"] = layer.mlp.lut
        se = sm + "shared_experts."
        new[om + "shared_experts.gate_up_proj"] = torch.cat([sd[se + "gate_proj.weight"],
                                                             sd[se + "up_proj.weight"]])
        new[om + "shared_experts.down_proj"] = sd[se + "down_proj.weight"]
    ours.load_state_dict({k: v.clone() for k, v in new.items()}, strict=True)
    return _cast(ours, dtype)


def _cast(model: Spell10K3, dtype) -> Spell10K3:
    """Weights in the model dtype, the fp32 parameters (dt_bias, A_log, router bias) kept fp32."""
    keep = ("A_log", "dt_bias", "e_score_correction_bias")
    for name, p in model.named_parameters():
        if not name.endswith(keep):
            p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


def state_of(model: Spell10K3) -> dict[str, torch.Tensor]:
    """The states under the built-in model's buffer names and layouts."""
    out = {}
    for i, layer in enumerate(model.layers):
        name = f"language_model.model.layers.{i}.self_attn."
        if layer.is_mla:
            out[name + "kv_cache"] = layer.self_attn.kv_cache
        else:
            out[name + "conv_state"] = layer.self_attn.conv_state
            out[name + "recurrent_state"] = layer.self_attn.ssm_state
    return out


__all__ = ["DecodeMetadata", "Spell10K3", "from_builtin", "state_of"]
