"""Kimi K3 decode written an eighth time, blind, as a researcher's reference implementation
(spell8), from `../shared/k3_arch.md` §2-3 alone.

Written without reading `k3compile/models/k3.py`, `patterns/`, `k3compile/canonical/`,
`k3compile/math.py` or the other spellings' code. Taken from outside the spec: the harness
(`tests/spellings/foreign.py`, `tests/e2e/test_spell5_spelling.py`): the decode-step interface
`model(input_ids [B] or [B, T], positions [B], slots [B]) -> logits [B, (T,) V]`, state per slot
with the last slot the scratch slot; the built-in model's state-dict and buffer names and shapes
(printed); README's MXFP4 conventions (low nibble first, `2^(s - 127)`). Single rank.

Idioms: readable math first, as a paper's reference code would write it.

* names: `tok_emb`, `blocks.N.{attn, ffn, attn_mix, ffn_mix, attn_norm, ffn_norm}`, `out_mix`,
  `out_norm`, `unembed`; every weight a raw `nn.Parameter`, no `nn.Linear`.
* every projection an `einsum` string (`"...d,od->...o"`), never `F.linear` / `@`.
* fp32 at module boundaries: each module upcasts its nonlinear math with `.float()` and casts its
  result back with `.to(dtype)`; RMSNorm as `x / sqrt(mean(x**2) + eps)` in fp32, cast, then
  `* weight` (the spec's order).
* AttnRes as the paper's formula: the bank a Python list of block outputs; each mix
  `torch.stack`s all sources on a new leading depth dim [S, B, T, D] (recomputed every layer),
  scores `einsum("s...d,d->s...", rmsnormed sources, w_norm * w_proj)`, `softmax(dim=0)` and
  `einsum("s...,s...d->...d", alpha, sources)` in fp32.
* KDA: q, k, v, g, f_a, b as six einsum projections; three separate short convs (one conv state
  per stream, channel-major [slots, W, K-1]) as an einsum over `unfold(-1, K, 1)` of the
  `cat(state, new)` window, then SiLU; the conv states written `state[slots] = ...`; l2 norm as
  `x / sqrt(sum(x*x) + eps)`; decay `exp(-5 * sigmoid(exp(A_log) * (g + dt_bias)))`; the
  recurrence the textbook update per token with explicit outer products (`unsqueeze` products,
  reductions by `.sum`): `S <- alpha * S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q`, the
  state [B, H, K, V] fp32, written back `state[slots] = S`; the gated head norm in fp32.
* Gated MLA NON-absorbed: the latent cache [slots, L, C + R] written `cache[slots, positions]
  = row`, read whole, decompressed into per-head K and V by an einsum with `kv_b` viewed
  [H, nope + v, C]; K = `cat(k_nope, k_pe expanded over heads)`; plain attention over all L
  cached rows with a `masked_fill(-inf)` causal mask, fp32 scores and softmax.
* LatentMoE: fp32 router einsum, sigmoid, `topk` on the biased scores, `gather` of the unbiased
  ones, renormalised; a dense [B, T, E] routing matrix from `F.one_hot(idx) * w`; the experts a
  static Python loop over ALL experts, each computing on the whole batch and weighted by its
  routing column (zero when not chosen): no data-dependent shapes, no graph break; MXFP4
  dequant through a Python-built E2M1 lookup table tensor indexed by nibble codes (`packed >>
  [0, 4] & 0xF`) and the E8M0 scales `2 ** (s - 127)` expanded with `repeat_interleave(32)`.
* SiTU-GLU: `b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2)` in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3compile.models.config import K3Config

# E2M1 code -> value, written out by hand: sign bit, 2 exponent bits, 1 mantissa bit
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_VALUES = E2M1_VALUES + [-v for v in E2M1_VALUES]
GROUP = 32


def param(*shape):
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


# idioms `Spell8K3.set_probe` switches to another spelling of the same math, to bisect a lost
# fusion (docs/spell8_spelling.md): name -> what the probe writes instead
PROBES = {
    "linear": "projections as F.linear instead of einsum strings",
    "rows": "norms, depth mixes and FFNs on [B*T, D] token rows instead of [B, T, D]",
    "mix_sum": "depth-mix scores and mix as broadcast products + sum (weights unfolded), no einsum",
    "one_conv_state": "KDA's q, k, v convolved as one q|k|v conv over one conv state buffer "
                      "[slots, 3W, taps-1] instead of three convs over three buffers",
}
_probes: set[str] = set()


def proj(x, w):
    if "linear" in _probes:
        return F.linear(x, w)
    return torch.einsum("...d,od->...o", x, w)


def rmsnorm(x, w, eps):
    xf = x.float()
    y = xf / torch.sqrt(torch.mean(xf ** 2, dim=-1, keepdim=True) + eps)
    return y.to(x.dtype) * w


def situ(g, u, b1, b2):
    gf, uf = g.float(), u.float()
    return (b1 * torch.tanh(gf / b1) * torch.sigmoid(gf) * (b2 * torch.tanh(uf / b2))).to(g.dtype)


class DepthMix(nn.Module):
    """alpha_i = softmax_i(w_proj . RMSNorm(v_i; w_norm)); out = sum_i alpha_i v_i."""

    def __init__(self, D, eps):
        super().__init__()
        self.w_norm, self.w_proj, self.eps = param(D), param(1, D), eps

    def forward(self, prefix, bank):
        if not bank:
            return prefix
        v = torch.stack(bank + [prefix], dim=0).float()  # [S, B, T, D]
        normed = v / torch.sqrt(torch.mean(v ** 2, dim=-1, keepdim=True) + self.eps)
        if "mix_sum" in _probes:
            scores = (normed * self.w_norm.float() * self.w_proj[0].float()).sum(-1)
            alpha = torch.softmax(scores, dim=0)
            return (alpha.unsqueeze(-1) * v).sum(0).to(prefix.dtype)
        scores = torch.einsum("s...d,d->s...", normed, self.w_norm.float() * self.w_proj[0].float())
        alpha = torch.softmax(scores, dim=0)
        return torch.einsum("s...,s...d->...d", alpha, v).to(prefix.dtype)


class KDA(nn.Module):
    def __init__(self, cfg: K3Config, slots):
        super().__init__()
        D, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        W, R, taps = H * K, K, cfg.short_conv_kernel_size  # f_a has head_dim rows
        self.H, self.K, self.taps, self.cfg = H, K, taps, cfg
        self.wq, self.wk, self.wv, self.wg = param(W, D), param(W, D), param(W, D), param(W, D)
        self.wfa, self.wfb, self.wb = param(R, D), param(W, R), param(H, D)
        self.conv_q, self.conv_k, self.conv_v = param(W, 1, taps), param(W, 1, taps), param(W, 1, taps)
        self.dt_bias, self.A_log, self.o_norm, self.wo = param(W), param(H), param(K), param(D, W)
        for name in ("q", "k", "v"):
            self.register_buffer(f"{name}_conv_state", torch.zeros(slots, W, taps - 1))
        self.register_buffer("qkv_conv_state", torch.zeros(slots, 3 * W, taps - 1))  # the probe's
        self.register_buffer("S", torch.zeros(slots, H, K, K))

    def short_conv(self, x, weight, state, slots):
        """x [B, T, W]; causal depthwise conv over [state | x] then SiLU."""
        T = x.shape[1]
        window = torch.cat([state[slots], x.transpose(1, 2)], dim=-1)  # [B, W, K-1+T]
        y = torch.einsum("bwtk,wk->bwt", window.unfold(-1, self.taps, 1), weight[:, 0])
        state[slots] = window[..., T:]
        return F.silu(y).transpose(1, 2)

    def forward(self, x, slots):
        B, T, _ = x.shape
        H, K, cfg = self.H, self.K, self.cfg
        if "one_conv_state" in _probes:
            qkv = torch.cat([proj(x, w) for w in (self.wq, self.wk, self.wv)], -1)
            taps = torch.cat([self.conv_q, self.conv_k, self.conv_v])
            q, k, v = self.short_conv(qkv, taps, self.qkv_conv_state, slots).split(H * K, -1)
        else:
            q = self.short_conv(proj(x, self.wq), self.conv_q, self.q_conv_state, slots)
            k = self.short_conv(proj(x, self.wk), self.conv_k, self.k_conv_state, slots)
            v = self.short_conv(proj(x, self.wv), self.conv_v, self.v_conv_state, slots)
        gate = proj(x, self.wg)
        graw = proj(proj(x, self.wfa), self.wfb)
        b = proj(x, self.wb)

        q = q.float().view(B, T, H, K)
        k = k.float().view(B, T, H, K)
        v = v.float().view(B, T, H, K)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + cfg.l2norm_eps) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + cfg.l2norm_eps)
        graw = graw.float().view(B, T, H, K) + self.dt_bias.float().view(H, K)
        log_alpha = cfg.gate_lower_bound * torch.sigmoid(torch.exp(self.A_log.float())[:, None] * graw)
        alpha = torch.exp(log_alpha)
        beta = torch.sigmoid(b.float())  # [B, T, H]

        S = self.S[slots]  # [B, H, K, V]
        outs = []
        for t in range(T):
            S = alpha[:, t].unsqueeze(-1) * S
            Sk = (S * k[:, t].unsqueeze(-1)).sum(-2)  # S^T k: [B, H, V]
            u = beta[:, t].unsqueeze(-1) * (v[:, t] - Sk)
            S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)  # k u^T
            outs.append((S * q[:, t].unsqueeze(-1)).sum(-2))  # S^T q
        self.S[slots] = S
        o = torch.stack(outs, dim=1)  # [B, T, H, V]

        o = o / torch.sqrt(torch.mean(o ** 2, dim=-1, keepdim=True) + cfg.rms_norm_eps)
        o = o * self.o_norm.float() * torch.sigmoid(gate.float().view(B, T, H, K))
        return proj(o.reshape(B, T, H * K).to(x.dtype), self.wo)


class GatedMLA(nn.Module):
    def __init__(self, cfg: K3Config, slots, max_len):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.C, self.cfg = H, cfg.kv_lora_rank, cfg
        self.nope, self.rope, self.vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.wqa, self.q_norm = param(cfg.q_lora_rank, D), param(cfg.q_lora_rank)
        self.wqb = param(H * (self.nope + self.rope), cfg.q_lora_rank)
        self.wkva, self.kv_norm = param(self.C + self.rope, D), param(self.C)
        self.wkvb = param(H * (self.nope + self.vd), self.C)
        self.wg, self.wo = param(H * self.vd, D), param(D, H * self.vd)
        self.register_buffer("cache", torch.zeros(slots, max_len, self.C + self.rope))

    def forward(self, x, positions, slots):
        B, T, _ = x.shape
        H, C, nope, rope, vd, cfg = self.H, self.C, self.nope, self.rope, self.vd, self.cfg
        cq = rmsnorm(proj(x, self.wqa), self.q_norm, cfg.mla_norm_eps)
        ckv = proj(x, self.wkva)
        c_kv = rmsnorm(ckv[..., :C], self.kv_norm, cfg.mla_norm_eps)
        k_pe = ckv[..., C:]
        q = proj(cq, self.wqb).view(B, T, H, nope + rope)

        pos = positions[:, None] + torch.arange(T, device=x.device)  # [B, T]
        self.cache[slots[:, None], pos] = torch.cat([c_kv, k_pe], dim=-1)
        lat = self.cache[slots]  # [B, L, C + R]
        L = lat.shape[1]
        kv = torch.einsum("blc,hec->blhe", lat[..., :C], self.wkvb.view(H, nope + vd, C))
        k_nope, v = kv[..., :nope], kv[..., nope:]
        key = torch.cat([k_nope, lat[..., None, C:].expand(B, L, H, rope)], dim=-1)

        scores = torch.einsum("bthd,blhd->bhtl", q.float(), key.float()) / math.sqrt(nope + rope)
        future = torch.arange(L, device=x.device)[None, None, :] > pos[:, :, None]  # [B, T, L]
        scores = scores.masked_fill(future[:, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = torch.einsum("bhtl,blhe->bthe", p, v.float()).reshape(B, T, H * vd)
        o = o * torch.sigmoid(proj(x, self.wg).float())
        return proj(o.to(x.dtype), self.wo)


def mxfp4_dequant(packed, scale, lut):
    """packed uint8 [..., out, in/2] (low nibble first), scale E8M0 uint8 [..., out, in/32]."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., out, in/2, 2]
    values = lut[codes.long()].flatten(-2)  # [..., out, in]
    scales = torch.pow(2.0, scale.float() - 127.0).repeat_interleave(GROUP, dim=-1)
    return values * scales


