"""A third Kimi K3 decode step, written blind from the architecture notes (shared/k3_arch.md) as
user code: nothing here imports k3compile or follows its model's spellings.

step(input_ids [B] or [B, T], positions [B], slots [B]) -> logits [B, V] or [B, T, V]

Per layer (AttnRes, no residual stream): prefix += delta; bank write at block starts; depth mix;
RMSNorm; KDA or gated MLA; prefix reset/add; depth mix; RMSNorm; dense SiTU MLP (layer 0) or
Stable LatentMoE (MXFP4 experts). State lives in per-slot buffers (conv window, KDA recurrent
state, MLA latent cache); the last slot row is spare (a batch padded by a serving layer may use it).

Spellings chosen on purpose (all faithful to the spec's math):
  * embedding by `index_select` on the weight; RMSNorm by `F.rms_norm` in fp32;
  * KDA q|k|v as one `nn.Linear` split by `chunk`, g by `x @ W.T`, f_a/f_b as an `nn.Sequential`,
    b by `einsum`; the short conv as `unfold` + `einsum` over a history `cat`; conv state written
    by `tensor[slots] = ...`, recurrent state gathered by `index_select`, stepped by `einsum`s, written
    by `index_copy_`; l2 norm with the eps inside the sqrt, written by hand; decay per head by a
    [H, 1] broadcast of exp(A_log);
  * MLA absorbed, DeepSeek-inference style: W_UK / W_UV as views of kv_b's weight used in `einsum`,
    scores as two terms (latent part + rope part) over one [slots, L, 576] cache, masked with
    `torch.where`, softmax in fp32; cache written by two-index assignment;
  * depth mix by `torch.stack` over a Python list bank, scores by a `@` with the [1, D] pseudo
    query, softmax over dim 1;
  * MoE: router `F.linear` in fp32, `topk` then `gather`, experts as stacked uint8 buffers gathered
    per token (`w1_packed[idx]`), dequantised by nibble arithmetic + `torch.where` + `exp2`,
    expert GEMMs as `einsum`; shared gate|up as one Linear split by `view(..., 2, I).unbind`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class BlindConfig:
    vocab: int = 512
    hidden: int = 128
    layers: int = 4
    block: int = 2  # AttnRes block size (layers)
    mla_layers: tuple[int, ...] = (2, 3)  # 0-based; the last layer is MLA as in K3
    dense_layers: tuple[int, ...] = (0,)
    dense_inter: int = 256
    eps: float = 1e-5
    # KDA
    kda_heads: int = 2
    kda_dim: int = 32
    conv: int = 4
    lower_bound: float = -5.0
    # MLA
    mla_heads: int = 2
    q_rank: int = 64
    kv_rank: int = 32
    nope: int = 32
    rope: int = 16
    v_dim: int = 32
    mla_eps: float = 1e-6
    # MoE
    experts: int = 8
    topk: int = 2
    expert_inter: int = 64
    latent: int = 64
    shared_inter: int = 128  # the shared experts, fused into one MLP
    scaling: float = 1.0
    beta1: float = 4.0
    beta2: float = 25.0


def situ(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """SiTU-GLU in fp32, result in the input dtype."""
    gf, uf = g.float(), u.float()
    out = (b1 * torch.tanh(gf / b1)) * torch.sigmoid(gf) * (b2 * torch.tanh(uf / b2))
    return out.to(g.dtype)


class Norm(nn.Module):
    """RMSNorm: normalise in fp32, cast back, scale by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return y.to(x.dtype) * self.scale


def e2m1_e8m0(packed: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """MXFP4 dequant: packed [..., out, in/2] (low nibble first), scales [..., out, in/32] E8M0."""
    lo = packed & 0x0F
    hi = packed >> 4
    nib = torch.stack((lo, hi), dim=-1).flatten(-2).to(torch.int32)  # [..., out, in]
    sign = 1.0 - 2.0 * ((nib >> 3) & 1).float()
    e = ((nib >> 1) & 3).float()
    m = (nib & 1).float()
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2(e - 1.0))
    s = torch.exp2(scales.float() - 127.0).repeat_interleave(32, dim=-1)
    return (sign * mag * s).to(dtype)


