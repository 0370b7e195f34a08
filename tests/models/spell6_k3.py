"""Kimi K3 decode written a sixth time, blind, from `../shared/k3_arch.md` §2-3 alone (spell6).

Written without reading `k3compile/models/k3.py`, `k3compile/math.py`, `patterns/`,
`k3compile/canonical/`, the other test spellings' code or Moonshot's code. Taken from outside the
spec: the decode-step interface the harness `tests/spellings/foreign.py` drives (`model(input_ids
[B] or [B, T], positions [B], slots [B]) -> logits [B, (T,) V]`, state per slot with one scratch
slot), the built-in model's state-dict names and shapes (printed) for `from_builtin`, README's MXFP4
conventions (low nibble first, `2^(s - 127)`), and the idiom lists of spell5 and the red-team
spelling (docstrings only, to pick different ones). Single rank, no collectives.

Idioms, as a "plain PyTorch" research codebase (nanoGPT / torchtitan style, weights as raw
Parameters) would write them, each faithful to the spec and different from spell5 and red-team:

* names: `embed`, `blocks.N.{mixer, ffn, mixer_norm, ffn_norm, pre_res, post_res}`, `out_res`,
  `out_norm`, `unembed`; every weight a raw `nn.Parameter` used with `F.linear`, `x @ w.t()` or
  `torch.matmul`; no `nn.Linear` anywhere. Activations always [B, T, D] (a single token is T = 1,
  squeezed only at the logits).
* RMSNorm: `F.rms_norm(x.float(), (d,), eps=eps)` (no weight), cast back with `.to(dtype)`, then
  `* w` (input, post-attention, final, MLA low-rank, KDA head and latent MoE norms).
* AttnRes: the block bank a preallocated `torch.zeros(B, T, nb, D)` per step, written with
  `bank.narrow(2, j, 1).copy_(prefix.unsqueeze(2))`; a mix `torch.cat`s `bank.narrow(2, 0, n)`
  and the prefix (all ninety-three layers' path: the n = 0 mix is computed, not skipped), scores
  with `F.rms_norm(src, (D,), w_norm, eps)` in fp32 and a `torch.matmul` by the pseudo-query
  column, softmax `torch.softmax(..., dim=-1)` over the sources, the weighted sum a
  `torch.einsum("bts,btsd->btd")` in fp32.
* KDA: q|k|v one concatenated [3W, D] Parameter (concatenated at load); the three conv taps one
  [3W, 1, 4] weight; the short conv `F.conv1d(cat(state, new), taps, groups=3W, padding=K-1)`
  (symmetric padding, the causal outputs sliced from the middle: the HF-Mamba idiom); q, k, v
  split after the conv with `unflatten(-1, (3, H, dk)).unbind(2)`; the conv state read with
  `index_select` and written back out of place with `scatter_` of an expanded slot index; l2 norm
  through `torch.linalg.vector_norm(...).square() + eps` and `rsqrt`; the decay as
  `torch.exp(-5 * torch.sigmoid(...))`; beta `b.float().sigmoid()`; the recurrent state kept
  **V-major** [slots, H, V, K] (vLLM's layout; `state_of` transposes to the built-in's), the
  delta rule per token on [B*H, V, K]: reads as broadcast-multiply + `sum(-1)`, the rank-1 write
  as `torch.baddbmm(S, u[..., None], k[:, None, :])`; written back with `index_copy_` after the
  whole token loop; the head norm `F.rms_norm` cast back, `* w * torch.sigmoid(g)` in the model
  dtype; f_b as `torch.matmul(fa, w.t())`.
* Gated MLA, **not absorbed** (HF DeepSeek-V2 style): q_a and kv_a separate matmuls; the cache
  row `cat(c_kv, k_pe)` written through a flat [slots*L, R] view with `scatter_` of an expanded
  row index; every cached latent expanded through kv_b to per-head K_nope and V
  (`(c @ w_kvb.t()).unflatten(-1, (H, nope + v)).split(...)`), the shared k_pe expanded over
  heads and `cat`ed onto K_nope, and `F.scaled_dot_product_attention(q, k, v, attn_mask=bool
  mask)` (its default scale is 1/sqrt(nope + rope), the spec's); `o * torch.sigmoid(g)`.
* LatentMoE: router `F.linear` in fp32, `torch.sigmoid`, `torch.topk` of the biased scores for
  the ids only; the unbiased weights as a `torch.where(mask, scores, 0)` over a boolean top-k mask
  (`scatter` of True), renormalised densely, then read at the ids with `gather`; routed experts
  "permuted" token-major: each (token, slot) pair a row, the token's latent repeated with
  `repeat_interleave`, its expert's packed weights gathered by the flat ids; MXFP4 decode by
  `repeat_interleave(2)` of the bytes, a `[0, 4]` shift pattern and `& 15`, the E2M1 value by
  `torch.take` of a 16-entry table, the E8M0 scale as `torch.pow(2.0, s - 127)`
  `repeat_interleave`d over the 32-block; the expert GEMMs as weight-on-the-left
  `torch.matmul(W, x[..., None])`; the finalize an fp32 `index_add_` of the weighted rows into
  their tokens; the latent cast back before its norm.
* SiTU-GLU: gate|up weights concatenated at load (shared experts, dense MLP) and `chunk(2, -1)`;
  SiTU written `sigmoid(g) * tanh(g * (1 / b1)) * b1 * (tanh(u * (1 / b2)) * b2)` in fp32.

`Spell6K3.set_probe(*PROBES)` switches single idioms to another spelling of the same math, to
bisect a lost fusion (added after the blind commit; the default path is the blind one).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PREFIX = "language_model.model."


PROBES = ("situ_div", "gate_up_separate", "route_gather", "moe_nk", "lut_index", "mla_index_put",
          "mla_explicit", "kda_add_bmm", "kda_kmajor", "conv_index_put", "conv_valid", "l2_sum",
          "qkv_separate", "conv_split", "kda_heads")


def _param(t):
    return nn.Parameter(t.detach().clone(), requires_grad=False)


def rms(x, w, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * w


def situ(gate, up, b1, b2, probe=frozenset()):
    g, u = gate.float(), up.float()
    if "situ_div" in probe:
        return (b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))).to(gate.dtype)
    act = torch.sigmoid(g) * torch.tanh(g * (1.0 / b1)) * b1 * (torch.tanh(u * (1.0 / b2)) * b2)
    return act.to(gate.dtype)


class DepthRes(nn.Module):
    """One AttnRes mix: softmax over the depth sources of a learned pseudo-query's scores."""

    def __init__(self, w_norm, w_proj, eps):
        super().__init__()
        self.w_norm, self.w_proj, self.eps = _param(w_norm), _param(w_proj), eps

    def forward(self, bank, n, prefix):
        src = torch.cat([bank.narrow(2, 0, n), prefix.unsqueeze(2)], 2).float()  # [B, T, S, D]
        normed = F.rms_norm(src, (src.shape[-1],), self.w_norm.float(), self.eps)
        alpha = torch.softmax(torch.matmul(normed, self.w_proj.float().t()).squeeze(-1), dim=-1)
        return torch.einsum("bts,btsd->btd", alpha, src).to(prefix.dtype)


