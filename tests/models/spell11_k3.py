"""An eleventh spelling of Kimi K3's decode step (tests/e2e/test_spell11_spelling.py), written
blind from shared/k3_arch.md (plus the harness's interface, the built-in model's printed
state-dict names, README's MXFP4 conventions and the idiom lists of the other spellings): the
style of a mixed-precision training codebase's inference path.

Idioms, chosen to differ from the seven earlier spellings:

* **fp32 master weights and `torch.autocast`**: every parameter is fp32 (a bf16 checkpoint is
  upcast at load); the step runs under `torch.autocast(dtype=bf16)` when the compute dtype is
  bf16, so each GEMM casts its operands; the fp32 math (router, AttnRes mix, KDA recurrence, expert
  combine) runs in `torch.autocast(enabled=False)` islands; non-GEMM weights are cast by hand
  (`w.to(x.dtype)`) where they meet bf16 activations.
* activations [B, T, D] (T = 1 for one token), projections `x @ W.mT` with `torch.matmul`;
* RMSNorm `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)` in a small module (fp32, cast,
  times the weight);
* AttnRes: the bank grown functionally by `torch.cat` along a depth dim [B, T, n, D]; the scores
  a `torch.bmm` of the raw sources with the folded query, times each source's rsqrt; the mix a
  `torch.bmm` of the [M, 1, S] weights with the [M, S, D] sources;
* KDA: q|k|v|g one stacked weight cut by `torch.tensor_split(., 4)`; the short conv from a rolled
  state: `addcmul(sum(state * taps[:3]), x, taps[3])`, the state `torch.roll(-1)` with the new
  column assigned; the l2 norm as `rsqrt(square().sum() + eps)`; the decay per head on
  [B, T, H, D]; the delta rule on a K-major [B, H, K, V] fp32 state, reads as
  `matmul(k.unsqueeze(-2), S)`, the rank-1 write `S.addcmul_(k[..., None], u[..., None, :])`;
  states written back with `index_put_`;
* Gated MLA absorbed, attention by `F.scaled_dot_product_attention(enable_gqa=True)` of
  [q_lat | q_pe] over one shared latent "KV head" with an explicit boolean mask; W_UK / W_UV as
  `torch.bmm` over heads-first views of kv_b; the cache written by `index_put_` at
  (slot, position);
* MoE: routing with `torch.topk(sorted=False)` and `torch.gather` of the unbiased scores; the
  experts "grouped": token-expert pairs sorted by expert (`torch.sort(stable=True)`), per-pair
  weights gathered and dequantised, `torch.bmm` FC1 / FC2, the outputs put back in token order by
  a `torch.gather` through the inverse permutation, the combine a `torch.bmm` of the [M, 1, k]
  weights with the [M, k, L] outputs in fp32;
* MXFP4 decoded arithmetically (sign, 2-bit exponent, 1-bit mantissa, `torch.where`,
  `torch.exp2`), the scale `exp2(s - 127)`;
* SiTU-GLU written from its formula, fp32.

`from_builtin(model)` loads the built-in model's weights and states through a name map;
`state_of(model)` gives the states under the built-in model's names and layouts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# idioms set_probe switches to another spelling of the same math (to bisect a lost fusion):
# mix: the AttnRes mix stacked on a leading depth dim, scores as a sum, weighted sum over depth;
# conv_window: the short conv over cat(state, x) with the state its last K-1 columns;
# state_add: the rank-1 state write `S + k[..., None] * u[..., None, :]`;
# state_einsum: the state reads as einsum("bhkv,bhk->bhv");
# cache_index: the latent cache written at (slots[:, None], positions) without the expand;
# attention: MLA's attention written out (matmul, scale, masked softmax, matmul);
# kv_broadcast: SDPA without enable_gqa, the one latent head broadcast over the query heads;
# token_order: the experts in token order ([M, k] gathers, no sort);
# combine_sum: the experts' combine as (w[..., None] * y).sum(1);
# checkpoint_weights: every parameter in the checkpoint's dtype, no autocast (bf16 GEMMs read
# bf16 weights)
PROBES = ("mix", "conv_window", "state_add", "state_einsum", "cache_index", "attention",
          "kv_broadcast", "token_order", "combine_sum", "checkpoint_weights")


def _island(x: torch.Tensor):
    """An fp32 region inside the autocast step."""
    return torch.autocast(device_type=x.device.type, enabled=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or x.dtype
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return normed * self.weight.to(dtype)


def situ(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float, dtype) -> torch.Tensor:
    g, u = g.float(), u.float()
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))).to(dtype)


def mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """[..., O, I/2] E2M1 bytes (low nibble first) and [..., O, I/32] E8M0 scales -> [..., O, I]."""
    nib = torch.stack((packed & 15, packed >> 4), -1).flatten(-2).to(torch.int32)
    sign = 1.0 - 2.0 * ((nib >> 3) & 1).float()
    exp, man = ((nib >> 1) & 3).float(), (nib & 1).float()
    mag = torch.where(exp == 0, 0.5 * man, torch.exp2(exp - 1.0) * (1.0 + 0.5 * man))
    groups = (sign * mag).unflatten(-1, (scale.shape[-1], 32))
    return (groups * torch.exp2(scale.float() - 127.0)[..., None]).flatten(-2).to(dtype)


class Mix(nn.Module):
    """One AttnRes depth mix: a pseudo-query attention over the bank and the prefix."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(dim))
        self.proj = nn.Parameter(torch.zeros(1, dim))
        self.eps = eps

    def forward(self, bank: torch.Tensor, prefix: torch.Tensor, probes=()) -> torch.Tensor:
        if bank.shape[-2] == 0:
            return prefix
        if "mix" in probes:
            return self.stacked(bank, prefix)
        with _island(prefix):
            src = torch.cat([bank, prefix.unsqueeze(-2)], -2).float().flatten(0, 1)  # [M, S, D]
            inv = torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + self.eps)  # [M, S, 1]
            query = (self.norm * self.proj[0]).float()
            score = torch.bmm(src, query[None, :, None].expand(src.shape[0], -1, 1)) * inv
            alpha = torch.softmax(score, 1).transpose(1, 2)  # [M, 1, S]
            out = torch.bmm(alpha, src).squeeze(1)
        return out.view_as(prefix).to(prefix.dtype)

    def stacked(self, bank, prefix):
        with _island(prefix):
            src = torch.stack([*bank.unbind(-2), prefix]).float()  # [S, B, T, D]
            h = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + self.eps)
            alpha = torch.softmax((h * (self.norm * self.proj[0]).float()).sum(-1), 0)
            return (alpha.unsqueeze(-1) * src).sum(0).to(prefix.dtype)