class DepthMix(nn.Module):
    """Attention over depth: softmax of the pseudo-query's score of each RMS-normalised source,
    mixing the raw sources in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.res_norm = nn.Parameter(torch.ones(dim))
        self.res_proj = nn.Linear(dim, 1, bias=False)

    def forward(self, prefix, bank):
        if not bank:
            return prefix
        src = torch.stack(list(bank) + [prefix], dim=1).float()  # [N, S, D]
        inv = torch.rsqrt(src.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        q = (self.res_norm.float() * self.res_proj.weight.float()[0]).unsqueeze(-1)  # [D, 1]
        score = (src * inv) @ q  # [N, S, 1]
        alpha = torch.softmax(score, dim=1)
        return (alpha * src).sum(dim=1).to(prefix.dtype)


class KDA(nn.Module):
    def __init__(self, c: BlindConfig, slots: int):
        super().__init__()
        H, K = c.kda_heads, c.kda_dim
        self.c, self.H, self.K = c, H, K
        width = H * K
        self.qkv = nn.Linear(c.hidden, 3 * width, bias=False)
        self.gate_w = nn.Parameter(torch.empty(width, c.hidden))
        self.decay = nn.Sequential(nn.Linear(c.hidden, K, bias=False), nn.Linear(K, width, bias=False))
        self.beta_w = nn.Parameter(torch.empty(H, c.hidden))
        self.conv_w = nn.Parameter(torch.empty(3 * width, c.conv))  # depthwise taps, oldest first
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.out_norm = nn.Parameter(torch.ones(K))
        self.out = nn.Linear(width, c.hidden, bias=False)
        self.register_buffer("conv_cache", torch.zeros(slots, 3 * width, c.conv - 1))
        self.register_buffer("rec_state", torch.zeros(slots, H, K, K, dtype=torch.float32))

    def forward(self, x, slots):  # x [B, T, D]
        B, T, _ = x.shape
        H, K, c = self.H, self.K, self.c
        mixed = self.qkv(x)  # [B, T, 3HK]
        g_out = x @ self.gate_w.T
        graw = self.decay(x)
        b = torch.einsum("btd,hd->bth", x, self.beta_w)

        # short conv + SiLU over [3 old, T new] inputs, channel-wise
        hist = torch.cat([self.conv_cache[slots], mixed.transpose(1, 2)], dim=-1)  # [B, C, 3+T]
        win = hist.unfold(-1, c.conv, 1)  # [B, C, T, 4]
        conv = torch.einsum("bctk,ck->btc", win, self.conv_w)
        conv = conv * torch.sigmoid(conv)
        self.conv_cache[slots] = hist[..., T:]
        q, k, v = conv.chunk(3, dim=-1)
        q = q.reshape(B, T, H, K).float()
        k = k.reshape(B, T, H, K).float()
        v = v.reshape(B, T, H, K).float()
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * (K ** -0.5)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)

        rate = self.A_log.float().exp().view(H, 1)
        pre = (graw.float() + self.dt_bias.float()).view(B, T, H, K)
        alpha = torch.exp(c.lower_bound * torch.sigmoid(rate * pre))  # [B, T, H, K]
        beta = torch.sigmoid(b.float())  # [B, T, H]

        S = self.rec_state.index_select(0, slots)  # [B, H, K, V]
        outs = []
        for t in range(T):
            S = S * alpha[:, t].unsqueeze(-1)
            pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
            u = beta[:, t].unsqueeze(-1) * (v[:, t] - pred)
            S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        self.rec_state.index_copy_(0, slots, S)
        o = torch.stack(outs, dim=1)  # [B, T, H, V] fp32

        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.eps)
        o = o.to(x.dtype) * self.out_norm
        o = o * torch.sigmoid(g_out.view(B, T, H, K))
        return self.out(o.flatten(2))


class GatedMLA(nn.Module):
    def __init__(self, c: BlindConfig, slots: int, max_len: int):
        super().__init__()
        self.c = c
        H = c.mla_heads
        self.q_down = nn.Linear(c.hidden, c.q_rank, bias=False)
        self.q_norm = Norm(c.q_rank, c.mla_eps)
        self.q_up = nn.Linear(c.q_rank, H * (c.nope + c.rope), bias=False)
        self.kv_down = nn.Linear(c.hidden, c.kv_rank + c.rope, bias=False)
        self.kv_norm = Norm(c.kv_rank, c.mla_eps)
        self.kv_up = nn.Linear(c.kv_rank, H * (c.nope + c.v_dim), bias=False)
        self.gate = nn.Linear(c.hidden, H * c.v_dim, bias=False)
        self.out = nn.Linear(H * c.v_dim, c.hidden, bias=False)
        self.register_buffer("latent_cache", torch.zeros(slots, max_len, c.kv_rank + c.rope))

    def forward(self, x, positions, slots):  # x [B, T, D]
        c = self.c
        B, T, _ = x.shape
        H, R = c.mla_heads, c.kv_rank
        q = self.q_up(self.q_norm(self.q_down(x))).view(B, T, H, c.nope + c.rope)
        q_nope, q_pe = q[..., :c.nope], q[..., c.nope:]
        kv = self.kv_down(x)
        latent = torch.cat([self.kv_norm(kv[..., :R]), kv[..., R:]], dim=-1)  # NoPE: no rotation

        pos = positions.unsqueeze(1) + torch.arange(T, device=x.device)  # [B, T]
        self.latent_cache[slots.unsqueeze(1), pos] = latent
        cache = self.latent_cache[slots]  # [B, L, R + rope]

        w = self.kv_up.weight.view(H, c.nope + c.v_dim, R)
        w_uk, w_uv = w[:, :c.nope], w[:, c.nope:]
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)
        scores = (torch.einsum("bthr,blr->bthl", q_lat, cache[..., :R])
                  + torch.einsum("bthe,ble->bthl", q_pe, cache[..., R:]))
        scores = scores * (c.nope + c.rope) ** -0.5
        keys = torch.arange(cache.shape[1], device=x.device)
        visible = keys.view(1, 1, 1, -1) <= pos.view(B, T, 1, 1)
        scores = torch.where(visible, scores, torch.full_like(scores, float("-inf")))
        probs = scores.float().softmax(dim=-1).to(x.dtype)
        ctx = torch.einsum("bthl,blr->bthr", probs, cache[..., :R])
        o = torch.einsum("bthr,hvr->bthv", ctx, w_uv).reshape(B, T, H * c.v_dim)
        o = o * torch.sigmoid(self.gate(x))
        return self.out(o)


class DenseMLP(nn.Module):
    def __init__(self, c: BlindConfig):
        super().__init__()
        self.c = c
        self.gate = nn.Linear(c.hidden, c.dense_inter, bias=False)
        self.up = nn.Linear(c.hidden, c.dense_inter, bias=False)
        self.down = nn.Linear(c.dense_inter, c.hidden, bias=False)

    def forward(self, x):
        return self.down(situ(self.gate(x), self.up(x), self.c.beta1, self.c.beta2))


class LatentMoE(nn.Module):
    def __init__(self, c: BlindConfig):
        super().__init__()
        self.c = c
        E, I, L = c.experts, c.expert_inter, c.latent
        self.router = nn.Parameter(torch.empty(E, c.hidden))
        self.register_buffer("router_bias", torch.zeros(E, dtype=torch.float32))
        self.to_latent = nn.Linear(c.hidden, L, bias=False)
        self.latent_norm = Norm(L, c.eps)
        self.from_latent = nn.Linear(L, c.hidden, bias=False)
        self.register_buffer("w1_packed", torch.zeros(E, I, L // 2, dtype=torch.uint8))
        self.register_buffer("w1_scale", torch.zeros(E, I, L // 32, dtype=torch.uint8))
        self.register_buffer("w3_packed", torch.zeros(E, I, L // 2, dtype=torch.uint8))
        self.register_buffer("w3_scale", torch.zeros(E, I, L // 32, dtype=torch.uint8))
        self.register_buffer("w2_packed", torch.zeros(E, L, I // 2, dtype=torch.uint8))
        self.register_buffer("w2_scale", torch.zeros(E, L, I // 32, dtype=torch.uint8))
        self.shared_gate_up = nn.Linear(c.hidden, 2 * c.shared_inter, bias=False)
        self.shared_down = nn.Linear(c.shared_inter, c.hidden, bias=False)

    def forward(self, x):  # x [N, D]
        c = self.c
        N = x.shape[0]
        probs = torch.sigmoid(F.linear(x.float(), self.router.float()))
        _, idx = torch.topk(probs + self.router_bias, c.topk, dim=-1)
        wts = probs.gather(-1, idx)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * c.scaling

        z = self.to_latent(x)  # [N, L]
        w1 = e2m1_e8m0(self.w1_packed[idx], self.w1_scale[idx], x.dtype)  # [N, k, I, L]
        w3 = e2m1_e8m0(self.w3_packed[idx], self.w3_scale[idx], x.dtype)
        w2 = e2m1_e8m0(self.w2_packed[idx], self.w2_scale[idx], x.dtype)  # [N, k, L, I]
        act = situ(torch.einsum("nl,nkil->nki", z, w1), torch.einsum("nl,nkil->nki", z, w3),
                   c.beta1, c.beta2)
        y = torch.einsum("nki,nkli->nkl", act, w2)
        mixed = (wts.unsqueeze(-1) * y.float()).sum(dim=1).to(x.dtype)
        routed = self.from_latent(self.latent_norm(mixed))

        g, u = self.shared_gate_up(x).view(N, 2, c.shared_inter).unbind(1)
        return routed + self.shared_down(situ(g, u, c.beta1, c.beta2))


class Layer(nn.Module):
    def __init__(self, c: BlindConfig, i: int, slots: int, max_len: int):
        super().__init__()
        self.i = i
        self.mla = i in c.mla_layers
        self.pre_mix = DepthMix(c.hidden, c.eps)
        self.pre_norm = Norm(c.hidden, c.eps)
        self.mixer = GatedMLA(c, slots, max_len) if self.mla else KDA(c, slots)
        self.post_mix = DepthMix(c.hidden, c.eps)
        self.post_norm = Norm(c.hidden, c.eps)
        self.ffn = DenseMLP(c) if i in c.dense_layers else LatentMoE(c)


class BlindK3(nn.Module):
    def __init__(self, c: BlindConfig | None = None, max_batch: int = 8, max_len: int = 64):
        super().__init__()
        c = c or BlindConfig()
        self.c = c
        slots = max_batch + 1  # the last row is spare
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Layer(c, i, slots, max_len) for i in range(c.layers))
        self.final_mix = DepthMix(c.hidden, c.eps)
        self.final_norm = Norm(c.hidden, c.eps)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(("scale", "res_norm", "out_norm")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("conv_w"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        for name, b in self.named_buffers():
            if name.endswith("_packed"):
                b.copy_(torch.randint(0, 256, b.shape, generator=gen, dtype=torch.uint8))
            elif name.endswith("_scale"):
                # E8M0 around 2^-3: with |e2m1| <= 6 the expert weights stay O(1/sqrt(in))
                b.copy_(torch.randint(122, 125, b.shape, generator=gen, dtype=torch.uint8))
            elif name.endswith("router_bias"):
                b.copy_(2.0 * torch.randperm(b.numel(), generator=gen).float())  # routing by margin
        return self

    def reset(self):
        for name, b in self.named_buffers():
            if name.endswith(("conv_cache", "rec_state", "latent_cache")):
                b.zero_()

    def forward(self, input_ids, positions, slots):
        squeeze = input_ids.dim() == 1
        ids = input_ids.unsqueeze(1) if squeeze else input_ids  # [B, T]
        B, T = ids.shape
        c = self.c
        emb = self.embed.weight.index_select(0, ids.reshape(-1)).view(B, T, c.hidden)

        prefix, delta, bank = emb, None, []
        for layer in self.layers:
            i = layer.i
            starts = i % c.block == 0
            n = -(-i // c.block)
            if delta is not None:
                prefix = prefix + delta
            if starts:
                bank.append(prefix)
            x = layer.pre_norm(layer.pre_mix(prefix, bank[:n]))
            a = layer.mixer(x, positions, slots) if layer.mla else layer.mixer(x, slots)
            prefix = a if starts else prefix + a
            x2 = layer.post_norm(layer.post_mix(prefix, bank[:n + starts]))
            delta = layer.ffn(x2.reshape(B * T, c.hidden)).view(B, T, c.hidden)
        prefix = prefix + delta
        h = self.final_mix(prefix, bank)
        logits = self.head(self.final_norm(h))
        return logits[:, 0] if squeeze else logits


def build_blind(c: BlindConfig | None = None, dtype=torch.float32, max_batch: int = 8,
                max_len: int = 64, seed: int = 0) -> BlindK3:
    """The model in `dtype`; the KDA recurrent state and the router bias stay fp32."""
    model = BlindK3(c, max_batch, max_len).init_weights(seed).to(dtype)
    for m in model.modules():
        if isinstance(m, KDA):
            m.rec_state = m.rec_state.float()
        if isinstance(m, LatentMoE):
            m.router_bias = m.router_bias.float()
    return model