class DenseFFN(nn.Module):
    def __init__(self, cfg: K3Config, inter):
        super().__init__()
        D = cfg.hidden_size
        self.wg, self.wu, self.wd, self.cfg = param(inter, D), param(inter, D), param(D, inter), cfg

    def forward(self, x):
        act = situ(proj(x, self.wg), proj(x, self.wu), self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return proj(act, self.wd)


class LatentMoE(nn.Module):
    def __init__(self, cfg: K3Config):
        super().__init__()
        D, E, Z, I = (cfg.hidden_size, cfg.num_experts, cfg.routed_expert_hidden_size,
                      cfg.moe_intermediate_size)
        self.cfg, self.E = cfg, E
        self.router, self.router_bias = param(E, D), param(E)
        self.down, self.latent_norm, self.up = param(Z, D), param(Z), param(D, Z)
        for name, (o, i) in (("w1", (I, Z)), ("w3", (I, Z)), ("w2", (Z, I))):
            self.register_buffer(f"{name}_packed", torch.zeros(E, o, i // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.zeros(E, o, i // GROUP, dtype=torch.uint8))
        self.register_buffer("e2m1", torch.tensor(E2M1_VALUES), persistent=False)
        self.shared = DenseFFN(cfg, cfg.num_shared_experts * I)

    def forward(self, x):
        cfg, dtype = self.cfg, x.dtype
        scores = torch.sigmoid(torch.einsum("...d,ed->...e", x.float(), self.router.float()))
        idx = torch.topk(scores + self.router_bias.float(), cfg.num_experts_per_token, dim=-1).indices
        w = scores.gather(-1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        routing = (F.one_hot(idx, self.E).float() * w.unsqueeze(-1)).sum(-2)  # [B, T, E]

        z = proj(x, self.down)
        acc = torch.zeros(z.shape, dtype=torch.float32, device=x.device)
        for e in range(self.E):
            w1 = mxfp4_dequant(self.w1_packed[e], self.w1_scale[e], self.e2m1).to(dtype)
            w3 = mxfp4_dequant(self.w3_packed[e], self.w3_scale[e], self.e2m1).to(dtype)
            w2 = mxfp4_dequant(self.w2_packed[e], self.w2_scale[e], self.e2m1).to(dtype)
            act = situ(proj(z, w1), proj(z, w3), cfg.situ_beta, cfg.situ_linear_beta)
            acc = acc + routing[..., e:e + 1] * proj(act, w2).float()
        u = rmsnorm(acc, self.latent_norm.float(), cfg.rms_norm_eps).to(dtype)
        return proj(u, self.up) + self.shared(x)


class Block(nn.Module):
    def __init__(self, cfg: K3Config, i, slots, max_len):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn = GatedMLA(cfg, slots, max_len) if i in cfg.full_attn_layers else KDA(cfg, slots)
        self.ffn = DenseFFN(cfg, cfg.intermediate_size) if i < cfg.first_k_dense_replace else LatentMoE(cfg)
        self.attn_mix, self.ffn_mix = DepthMix(D, eps), DepthMix(D, eps)
        self.attn_norm, self.ffn_norm = param(D), param(D)


class Spell8K3(nn.Module):
    def __init__(self, cfg: K3Config, max_batch, max_seq_len):
        super().__init__()
        self.cfg, slots = cfg, max_batch + 1  # the last slot is the scratch slot
        self.tok_emb = param(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, i, slots, max_seq_len)
                                    for i in range(cfg.num_hidden_layers))
        self.out_mix = DepthMix(cfg.hidden_size, cfg.rms_norm_eps)
        self.out_norm, self.unembed = param(cfg.hidden_size), param(cfg.vocab_size, cfg.hidden_size)

    def forward(self, input_ids, positions, slots):
        cfg, single = self.cfg, input_ids.dim() == 1
        ids = input_ids[:, None] if single else input_ids
        B, T = ids.shape
        prefix, delta, bank = self.tok_emb[ids], None, []
        if "rows" in _probes:
            prefix = prefix.view(B * T, -1)
        for i, blk in enumerate(self.blocks):
            write = i % cfg.attn_res_block_size == 0
            n = len(bank)
            if i > 0:
                prefix = prefix + delta
            if write:
                bank.append(prefix)
            h = blk.attn_mix(prefix, bank[:n])
            x = rmsnorm(h, blk.attn_norm, cfg.rms_norm_eps)
            x = x.view(B, T, -1)
            if isinstance(blk.attn, KDA):
                a = blk.attn(x, slots)
            else:
                a = blk.attn(x, positions, slots)
            a = a.view(prefix.shape)
            prefix = a if write else prefix + a
            h2 = blk.ffn_mix(prefix, bank)
            delta = blk.ffn(rmsnorm(h2, blk.ffn_norm, cfg.rms_norm_eps))
        prefix = prefix + delta
        h = self.out_mix(prefix, bank)
        logits = proj(rmsnorm(h, self.out_norm, cfg.rms_norm_eps), self.unembed)
        logits = logits.view(B, T, -1)
        return logits[:, 0] if single else logits

    def set_probe(self, *names):
        """Switch the named idioms (PROBES) to their other spelling, for every Spell8K3."""
        assert set(names) <= set(PROBES), names
        _probes.clear()
        _probes.update(names)
        return self


# built-in state-dict name (after "language_model.model.layers.N.") -> ours (after "blocks.N.")
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn.wq", "self_attn.k_proj.weight": "attn.wk",
    "self_attn.v_proj.weight": "attn.wv", "self_attn.g_proj.weight": "attn.wg",
    "self_attn.f_a_proj.weight": "attn.wfa", "self_attn.f_b_proj.weight": "attn.wfb",
    "self_attn.b_proj.weight": "attn.wb", "self_attn.q_conv1d.weight": "attn.conv_q",
    "self_attn.k_conv1d.weight": "attn.conv_k", "self_attn.v_conv1d.weight": "attn.conv_v",
    "self_attn.dt_bias": "attn.dt_bias", "self_attn.o_norm.weight": "attn.o_norm",
    "self_attn.o_proj.weight": "attn.wo",
    "self_attn.q_a_proj.weight": "attn.wqa", "self_attn.q_a_layernorm.weight": "attn.q_norm",
    "self_attn.q_b_proj.weight": "attn.wqb", "self_attn.kv_a_proj_with_mqa.weight": "attn.wkva",
    "self_attn.kv_a_layernorm.weight": "attn.kv_norm", "self_attn.kv_b_proj.weight": "attn.wkvb",
    "mlp.gate_proj.weight": "ffn.wg", "mlp.up_proj.weight": "ffn.wu",
    "mlp.down_proj.weight": "ffn.wd",
    "mlp.gate.weight": "ffn.router", "mlp.gate.e_score_correction_bias": "ffn.router_bias",
    "mlp.routed_expert_down_proj.weight": "ffn.down", "mlp.routed_expert_norm.weight": "ffn.latent_norm",
    "mlp.routed_expert_up_proj.weight": "ffn.up",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared.wg",
    "mlp.shared_experts.up_proj.weight": "ffn.shared.wu",
    "mlp.shared_experts.down_proj.weight": "ffn.shared.wd",
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attention_res_norm.weight": "attn_mix.w_norm",
    "self_attention_res_proj.weight": "attn_mix.w_proj",
    "mlp_res_norm.weight": "ffn_mix.w_norm", "mlp_res_proj.weight": "ffn_mix.w_proj",
}
for _w in ("w1", "w2", "w3"):
    _LAYER_NAMES[f"mlp.experts.{_w}_packed"] = f"ffn.{_w}_packed"
    _LAYER_NAMES[f"mlp.experts.{_w}_scale"] = f"ffn.{_w}_scale"
_TOP_NAMES = {
    "language_model.model.embed_tokens.weight": "tok_emb",
    "language_model.model.output_attn_res_norm.weight": "out_mix.w_norm",
    "language_model.model.output_attn_res_proj.weight": "out_mix.w_proj",
    "language_model.model.norm.weight": "out_norm", "language_model.lm_head.weight": "unembed",
}
_PREFIX = "language_model.model.layers."


def _ours(name):
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    layer, rest = name[len(_PREFIX):].split(".", 1)
    if rest == "self_attn.A_log":
        return f"blocks.{layer}.attn.A_log"
    return f"blocks.{layer}.{_LAYER_NAMES[rest]}"


def from_builtin(builtin) -> Spell8K3:
    """A Spell8K3 with the built-in model's weights and states (same dtype)."""
    some = next(b for n, b in builtin.named_buffers() if n.endswith(("conv_state", "kv_cache")))
    kv = next(b for n, b in builtin.named_buffers() if n.endswith("kv_cache"))
    dtype = builtin.language_model.lm_head.weight.dtype
    model = Spell8K3(builtin.config, some.shape[0] - 1, kv.shape[1]).to(dtype)
    for blk in model.blocks:
        if isinstance(blk.attn, KDA):
            blk.attn.S = blk.attn.S.float()  # the recurrent state stays fp32 (spec §3.1)
    ours = model.state_dict()
    for name, t in builtin.state_dict().items():
        if name.endswith(("e2m1", "conv_state", "recurrent_state", "kv_cache")):
            continue
        key = _ours(name)
        if name.endswith("A_log"):
            t = t[: ours[key].shape[0]]
        ours[key].copy_(t)
    W = builtin.config.kda_num_heads * builtin.config.kda_head_dim
    for name, t in builtin.named_buffers():
        layer = name[len(_PREFIX):].split(".", 1)[0] if name.startswith(_PREFIX) else None
        if name.endswith("conv_state"):
            attn = model.blocks[int(layer)].attn
            for j, s in enumerate(("q", "k", "v")):
                getattr(attn, f"{s}_conv_state").copy_(t[:, j * W:(j + 1) * W])
            attn.qkv_conv_state.copy_(t)
        elif name.endswith("recurrent_state"):
            model.blocks[int(layer)].attn.S.copy_(t)
        elif name.endswith("kv_cache"):
            model.blocks[int(layer)].attn.cache.copy_(t)
    return model


def state_of(model: Spell8K3):
    """The states under the built-in model's names and layouts."""
    out = {}
    for i, blk in enumerate(model.blocks):
        base = f"{_PREFIX}{i}.self_attn."
        if isinstance(blk.attn, KDA):
            a = blk.attn
            out[base + "conv_state"] = (a.qkv_conv_state if "one_conv_state" in _probes else
                                        torch.cat([a.q_conv_state, a.k_conv_state,
                                                   a.v_conv_state], 1))
            out[base + "recurrent_state"] = a.S
        else:
            out[base + "kv_cache"] = blk.attn.cache
    return out