class GluMLP(nn.Module):
    def __init__(self, w_gate, w_up, w_down, cfg):
        super().__init__()
        self.w_gate_up = _param(torch.cat([w_gate, w_up], 0))
        self.w_down = _param(w_down)
        self.betas = (cfg.situ_beta, cfg.situ_linear_beta)
        self.probe = frozenset()

    def forward(self, x):
        if "gate_up_separate" in self.probe:
            gate, up = (F.linear(x, w) for w in self.w_gate_up.chunk(2, 0))
        else:
            gate, up = F.linear(x, self.w_gate_up).chunk(2, -1)
        return F.linear(situ(gate, up, *self.betas, self.probe), self.w_down)


def mxfp4_decode(packed, scale, lut, probe=frozenset()):
    """[..., out, in/2] nibbles (low first) and [..., out, in/32] E8M0 -> [..., out, in] fp32."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device).repeat(packed.shape[-1])
    codes = (packed.repeat_interleave(2, -1) >> shifts) & 15
    scales = torch.pow(2.0, scale.float() - 127.0).repeat_interleave(32, -1)
    vals = lut[codes.long()] if "lut_index" in probe else torch.take(lut, codes.long())
    return vals * scales


class KDA(nn.Module):
    def __init__(self, sd, p, cfg, slots, dtype):
        super().__init__()
        self.h, self.dk, self.kk = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        w = self.h * self.dk
        self.w_qkv = _param(torch.cat([sd[p + f"{n}_proj.weight"] for n in "qkv"], 0))
        self.taps = _param(torch.cat([sd[p + f"{n}_conv1d.weight"] for n in "qkv"], 0))
        for n in ("g", "f_a", "f_b", "b", "o"):
            setattr(self, f"w_{n}", _param(sd[p + f"{n}_proj.weight"]))
        self.dt_bias, self.o_norm = _param(sd[p + "dt_bias"]), _param(sd[p + "o_norm.weight"])
        self.a_log = _param(sd[p + "A_log"][: self.h])
        self.bound, self.l2eps, self.eps = cfg.gate_lower_bound, cfg.l2norm_eps, cfg.rms_norm_eps
        self.register_buffer("conv_state", torch.zeros(slots, 3 * w, self.kk - 1, dtype=dtype))
        self.register_buffer("ssm", torch.zeros(slots, self.h, self.dk, self.dk))  # V-major
        self.probe = frozenset()

    def _l2(self, x):
        x = x.float()
        if "l2_sum" in self.probe:
            return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.l2eps)
        n2 = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()
        return x * torch.rsqrt(n2 + self.l2eps)

    def _conv(self, mixed, slots):
        t, c = mixed.shape[1:]
        old = self.conv_state.index_select(0, slots)  # [B, C, K-1]
        window = torch.cat([old, mixed.transpose(1, 2)], -1)  # [B, C, K-1+T]
        if "conv_valid" in self.probe:
            y = F.silu(F.conv1d(window, self.taps, groups=c))
        else:
            y = F.conv1d(window, self.taps, groups=c, padding=self.kk - 1)
            y = F.silu(y[..., self.kk - 1: self.kk - 1 + t])
        keep = window[..., -(self.kk - 1):]
        if "conv_index_put" in self.probe:
            self.conv_state[slots] = keep
        else:
            self.conv_state.scatter_(0, slots.view(-1, 1, 1).expand_as(keep), keep)
        return y.transpose(1, 2)  # [B, T, C]

    def forward(self, x, slots):
        b, t, _ = x.shape
        h, d = self.h, self.dk
        if "qkv_separate" in self.probe:
            mixed = torch.cat([F.linear(x, w) for w in self.w_qkv.chunk(3, 0)], -1)
        else:
            mixed = F.linear(x, self.w_qkv)
        if "conv_split" in self.probe:
            q, k, v = (y.unflatten(-1, (h, d)) for y in self._conv(mixed, slots).split(h * d, -1))
        else:
            q, k, v = self._conv(mixed, slots).unflatten(-1, (3, h, d)).unbind(2)
        q, k = self._l2(q) * d ** -0.5, self._l2(k)
        graw = torch.matmul(F.linear(x, self.w_f_a), self.w_f_b.t())
        gate_in = torch.exp(self.a_log).repeat_interleave(d) * (graw.float() + self.dt_bias)
        alpha = torch.exp(self.bound * torch.sigmoid(gate_in)).unflatten(-1, (h, d))
        beta = F.linear(x, self.w_b).float().sigmoid()  # [B, T, H]
        kmajor = "kda_kmajor" in self.probe  # the state [B*H, K, V] instead
        kdim, vdim = (-2, -1) if kmajor else (-1, -2)  # the state's K axis, its V axis
        if "kda_heads" in self.probe:
            return self._out(x, self._delta_heads(self.ssm[slots], q, k, v, alpha, beta, kdim, vdim),
                             slots)
        s = self.ssm[slots].flatten(0, 1)  # [B*H, V, K]
        outs = []
        for i in range(t):
            kt, qt = k[:, i].flatten(0, 1), q[:, i].flatten(0, 1)  # [B*H, K]
            s = s * alpha[:, i].flatten(0, 1).unsqueeze(vdim)
            kv = (s * kt.unsqueeze(vdim)).sum(kdim)  # [B*H, V]
            u = beta[:, i].reshape(-1, 1) * (v[:, i].flatten(0, 1).float() - kv)
            a, c = (kt.unsqueeze(-1), u.unsqueeze(1)) if kmajor else (u.unsqueeze(-1), kt.unsqueeze(1))
            s = s + torch.bmm(a, c) if "kda_add_bmm" in self.probe else torch.baddbmm(s, a, c)
            outs.append((s * qt.unsqueeze(vdim)).sum(kdim).view(b, h, d))
        return self._out(x, (s.view(b, h, d, d), torch.stack(outs, 1)), slots)

    def _delta_heads(self, s, q, k, v, alpha, beta, kdim, vdim):
        """The probe `kda_heads`: the delta rule on the [B, H, ., .] state, no [B*H] rows, the
        rank-1 write a broadcast product."""
        outs = []
        for i in range(q.shape[1]):
            kt, qt = k[:, i], q[:, i]  # [B, H, K]
            s = s * alpha[:, i].unsqueeze(vdim)
            kv = (s * kt.unsqueeze(vdim)).sum(kdim)  # [B, H, V]
            u = beta[:, i].unsqueeze(-1) * (v[:, i].float() - kv)
            s = s + kt.unsqueeze(vdim) * u.unsqueeze(kdim)
            outs.append((s * qt.unsqueeze(vdim)).sum(kdim))
        return s, torch.stack(outs, 1)

    def _out(self, x, state_o, slots):
        s, o = state_o  # the new state [B, H, ., .], o [B, T, H, V] fp32
        h, d = self.h, self.dk
        self.ssm.index_copy_(0, slots, s)
        o = F.rms_norm(o, (d,), eps=self.eps).to(x.dtype) * self.o_norm
        o = o * torch.sigmoid(F.linear(x, self.w_g)).unflatten(-1, (h, d))
        return F.linear(o.flatten(-2), self.w_o)


class GatedMLA(nn.Module):
    def __init__(self, sd, p, cfg, slots, max_len, dtype):
        super().__init__()
        self.h, self.c, self.r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope, self.dv, self.eps = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.mla_norm_eps
        names = {"q_a": "q_a_proj", "q_b": "q_b_proj", "kv_a": "kv_a_proj_with_mqa",
                 "kv_b": "kv_b_proj", "g": "g_proj", "o": "o_proj",
                 "q_norm": "q_a_layernorm", "kv_norm": "kv_a_layernorm"}
        for mine, theirs in names.items():
            setattr(self, f"w_{mine}", _param(sd[p + theirs + ".weight"]))
        self.register_buffer("cache", torch.zeros(slots, max_len, self.c + self.r, dtype=dtype))
        self.probe = frozenset()

    def forward(self, x, positions, slots):
        b, t, _ = x.shape
        h, c, r, nope = self.h, self.c, self.r, self.nope
        cq = rms(x @ self.w_q_a.t(), self.w_q_norm, self.eps)
        q = (cq @ self.w_q_b.t()).view(b, t, h, nope + r).transpose(1, 2)  # [B, H, T, n+r]
        c_kv, k_pe = (x @ self.w_kv_a.t()).split([c, r], -1)
        row = torch.cat([rms(c_kv, self.w_kv_norm, self.eps), k_pe], -1)  # [B, T, C+R]
        length = self.cache.shape[1]
        pos = positions.unsqueeze(1) + torch.arange(t, device=x.device)  # [B, T]
        if "mla_index_put" in self.probe:
            self.cache[slots.unsqueeze(1), pos] = row
        else:
            flat_idx = (slots.unsqueeze(1) * length + pos).reshape(-1, 1).expand(-1, c + r)
            self.cache.view(-1, c + r).scatter_(0, flat_idx, row.reshape(-1, c + r))
        latent, k_pe_all = self.cache[slots].split([c, r], -1)  # [B, L, C], [B, L, R]
        kv = (latent @ self.w_kv_b.t()).unflatten(-1, (h, nope + self.dv)).transpose(1, 2)
        k_nope, v = kv.split([nope, self.dv], -1)  # [B, H, L, .]
        k = torch.cat([k_nope, k_pe_all.unsqueeze(1).expand(-1, h, -1, -1)], -1)
        mask = torch.arange(length, device=x.device) <= pos.unsqueeze(-1)  # [B, T, L]
        if "mla_explicit" in self.probe:
            scores = (q @ k.transpose(-1, -2)).float() * (nope + r) ** -0.5
            scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
            o = torch.softmax(scores, -1).to(v.dtype) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        o = o.transpose(1, 2).flatten(2)  # [B, T, H*V]
        return (o * torch.sigmoid(x @ self.w_g.t())) @ self.w_o.t()


class LatentMoE(nn.Module):
    def __init__(self, sd, p, cfg, dtype):
        super().__init__()
        self.top_k, self.eps = cfg.num_experts_per_token, cfg.rms_norm_eps
        self.scaling = cfg.routed_scaling_factor
        self.betas = (cfg.situ_beta, cfg.situ_linear_beta)
        self.w_router = _param(sd[p + "gate.weight"])
        self.router_bias = _param(sd[p + "gate.e_score_correction_bias"])
        self.w_down = _param(sd[p + "routed_expert_down_proj.weight"])
        self.w_up = _param(sd[p + "routed_expert_up_proj.weight"])
        self.latent_norm = _param(sd[p + "routed_expert_norm.weight"])
        for n in ("w1", "w3", "w2"):
            self.register_buffer(f"{n}_q", sd[p + f"experts.{n}_packed"].clone())
            self.register_buffer(f"{n}_e", sd[p + f"experts.{n}_scale"].clone())
        self.register_buffer("lut", torch.tensor(E2M1))
        s = p + "shared_experts."
        self.shared = GluMLP(sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"],
                             sd[s + "down_proj.weight"], cfg)
        self.probe = frozenset()

    def _expert(self, name, ids, x):
        w = mxfp4_decode(getattr(self, f"{name}_q")[ids], getattr(self, f"{name}_e")[ids],
                         self.lut, self.probe)
        return torch.matmul(w, x.float().unsqueeze(-1)).squeeze(-1).to(x.dtype)

    def _experts_nk(self, ids, weights, z):
        """The probe `moe_nk`: ids [N, k], the slots of a token together, finalize a sum."""
        zk = z.unsqueeze(1).expand(-1, ids.shape[1], -1)
        act = situ(self._expert("w1", ids, zk), self._expert("w3", ids, zk), *self.betas,
                   self.probe)
        y = self._expert("w2", ids, act)  # [N, k, L]
        return (weights.unsqueeze(-1) * y.float()).sum(1).to(z.dtype)

    def forward(self, x):
        shape = x.shape
        x = x.flatten(0, -2)  # [N, D]
        n = x.shape[0]
        scores = torch.sigmoid(F.linear(x.float(), self.w_router.float()))
        ids = torch.topk(scores + self.router_bias.float(), self.top_k, dim=-1).indices
        if "route_gather" in self.probe:
            picked = scores.gather(1, ids)
            weights = picked / (picked.sum(-1, keepdim=True) + 1e-20) * self.scaling
        else:
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, ids, True)
            dense = torch.where(chosen, scores, 0.0)
            dense = dense / (dense.sum(-1, keepdim=True) + 1e-20) * self.scaling
            weights = dense.gather(1, ids)  # [N, k]
        z = F.linear(x, self.w_down)
        if "moe_nk" in self.probe:
            u = self._experts_nk(ids, weights, z)
            routed = F.linear(rms(u, self.latent_norm, self.eps), self.w_up)
            return (routed + self.shared(x)).view(shape)
        weights = weights.flatten()  # [N*k]
        token = torch.arange(n, device=x.device).repeat_interleave(self.top_k)
        flat_ids, zr = ids.flatten(), z.repeat_interleave(self.top_k, 0)
        act = situ(self._expert("w1", flat_ids, zr), self._expert("w3", flat_ids, zr),
                   *self.betas, self.probe)
        y = self._expert("w2", flat_ids, act)  # [N*k, L]
        acc = torch.zeros(n, y.shape[-1], dtype=torch.float32, device=x.device)
        u = acc.index_add_(0, token, y.float() * weights.unsqueeze(-1)).to(x.dtype)
        routed = F.linear(rms(u, self.latent_norm, self.eps), self.w_up)
        return (routed + self.shared(x)).view(shape)


class Block(nn.Module):
    def __init__(self, sd, i, cfg, slots, max_len, dtype):
        super().__init__()
        p = f"{_PREFIX}layers.{i}."
        if i in cfg.full_attn_layers:
            self.mixer = GatedMLA(sd, p + "self_attn.", cfg, slots, max_len, dtype)
        else:
            self.mixer = KDA(sd, p + "self_attn.", cfg, slots, dtype)
        if i < cfg.first_k_dense_replace:
            m = p + "mlp."
            self.ffn = GluMLP(sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"],
                              sd[m + "down_proj.weight"], cfg)
        else:
            self.ffn = LatentMoE(sd, p + "mlp.", cfg, dtype)
        self.mixer_norm = _param(sd[p + "input_layernorm.weight"])
        self.ffn_norm = _param(sd[p + "post_attention_layernorm.weight"])
        self.pre_res = DepthRes(sd[p + "self_attention_res_norm.weight"],
                                sd[p + "self_attention_res_proj.weight"], cfg.rms_norm_eps)
        self.post_res = DepthRes(sd[p + "mlp_res_norm.weight"], sd[p + "mlp_res_proj.weight"],
                                 cfg.rms_norm_eps)


class Spell6K3(nn.Module):
    def __init__(self, sd, cfg, slots, max_len, dtype):
        super().__init__()
        self.cfg = cfg
        self.embed = _param(sd[_PREFIX + "embed_tokens.weight"])
        self.blocks = nn.ModuleList(Block(sd, i, cfg, slots, max_len, dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.out_res = DepthRes(sd[_PREFIX + "output_attn_res_norm.weight"],
                                sd[_PREFIX + "output_attn_res_proj.weight"], cfg.rms_norm_eps)
        self.out_norm = _param(sd[_PREFIX + "norm.weight"])
        self.unembed = _param(sd["language_model.lm_head.weight"])

    def set_probe(self, *names):
        """Switch the named idioms (`PROBES`) to another spelling of the same math (bisecting a
        lost fusion); call before the first step (`kda_kmajor` changes the state's layout)."""
        assert set(names) <= set(PROBES), set(names) - set(PROBES)
        for m in self.modules():
            if hasattr(m, "probe"):
                m.probe = frozenset(names)
        return self

    def forward(self, input_ids, positions, slots):
        single = input_ids.dim() == 1
        ids = input_ids.unsqueeze(1) if single else input_ids
        size, eps = self.cfg.attn_res_block_size, self.cfg.rms_norm_eps
        prefix = F.embedding(ids, self.embed)  # [B, T, D]
        nb = math.ceil(len(self.blocks) / size)
        bank = torch.zeros(*prefix.shape[:2], nb, prefix.shape[-1], dtype=prefix.dtype,
                           device=prefix.device)
        delta = None
        for i, blk in enumerate(self.blocks):
            if delta is not None:
                prefix = prefix + delta
            n, write = -(-i // size), i % size == 0
            if write:
                bank.narrow(2, i // size, 1).copy_(prefix.unsqueeze(2))
            h = blk.pre_res(bank, n, prefix)
            x = rms(h, blk.mixer_norm, eps)
            if isinstance(blk.mixer, KDA):
                a = blk.mixer(x, slots)
            else:
                a = blk.mixer(x, positions, slots)
            prefix = a if write else prefix + a
            h2 = blk.post_res(bank, n + int(write), prefix)
            delta = blk.ffn(rms(h2, blk.ffn_norm, eps))
        prefix = prefix + delta
        h = self.out_res(bank, nb, prefix)
        logits = F.linear(rms(h, self.out_norm, eps), self.unembed)
        return logits.squeeze(1) if single else logits


def from_builtin(model):
    """A Spell6K3 carrying `model`'s weights (a `k3compile.models.build_model` model), with the
    same number of state slots and cache length."""
    sd = model.state_dict()
    cfg = model.config if hasattr(model, "config") else model.cfg
    buffers = dict(model.named_buffers())
    conv = next(b for n, b in buffers.items() if n.endswith("conv_state"))
    cache = next(b for n, b in buffers.items() if n.endswith("kv_cache"))
    dtype = sd[_PREFIX + "embed_tokens.weight"].dtype
    return Spell6K3(sd, cfg, conv.shape[0], cache.shape[1], dtype).eval()


def state_of(model):
    """The states under the built-in model's buffer names and layouts."""
    out = {}
    for i, blk in enumerate(model.blocks):
        p = f"{_PREFIX}layers.{i}.self_attn."
        if isinstance(blk.mixer, KDA):
            out[p + "conv_state"] = blk.mixer.conv_state
            kmajor = "kda_kmajor" in blk.mixer.probe
            out[p + "recurrent_state"] = blk.mixer.ssm if kmajor else blk.mixer.ssm.transpose(-1, -2)
        else:
            out[p + "kv_cache"] = blk.mixer.cache
    return out