class KDA(nn.Module):
    def __init__(self, cfg, slots: int, dtype):
        super().__init__()
        D, H, Dh, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        W = H * Dh
        self.H, self.Dh, self.W = H, Dh, W
        self.bound = cfg.gate_lower_bound
        self.l2eps = cfg.l2norm_eps
        self.qkvg = nn.Parameter(torch.zeros(4 * W, D))
        self.f_a = nn.Parameter(torch.zeros(cfg.kda_head_dim, D))
        self.f_b = nn.Parameter(torch.zeros(W, cfg.kda_head_dim))
        self.beta = nn.Parameter(torch.zeros(H, D))
        self.taps = nn.Parameter(torch.zeros(3 * W, K))
        self.dt_bias = nn.Parameter(torch.zeros(W))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.out_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.out = nn.Parameter(torch.zeros(D, W))
        self.register_buffer("conv", torch.zeros(slots, 3 * W, K - 1, dtype=dtype))
        self.register_buffer("state", torch.zeros(slots, H, Dh, Dh))

    def short_conv(self, qkv: torch.Tensor, slots: torch.Tensor, probes=()) -> torch.Tensor:
        window = self.conv[slots]  # [B, 3W, K-1], oldest first
        taps = self.taps.float()
        out = []
        for t in range(qkv.shape[1]):
            x = qkv[:, t]
            if "conv_window" in probes:
                full = torch.cat([window, x.unsqueeze(-1)], -1)
                out.append(F.silu((full.float() * taps).sum(-1)).to(qkv.dtype))
                window = full[..., 1:]
                continue
            acc = torch.addcmul((window.float() * taps[:, :-1]).sum(-1), x.float(), taps[:, -1])
            out.append(F.silu(acc).to(qkv.dtype))
            window = torch.roll(window, -1, -1)
            window[..., -1] = x
        self.conv.index_put_((slots,), window)
        return torch.stack(out, 1)

    def forward(self, x: torch.Tensor, slots: torch.Tensor, probes=()) -> torch.Tensor:
        T = x.shape[1]
        H, Dh = self.H, self.Dh
        q, k, v, g = torch.tensor_split(x @ self.qkvg.mT, 4, -1)
        graw = (x @ self.f_a.mT) @ self.f_b.mT
        b = x @ self.beta.mT
        q, k, v = self.short_conv(torch.cat([q, k, v], -1), slots, probes).tensor_split(3, -1)
        with _island(x):
            q, k, v = (t.float().unflatten(-1, (H, Dh)) for t in (q, k, v))
            q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + self.l2eps) * Dh ** -0.5
            k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + self.l2eps)
            gate_in = graw.float().unflatten(-1, (H, Dh)) + self.dt_bias.view(H, Dh)
            log_a = self.bound * torch.sigmoid(self.A_log.exp()[:, None] * gate_in)
            decay = log_a.exp()  # [B, T, H, Dh]
            beta = torch.sigmoid(b.float())  # [B, T, H]
            S = self.state[slots]  # [B, H, K, V]
            read = _einsum_read if "state_einsum" in probes else _matmul_read
            outs = []
            for t in range(T):
                S = S * decay[:, t, :, :, None]
                kt = k[:, t]
                pred = read(S, kt)
                u = beta[:, t, :, None] * (v[:, t] - pred)
                if "state_add" in probes:
                    S = S + kt[..., None] * u[..., None, :]
                else:
                    S.addcmul_(kt[..., None], u[..., None, :])
                outs.append(read(S, q[:, t]))
            self.state.index_put_((slots,), S)
            o = torch.stack(outs, 1)  # [B, T, H, V]
            normed = self.out_norm(o, x.dtype).float()
            o = (normed * torch.sigmoid(g.float().unflatten(-1, (H, Dh)))).to(x.dtype)
        return o.flatten(-2) @ self.out.mT


