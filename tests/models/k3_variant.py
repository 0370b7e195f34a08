"""The K3 decode step spelled differently: same math, same state dict, other torch idioms.

A robustness probe for the k3 backend (issue 4): `to_variant(model, spellings)` turns a model built
by `k3compile.models.build_model` into one whose modules compute the same function written another
way. Only `forward`s change (the modules' classes are swapped in place), so parameter names, shapes
and values stay those of `k3compile.models.k3`. Each spelling is one small change, on by name:

* `rms_builtin`: RMSNorm as `weight * F.rms_norm(x.float(), (D,), eps=eps).to(x.dtype)` (torch's
  own: fp32 normalise, cast back, times the weight; it rounds like the manual form, see below;
  it decomposes to the same ops but adds eps, rounded to fp32, with `add.Scalar`).
* `rms_weight_last`: RMSNorm's `h.to(x.dtype) * weight` for `weight * h.to(x.dtype)`.
* `reshape`: `reshape` for every `view` (KDA q/k/v/g/gate/head views, MLA q, kv_b, positions,
  LatentMoE's output) and `view` for LatentMoE's `x.reshape(-1, D)`.
* `delta_first`: `delta + prefix` and `a + prefix` for `prefix + delta` and `prefix + a`.
* `situ_beta_last`: SiTU as `tanh(g / beta) * beta * sigmoid(g)` and `tanh(u / lb) * lb`.
* `situ_lin_first`: SiTU's final product `lin * act` for `act * lin`.
* `silu_written_out`: KDA's conv activation `conv * sigmoid(conv)` for `F.silu(conv)`.
* `topk_method`: the router's `(scores + bias).topk(k)`, `torch.gather(scores, -1, idx)`,
  `weights.sum(-1, keepdim=True).add(1e-20)` and `scaling * weights`.
* `topk_sort`: the router's choice as `torch.sort(scores + bias, descending=True)[1][..., :k]`.
* `bias_first`: the router's `bias + scores` for `scores + bias`.
* `mix_alpha_last`: the depth mix's `sources.float() * alpha.unsqueeze(-1)`.
* `gate_first`: the KDA and MLA output gates as `sigmoid(g) * o`.

Every product and sum above is commutative in IEEE arithmetic, `x * beta` and `beta * x` trace to
the same ATen call, and silu is `x * sigmoid(x)` in Inductor's decomposition, so each spelling
computes bit for bit what the reference computes, up to the CPU eager kernels' own rounding:
`F.rms_norm` on CPU normalises in the input's (here already fp32) dtype with the same
`x * rsqrt(mean(x^2) + eps)` order (bit for bit equal to the manual form for fp32 and bf16
models), and `F.silu`'s vectorised kernel may differ from
`x * sigmoid(x)` by an ulp in eager. `topk_sort` picks the same set as `topk` unless two biased
scores tie. Which spellings the backend fuses as it fuses the reference is the business of
`tests/e2e/test_spellings.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.math import mxfp4_dequant
from k3compile.models import k3
from k3compile.models.k3 import _all_reduce

SPELLINGS = frozenset({
    "rms_builtin", "rms_weight_last", "reshape", "delta_first", "situ_beta_last",
    "situ_lin_first", "silu_written_out", "topk_method", "topk_sort", "bias_first",
    "mix_alpha_last", "gate_first",
})


def _on(module, name: str) -> bool:
    return name in module.spellings


def _view(module, x: torch.Tensor, *shape) -> torch.Tensor:
    return x.reshape(*shape) if _on(module, "reshape") else x.view(*shape)


class RMSNorm(k3.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _on(self, "rms_builtin"):
            h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        else:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h.to(x.dtype)
        return h * self.weight if _on(self, "rms_weight_last") else self.weight * h


def situ(spellings, gate, up, beta: float, linear_beta: float) -> torch.Tensor:
    g, u = gate.float(), up.float()
    if "situ_beta_last" in spellings:
        act = torch.tanh(g / beta) * beta * torch.sigmoid(g)
        lin = torch.tanh(u / linear_beta) * linear_beta
    else:
        act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        lin = linear_beta * torch.tanh(u / linear_beta)
    out = lin * act if "situ_lin_first" in spellings else act * lin
    return out.to(gate.dtype)


def attn_res_mix(spellings, prefix, blocks, norm, proj):
    if not blocks:
        return prefix
    sources = torch.stack([*blocks, prefix])
    alpha = torch.softmax(proj(norm(sources)).squeeze(-1).float(), dim=0)
    if "mix_alpha_last" in spellings:
        mixed = sources.float() * alpha.unsqueeze(-1)
    else:
        mixed = alpha.unsqueeze(-1) * sources.float()
    return mixed.sum(0).to(prefix.dtype)


def _add(spellings, prefix, other):
    return other + prefix if "delta_first" in spellings else prefix + other


class KimiDeltaAttention(k3.KimiDeltaAttention):
    def forward(self, x, slots, group=None):
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        q, k, v, g2 = self.q_proj(x), self.k_proj(x), self.v_proj(x), self.g_proj(x)
        graw = self.f_b_proj(self.f_a_proj(x))
        beta = torch.sigmoid(self.b_proj(x).float())

        new = torch.cat([q, k, v], dim=-1).transpose(1, 2)
        window = torch.cat([self.conv_state[slots], new], dim=-1)
        self.conv_state[slots] = window[..., T:]
        taps = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        conv = F.conv1d(window.float(), taps.float().to(window.device), groups=taps.shape[0])
        conv = conv * torch.sigmoid(conv) if _on(self, "silu_written_out") else F.silu(conv)
        q, k, v = conv.to(x.dtype).transpose(1, 2).split(H * K, dim=-1)

        q = self._l2norm(_view(self, q.float(), B, T, H, K)) * K**-0.5
        k = self._l2norm(_view(self, k.float(), B, T, H, K))
        v = _view(self, v.float(), B, T, H, K)
        gate = _view(self, torch.exp(self.A_log.float()), H, 1) * (
            _view(self, graw.float(), B, T, H, K) + _view(self, self.dt_bias, H, K))
        decay = torch.exp(self.lower_bound * torch.sigmoid(gate))

        state = self.recurrent_state[slots]
        outs = []
        for t in range(T):
            state = state * decay[:, t].unsqueeze(-1)
            kv = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
            u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv)
            state = state + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
            outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
        self.recurrent_state[slots] = state
        o = self.o_norm(torch.stack(outs, dim=1).to(x.dtype))
        gate_out = torch.sigmoid(_view(self, g2, B, T, H, K))
        o = gate_out * o if _on(self, "gate_first") else o * gate_out
        return _all_reduce(self.o_proj(o.reshape(B, T, H * K)), group)


class GatedMLA(k3.GatedMLA):
    def forward(self, x, slots, positions, group=None):
        B, T, _ = x.shape
        H, C = self.num_heads, self.kv_lora_rank
        cq = self.q_a_layernorm(self.q_a_proj(x))
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([C, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q = _view(self, self.q_b_proj(cq), B, T, H, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        g = self.g_proj(x)

        wkv_b = _view(self, self.kv_b_proj.weight, H, self.nope + self.v_dim, C)
        w_uk, w_uv = wkv_b.split([self.nope, self.v_dim], dim=1)
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)

        pos = _view(self, positions, B, 1) + torch.arange(T, device=x.device)
        self.kv_cache[_view(self, slots, B, 1), pos] = torch.cat([c_kv, k_pe], dim=-1)
        cache = self.kv_cache[slots]
        kv_lat, kv_pe = cache.split([C, self.rope], dim=-1)
        scores = (torch.einsum("bthc,blc->bthl", q_lat, kv_lat)
                  + torch.einsum("bthr,blr->bthl", q_pe, kv_pe))
        scores = scores.float() * self.softmax_scale
        L = cache.shape[1]
        visible = _view(self, torch.arange(L, device=x.device), 1, 1, -1) <= pos.unsqueeze(-1)
        scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
        p = torch.softmax(scores, dim=-1).to(x.dtype)
        o_lat = torch.einsum("bthl,blc->bthc", p, kv_lat)
        o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * self.v_dim)
        o = torch.sigmoid(g) * o if _on(self, "gate_first") else o * torch.sigmoid(g)
        return _all_reduce(self.o_proj(o), group)


class SiTUMLP(k3.SiTUMLP):
    def forward(self, x):
        act = situ(self.spellings, self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta)
        return self.down_proj(act)


class DenseMLP(SiTUMLP, k3.DenseMLP):
    def forward(self, x, group=None):
        return _all_reduce(SiTUMLP.forward(self, x), group)


class MoEGate(k3.MoEGate):
    def forward(self, x):
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        bias = self.e_score_correction_bias
        biased = bias + scores if _on(self, "bias_first") else scores + bias
        if _on(self, "topk_sort"):
            idx = torch.sort(biased, dim=-1, descending=True)[1][..., :self.top_k]
        elif _on(self, "topk_method"):
            idx = biased.topk(self.top_k)[1]
        else:
            idx = torch.topk(biased, self.top_k, dim=-1)[1]
        if _on(self, "topk_method"):
            weights = torch.gather(scores, -1, idx)
            weights = weights / weights.sum(-1, keepdim=True).add(1e-20)
            return idx, self.scaling * weights
        weights = scores.gather(-1, idx)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling


class MXFP4Experts(k3.MXFP4Experts):
    def forward(self, z, idx, weights):
        lut = self.e2m1.to(z.dtype)
        w1 = mxfp4_dequant(self.w1_packed[idx], self.w1_scale[idx], lut)
        w3 = mxfp4_dequant(self.w3_packed[idx], self.w3_scale[idx], lut)
        w2 = mxfp4_dequant(self.w2_packed[idx], self.w2_scale[idx], lut)
        hg = torch.einsum("nl,nkil->nki", z, w1)
        hu = torch.einsum("nl,nkil->nki", z, w3)
        act = situ(self.spellings, hg, hu, self.beta, self.linear_beta)
        y = torch.einsum("nki,nkli->nkl", act, w2)
        return (weights.unsqueeze(-1) * y.float()).sum(1).to(z.dtype)


class LatentMoE(k3.LatentMoE):
    def forward(self, x, group=None):
        shape = x.shape
        x = x.view(-1, shape[-1]) if _on(self, "reshape") else x.reshape(-1, shape[-1])
        idx, weights = self.gate(x)
        z = self.routed_expert_down_proj(x)
        u = _all_reduce(self.experts(z, idx, weights), group)
        routed = self.routed_expert_up_proj(self.routed_expert_norm(u))
        shared = _all_reduce(self.shared_experts(x), group)
        return _view(self, routed + shared, shape)


class K3DecoderLayer(k3.K3DecoderLayer):
    def forward(self, prefix, delta, blocks, slots, positions, group=None):
        s, i = self.spellings, self.layer_idx
        starts_block = i % self.block_size == 0
        n = -(-i // self.block_size)
        if i > 0:
            prefix = _add(s, prefix, delta)
        if starts_block:
            blocks = [*blocks, prefix]
        h = attn_res_mix(s, prefix, blocks[:n], self.self_attention_res_norm,
                         self.self_attention_res_proj)
        x = self.input_layernorm(h)
        if self.is_mla:
            a = self.self_attn(x, slots, positions, group)
        else:
            a = self.self_attn(x, slots, group)
        prefix = a if starts_block else _add(s, prefix, a)
        h2 = attn_res_mix(s, prefix, blocks[: n + starts_block], self.mlp_res_norm,
                          self.mlp_res_proj)
        delta = self.mlp(self.post_attention_layernorm(h2), group)
        return prefix, delta, blocks


class K3Model(k3.K3Model):
    def forward(self, input_ids, slots, positions, group=None):
        prefix = self.embed_tokens(input_ids)
        delta = torch.zeros_like(prefix)
        blocks: list[torch.Tensor] = []
        for layer in self.layers:
            prefix, delta, blocks = layer(prefix, delta, blocks, slots, positions, group)
        prefix = _add(self.spellings, prefix, delta)
        h = attn_res_mix(self.spellings, prefix, blocks, self.output_attn_res_norm,
                         self.output_attn_res_proj)
        return self.norm(h)


# reference class -> its variant; DenseMLP before SiTUMLP (a subclass), matched by exact type
_VARIANTS = {cls.__mro__[1] if cls is not DenseMLP else k3.DenseMLP: cls for cls in (
    RMSNorm, KimiDeltaAttention, GatedMLA, SiTUMLP, DenseMLP, MoEGate, MXFP4Experts, LatentMoE,
    K3DecoderLayer, K3Model)}


def to_variant(model: k3.K3ForCausalLM, spellings=SPELLINGS) -> k3.K3ForCausalLM:
    """`model` (in place) with the named spellings; its state dict is untouched."""
    spellings = frozenset(spellings)
    if spellings - SPELLINGS:
        raise ValueError(f"unknown spellings {sorted(spellings - SPELLINGS)}")
    for module in model.modules():
        variant = _VARIANTS.get(type(module))
        if variant is not None:
            module.__class__ = variant
            module.spellings = spellings
    return model


__all__ = ["SPELLINGS", "to_variant"]