def _matmul_read(S: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x.unsqueeze(-2), S).squeeze(-2)


def _einsum_read(S: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bhkv,bhk->bhv", S, x)


class MLA(nn.Module):
    def __init__(self, cfg, slots: int, max_len: int, dtype):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.C, self.R = H, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.N, self.V = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.q_a = nn.Parameter(torch.zeros(cfg.q_lora_rank, D))
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps)
        self.q_b = nn.Parameter(torch.zeros(H * (self.N + self.R), cfg.q_lora_rank))
        self.kv_a = nn.Parameter(torch.zeros(self.C + self.R, D))
        self.kv_norm = RMSNorm(self.C, cfg.mla_norm_eps)
        self.kv_b = nn.Parameter(torch.zeros(H * (self.N + self.V), self.C))
        self.gate = nn.Parameter(torch.zeros(H * self.V, D))
        self.out = nn.Parameter(torch.zeros(D, H * self.V))
        self.register_buffer("cache", torch.zeros(slots, max_len, self.C + self.R, dtype=dtype))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, probes=()):
        B, T, _ = x.shape
        H, C, R, N, V = self.H, self.C, self.R, self.N, self.V
        cq = self.q_norm(x @ self.q_a.mT)
        ckv = x @ self.kv_a.mT
        row = torch.cat([self.kv_norm(ckv[..., :C]), ckv[..., C:]], -1)
        q = (cq @ self.q_b.mT).unflatten(-1, (H, N + R))
        q_nope, q_pe = q[..., :N], q[..., N:]
        g = x @ self.gate.mT
        kv_b = self.kv_b.view(H, N + V, C)
        q_lat = torch.bmm(q_nope.permute(2, 0, 1, 3).reshape(H, B * T, N), kv_b[:, :N])
        q_lat = q_lat.view(H, B, T, C).transpose(0, 1)  # [B, H, T, C]
        query = torch.cat([q_lat, q_pe.transpose(1, 2).to(q_lat.dtype)], -1)
        pos = positions[:, None] + torch.arange(T, device=x.device)  # [B, T]
        rows = slots[:, None] if "cache_index" in probes else slots[:, None].expand(B, T)
        self.cache.index_put_((rows, pos), row.to(self.cache.dtype))
        keys = self.cache[slots].unsqueeze(1)  # [B, 1, L, C + R]
        mask = torch.arange(keys.shape[2], device=x.device) <= pos[:, None, :, None]
        keys, scale = keys.to(query.dtype), 1.0 / math.sqrt(N + R)
        if "attention" in probes:
            score = torch.matmul(query, keys.transpose(-1, -2)) * scale
            p = torch.softmax(score.float().masked_fill(~mask, float("-inf")), -1)
            o_lat = torch.matmul(p.to(query.dtype), keys[..., :C])
        else:
            o_lat = F.scaled_dot_product_attention(
                query, keys, keys[..., :C], attn_mask=mask, scale=scale,
                enable_gqa="kv_broadcast" not in probes)  # [B, H, T, C]
        o = torch.bmm(o_lat.transpose(0, 1).reshape(H, B * T, C), kv_b[:, N:].mT)
        o = o.view(H, B, T, V).permute(1, 2, 0, 3).flatten(-2)
        with _island(x):
            o = (o.float() * torch.sigmoid(g.float())).to(x.dtype)
        return o @ self.out.mT


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int, cfg):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(inner, dim))
        self.up = nn.Parameter(torch.zeros(inner, dim))
        self.down = nn.Parameter(torch.zeros(dim, inner))
        self.b1, self.b2 = cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, x):
        return situ(x @ self.gate.mT, x @ self.up.mT, self.b1, self.b2, x.dtype) @ self.down.mT


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D, E, L, I = cfg.hidden_size, cfg.num_experts, cfg.routed_expert_hidden_size, \
            cfg.moe_intermediate_size
        self.k, self.scale = cfg.num_experts_per_token, cfg.routed_scaling_factor
        self.b1, self.b2 = cfg.situ_beta, cfg.situ_linear_beta
        self.router = nn.Parameter(torch.zeros(E, D))
        self.bias = nn.Parameter(torch.zeros(E))
        self.down = nn.Parameter(torch.zeros(L, D))
        self.norm = RMSNorm(L, cfg.rms_norm_eps)
        self.up = nn.Parameter(torch.zeros(D, L))
        for name, shape in (("w1", (E, I, L)), ("w3", (E, I, L)), ("w2", (E, L, I))):
            self.register_buffer(f"{name}_q", torch.zeros(*shape[:-1], shape[-1] // 2,
                                                          dtype=torch.uint8))
            self.register_buffer(f"{name}_e", torch.zeros(*shape[:-1], shape[-1] // 32,
                                                          dtype=torch.uint8))
        self.shared = MLP(D, cfg.moe_intermediate_size * cfg.num_shared_experts, cfg)

    def weight(self, name: str, experts: torch.Tensor, dtype) -> torch.Tensor:
        return mxfp4(getattr(self, f"{name}_q")[experts], getattr(self, f"{name}_e")[experts],
                     dtype)

    def forward(self, x: torch.Tensor, probes=()) -> torch.Tensor:
        dt, k = x.dtype, self.k
        flat = x.flatten(0, 1)  # [M, D]
        with _island(x):
            probs = torch.sigmoid(flat.float() @ self.router.float().mT)
            _, ids = torch.topk(probs + self.bias.float(), k, -1, sorted=False)
            w = torch.gather(probs, -1, ids)
            w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale  # [M, k]
        z = flat @ self.down.mT  # [M, L]
        if "token_order" in probes:
            y = self.in_token_order(z, ids)
        else:
            y = self.grouped(z, ids)
        with _island(x):
            if "combine_sum" in probes:
                u = (w.unsqueeze(-1) * y.float()).sum(1)
            else:
                u = torch.bmm(w.unsqueeze(1), y.float()).squeeze(1)  # [M, L]
        routed = self.norm(u, dt) @ self.up.mT
        return (routed + self.shared(flat)).view_as(x)

    def grouped(self, z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[M, k, L] expert outputs, computed over the pairs sorted by expert."""
        dt, k = z.dtype, self.k
        experts, order = torch.sort(ids.flatten(), stable=True)  # pairs grouped by expert
        zs = z[order // k].unsqueeze(-1)  # [P, L, 1]
        h = situ(torch.bmm(self.weight("w1", experts, dt), zs),
                 torch.bmm(self.weight("w3", experts, dt), zs), self.b1, self.b2, dt)
        y = torch.bmm(self.weight("w2", experts, dt), h).squeeze(-1)  # [P, L], expert order
        back = torch.argsort(order)
        return torch.gather(y, 0, back[:, None].expand(-1, y.shape[-1])).view(-1, k, y.shape[-1])

    def in_token_order(self, z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        dt = z.dtype
        hg = torch.einsum("nl,nkil->nki", z, self.weight("w1", ids, dt))
        hu = torch.einsum("nl,nkil->nki", z, self.weight("w3", ids, dt))
        return torch.einsum("nki,nkli->nkl", situ(hg, hu, self.b1, self.b2, dt),
                            self.weight("w2", ids, dt))


class Layer(nn.Module):
    def __init__(self, cfg, i: int, slots: int, max_len: int, dtype):
        super().__init__()
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.mla = i in cfg.full_attn_layers
        self.attn = MLA(cfg, slots, max_len, dtype) if self.mla else KDA(cfg, slots, dtype)
        self.ffn = MLP(D, cfg.intermediate_size, cfg) if i < cfg.first_k_dense_replace \
            else MoE(cfg)
        self.attn_mix, self.ffn_mix = Mix(D, eps), Mix(D, eps)
        self.attn_norm, self.ffn_norm = RMSNorm(D, eps), RMSNorm(D, eps)


class Spell11K3(nn.Module):
    def __init__(self, cfg, slots: int, max_len: int, dtype=torch.float32):
        super().__init__()
        self.cfg, self.compute_dtype = cfg, dtype
        self.block = cfg.attn_res_block_size
        self.embed = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Layer(cfg, i, slots, max_len, dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.out_mix = Mix(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.probes: set = set()

    def set_probe(self, *names: str) -> Spell11K3:
        unknown = set(names) - set(PROBES)
        if unknown:
            raise ValueError(f"unknown probes {sorted(unknown)}")
        self.probes = set(names)
        stored = getattr(self, "checkpoint_dtypes", {})
        for name, p in self.named_parameters():
            want = stored.get(name, p.dtype) if "checkpoint_weights" in names else torch.float32
            p.data = p.data.to(want)
        return self

    def forward(self, input_ids, positions, slots=None):
        if slots is None:
            slots = torch.arange(input_ids.shape[0], device=input_ids.device)
        bf16 = self.compute_dtype != torch.float32 and "checkpoint_weights" not in self.probes
        with torch.autocast(device_type=input_ids.device.type, dtype=self.compute_dtype,
                            enabled=bf16):
            logits = self.step(input_ids.view(input_ids.shape[0], -1), positions, slots)
        return logits.view(*input_ids.shape, -1)

    def step(self, ids, positions, slots):
        dt, probes = self.compute_dtype, self.probes
        prefix = F.embedding(ids, self.embed).to(dt)  # [B, T, D]
        bank = prefix.new_empty(*prefix.shape[:2], 0, prefix.shape[-1])
        delta = None
        for i, layer in enumerate(self.layers):
            write = i % self.block == 0
            if delta is not None:
                prefix = prefix + delta
            if write:
                bank = torch.cat([bank, prefix.unsqueeze(-2)], -2)
            n = -(-i // self.block)
            x = layer.attn_norm(layer.attn_mix(bank[..., :n, :], prefix, probes))
            a = layer.attn(x, positions, slots, probes) if layer.mla else \
                layer.attn(x, slots, probes)
            prefix = a if write else prefix + a
            h = layer.ffn_mix(bank[..., :n + write, :], prefix, probes)
            delta = layer.ffn(layer.ffn_norm(h)) if isinstance(layer.ffn, MLP) else \
                layer.ffn(layer.ffn_norm(h), probes)
        prefix = prefix + delta
        h = self.norm(self.out_mix(bank, prefix, probes))
        return h @ self.head.mT


_ATTN = {"q_a": "q_a_proj.weight", "q_norm.weight": "q_a_layernorm.weight",
         "q_b": "q_b_proj.weight", "kv_a": "kv_a_proj_with_mqa.weight",
         "kv_norm.weight": "kv_a_layernorm.weight", "kv_b": "kv_b_proj.weight",
         "gate": "g_proj.weight", "out": "o_proj.weight", "f_a": "f_a_proj.weight",
         "f_b": "f_b_proj.weight", "beta": "b_proj.weight", "dt_bias": "dt_bias",
         "A_log": "A_log", "out_norm.weight": "o_norm.weight"}
_MLP = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}
_MOE = {"router": "gate.weight", "bias": "gate.e_score_correction_bias",
        "down": "routed_expert_down_proj.weight", "norm.weight": "routed_expert_norm.weight",
        "up": "routed_expert_up_proj.weight",
        **{f"shared.{k}": f"shared_experts.{v}" for k, v in _MLP.items()},
        **{f"{w}_{a}": f"experts.{w}_{b}" for w in ("w1", "w2", "w3")
           for a, b in (("q", "packed"), ("e", "scale"))}}
_LAYER = {"attn_mix.norm": "self_attention_res_norm.weight",
          "attn_mix.proj": "self_attention_res_proj.weight",
          "ffn_mix.norm": "mlp_res_norm.weight", "ffn_mix.proj": "mlp_res_proj.weight",
          "attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_TOP = {"embed": "embed_tokens.weight", "out_mix.norm": "output_attn_res_norm.weight",
        "out_mix.proj": "output_attn_res_proj.weight", "norm.weight": "norm.weight"}
_STATES = {"attn.conv": "self_attn.conv_state", "attn.state": "self_attn.recurrent_state",
           "attn.cache": "self_attn.kv_cache"}
_PREFIX = "language_model.model."


def from_builtin(model) -> Spell11K3:
    """A Spell11K3 holding `model`'s (k3compile.models.build_model) weights and states: fp32
    masters of its weights, its states as they are, the compute dtype its own."""
    cfg = model.config if hasattr(model, "config") else model.cfg
    sd = {**model.state_dict(), **dict(model.named_buffers())}
    dtype = sd[_PREFIX + "embed_tokens.weight"].dtype
    conv = next(t for n, t in sd.items() if n.endswith("conv_state"))
    cache = next(t for n, t in sd.items() if n.endswith("kv_cache"))
    spelled = Spell11K3(cfg, conv.shape[0], cache.shape[1], dtype)
    ours = {}
    for name, t in spelled.state_dict().items():
        i = name.split(".")[1] if name.startswith("layers.") else None
        base = f"{_PREFIX}layers.{i}."
        if name.endswith("attn.qkvg"):
            ours[name] = torch.cat([sd[base + f"self_attn.{p}_proj.weight"] for p in "qkvg"])
        elif name.endswith("attn.taps"):
            ours[name] = torch.cat([sd[base + f"self_attn.{p}_conv1d.weight"][:, 0]
                                    for p in "qkv"])
        elif name.endswith("attn.A_log"):
            ours[name] = sd[base + "self_attn.A_log"][: t.shape[0]]
        elif i is not None and ".ffn." in name:
            leaf = name.split(".ffn.", 1)[1]
            dense = base + "mlp.gate_proj.weight" in sd
            ours[name] = sd[base + "mlp." + (_MLP if dense else _MOE)[leaf]]
        else:
            ours[name] = sd[_name(name)]
    spelled.load_state_dict(ours)  # copy_ upcasts a bf16 checkpoint to the fp32 masters
    spelled.checkpoint_dtypes = {n: ours[n].dtype for n, _ in spelled.named_parameters()}
    return spelled


def _name(name: str) -> str:
    if name == "head":
        return "language_model.lm_head.weight"
    if name in _TOP:
        return _PREFIX + _TOP[name]
    _, i, rest = name.split(".", 2)
    base = f"{_PREFIX}layers.{i}."
    if rest in _LAYER:
        return base + _LAYER[rest]
    if rest in _STATES:
        return base + _STATES[rest]
    return base + "self_attn." + _ATTN[rest.split(".", 1)[1]]


def state_of(model: Spell11K3) -> dict:
    """The states under the built-in model's names and layouts."""
    return {_name(f"layers.{i}.{n}"): b for i, layer in enumerate(model.layers)
            for n, b in layer.named_buffers() if n in _STATES}
