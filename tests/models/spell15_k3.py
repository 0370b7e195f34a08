"""A fifteenth spelling of Kimi K3's decode step, written blind (session 42) from
`shared/k3_arch.md` in the style of code written to export cleanly (ONNX / TensorRT-LLM-minded):
only ops an exporter maps one to one, weights transposed once at load, every state update out of
place and copied into its buffer at the end of the step. It loads the built-in model's state dict
through a name map (`from_builtin`) and decodes single tokens ([B] ids) and T verify rows
([B, T] ids).

Blind-phase rules kept: before the blind commit its author read only the spec
(`shared/k3_arch.md`), README.md, the harness `tests/spellings/foreign.py`,
`tests/e2e/test_spell14_spelling.py`, the first 60 lines of `tests/models/spell14_k3.py` (the
interface) and the built-in model's printed state-dict names; no model, math, pattern or
canonical code of the project, no other spelling's model code, no Moonshot code.
The blind spelling (d3645b6) is the step with no probe on; `PROBES` and `set_probe` were added
after it, to bisect the lost fusions (docs/spell15_spelling.md), each another spelling of the
same math.

Idioms (an exporter's, with the porter's own choices):

* **Weights stored [in, out]**, transposed once at load, applied by `torch.matmul(x, w)`; the
  projections TensorRT-LLM fuses are concatenated at load: KDA q|k|v|g|f_a|b, MLA q_a|kv_a, the
  gate|up of the shared experts and of the dense MLP (split after the GEMM); the three conv tap
  tensors as one [3C, 1, 4] weight. W_UK / W_UV as [H, N, C] / [H, C, V] slices of kv_b made at
  load. The AttnRes pseudo-query `res_proj` as a [D, 1] matmul.
* **No einsum**: `matmul` / `bmm` with explicit transposes and reshapes.
* **Written-out math**: RMSNorm `x * rsqrt(mean(x * x) + eps)` in fp32, cast, times the weight;
  softmax as `exp(s - amax(s)) / sum` (fp32); SiLU as `x * sigmoid(x)`; l2 norm by `rsqrt(sum)`.
* **Additive float masks**: MLA's causal mask as `where(arange(L) <= pos, 0, finfo.min)` added to
  the fp32 scores.
* **Gathers, not fancy indexing**: embedding and state rows by `index_select`, the E2M1 values by
  `index_select` on a flat LUT, the unbiased router weights by `torch.gather`, the experts' packed
  bytes by `index_select` over the flattened top-k ids.
* **Out-of-place states**: conv and recurrent states gathered by slot, updated, written back by
  `scatter` over the slot rows; the MLA latent block gathered by slot, each new row put in by
  `where` over a one-hot of its position, the block scattered back; every new buffer is
  `copy_`ed into its state at the end of the step.
* KDA's short conv as `F.conv1d(groups=3C)` over `cat([state, new])` (ONNX Conv); the delta rule
  per token as `matmul`s of [.., 1, K] / [.., K, 1] views.
* Routed experts: top-k by `torch.topk` of sigmoid + bias, weights renormalised by hand; the
  selected experts dequantised flat (nibbles by `bitwise_and` / `bitwise_right_shift`, scales by
  `pow(2, s - 127)`), per-token GEMMs by `bmm`, combined by a [N, 1, k] x [N, k, L] fp32 matmul.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# probe -> the other spelling of the same math it switches to (bisecting a lost fusion)
PROBES = {
    "outer": "KDA's rank-1 update k uᵀ as a broadcast product, not a [K, 1] x [1, V] matmul",
    "rows": "the attention projections on [B·T, D] rows, viewed back to [B, T, ...] after",
    "separate": "q, k, v, g, f_a, b (and q_a, kv_a) as separate [in, out] weights, not concatenated",
    "lut": "the E2M1 values by `lut[codes]`, not `index_select` on the flattened codes",
    "cache_put": "the MLA rows written by `index_put` into the whole cache, the block read after",
    "bool_mask": "MLA's causal mask by `masked_fill(~causal, -inf)`, not an additive finfo.min",
    "mla_rows": "MLA's q_a|kv_a GEMM and its two norms on [B·T, D] rows, viewed to [B, T, ...] after",
    "kv_b": "W_UK / W_UV as views of kv_b's [H·(N + V), C] weight in the step, not parameters cut at load",
    "grid": "the verify rows' positions `positions.view(B, 1) + arange(T)`, not `arange(T).view(1, T)`",
    "pv_tokens": "p·c on p [B, T, H, L] (tokens first), transposed back to heads first after",
    "pairs": "the picked experts viewed [N, k, O, I], per-pair GEMMs by `matmul` of z [N, 1, L, 1]",
    "oproj_rows": "o_proj on [B·T, C] rows (the attention output returned flat)",
    "softmax": "MLA's softmax by `torch.softmax`, not written out",
    "shift": "the nibbles by the operators `p & 15`, `p >> 4`, not `bitwise_and` / `bitwise_right_shift`",
    "combine": "the experts combined by `(w[..., None] * y).sum(1)` in fp32, not a [N, 1, k] matmul",
}
_BUILTIN = "language_model.model."


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def softmax(s: Tensor, dim: int) -> Tensor:
    e = torch.exp(s - torch.amax(s, dim=dim, keepdim=True))
    return e / torch.sum(e, dim=dim, keepdim=True)


def situ(g: Tensor, u: Tensor, b1: float, b2: float) -> Tensor:
    gf, uf = g.float(), u.float()
    return (b1 * torch.tanh(gf / b1) * torch.sigmoid(gf) * (b2 * torch.tanh(uf / b2))).to(g.dtype)


def project(x: Tensor, fused: Tensor, parts, sizes: list[int], probes) -> list[Tensor]:
    """x [B, T, D] through the GEMM of weights concatenated at load, split after it."""
    B, T, D = x.shape
    xr = x.reshape(B * T, D) if "rows" in probes else x
    if "separate" in probes:
        ys = [torch.matmul(xr, w) for w in parts]
    else:
        ys = torch.split(torch.matmul(xr, fused), sizes, dim=-1)
    return [y.reshape(B, T, -1) for y in ys] if "rows" in probes else list(ys)


def frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


def scatter_rows(buf: Tensor, slots: Tensor, rows: Tensor) -> Tensor:
    """`buf` with rows `slots` replaced by `rows`, out of place (ONNX ScatterElements)."""
    index = slots.view(-1, *([1] * (buf.dim() - 1))).expand(rows.shape)
    return torch.scatter(buf, 0, index, rows.to(buf.dtype))


class Module(nn.Module):
    probes: set[str] = frozenset()


class DepthMix(Module):
    """AttnRes: softmax over depth of the sources' RMS-normed scores against a pseudo-query."""

    def __init__(self, norm_w: Tensor, proj_w: Tensor, eps: float):
        super().__init__()
        self.norm_w, self.proj_w, self.eps = frozen(norm_w), frozen(proj_w.t()), eps  # [D, 1]

    def forward(self, prefix: Tensor, blocks: list[Tensor]) -> Tensor:
        if not blocks:
            return prefix
        v = torch.stack(blocks + [prefix], dim=-2).float()  # [N, n + 1, D]
        normed = v * torch.rsqrt(torch.mean(v * v, dim=-1, keepdim=True) + self.eps)
        scores = torch.matmul(normed * self.norm_w.float(), self.proj_w.float())  # [N, n + 1, 1]
        alpha = softmax(scores, dim=-2)
        mixed = torch.matmul(alpha.transpose(-1, -2), v)  # [N, 1, D]
        return mixed.squeeze(-2).to(prefix.dtype)


class KDA(Module):
    def __init__(self, sd: dict, p: str, cfg, conv_state: Tensor, rec_state: Tensor):
        super().__init__()
        self.H, self.K = cfg.kda_num_heads, cfg.kda_head_dim
        self.C, self.r = self.H * self.K, sd[p + "f_a_proj.weight"].shape[0]
        self.eps, self.l2eps, self.bound = cfg.rms_norm_eps, cfg.l2norm_eps, cfg.gate_lower_bound
        names = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")
        self.w_in = frozen(torch.cat([sd[p + n + ".weight"] for n in names], 0).t())
        self.w_parts = nn.ParameterList(frozen(sd[p + n + ".weight"].t()) for n in names)
        self.w_fb = frozen(sd[p + "f_b_proj.weight"].t())
        self.w_o = frozen(sd[p + "o_proj.weight"].t())
        self.taps = frozen(torch.cat([sd[p + f"{n}_conv1d.weight"] for n in "qkv"], 0))
        self.dt_bias = frozen(sd[p + "dt_bias"])
        self.a_log = frozen(sd[p + "A_log"][: self.H])
        self.o_norm = frozen(sd[p + "o_norm.weight"])
        self.register_buffer("conv_state", conv_state.clone())
        self.register_buffer("recurrent_state", rec_state.clone())

    def forward(self, x: Tensor, slots: Tensor) -> tuple[Tensor, list[Tensor]]:
        B, T, _ = x.shape
        H, K, C = self.H, self.K, self.C
        q, k, v, g2, fa, b = project(x, self.w_in, self.w_parts, [C, C, C, C, self.r, H],
                                     self.probes)
        graw = torch.matmul(fa, self.w_fb)
        window = torch.cat([torch.index_select(self.conv_state, 0, slots).to(x.dtype),
                            torch.cat([q, k, v], -1).transpose(1, 2)], dim=-1)  # [B, 3C, 3 + T]
        y = F.conv1d(window, self.taps, groups=3 * C)  # [B, 3C, T]
        y = (y * torch.sigmoid(y)).transpose(1, 2).float()
        q, k, v = (t.reshape(B, T, H, K) for t in torch.split(y, [C, C, C], dim=-1))
        q = q * torch.rsqrt(torch.sum(q * q, -1, keepdim=True) + self.l2eps) * K ** -0.5
        k = k * torch.rsqrt(torch.sum(k * k, -1, keepdim=True) + self.l2eps)
        gate = torch.exp(self.a_log.float()).view(1, 1, H, 1) * (
            graw.float() + self.dt_bias.float()).view(B, T, H, K)
        alpha = torch.exp(self.bound * torch.sigmoid(gate))  # [B, T, H, K]
        beta = torch.sigmoid(b.float())  # [B, T, H]
        state = torch.index_select(self.recurrent_state, 0, slots)  # [B, H, K, V]
        outs = []
        for t in range(T):
            kt = k[:, t].unsqueeze(-2)  # [B, H, 1, K]
            state = state * alpha[:, t].unsqueeze(-1)
            u = beta[:, t, :, None, None] * (v[:, t].unsqueeze(-2) - torch.matmul(kt, state))
            if "outer" in self.probes:
                state = state + kt.transpose(-1, -2) * u
            else:
                state = state + torch.matmul(kt.transpose(-1, -2), u)
            outs.append(torch.matmul(q[:, t].unsqueeze(-2), state))  # [B, H, 1, V]
        o = torch.cat(outs, dim=-2).transpose(1, 2)  # [B, T, H, V]
        o = rms_norm(o.to(x.dtype), self.o_norm, self.eps)
        o = o * torch.sigmoid(g2.view(B, T, H, K))
        a = (torch.matmul(o.reshape(B * T, C), self.w_o) if "oproj_rows" in self.probes else
             torch.matmul(o.reshape(B, T, C), self.w_o))
        new_conv = scatter_rows(self.conv_state, slots, window[..., T:])
        new_rec = scatter_rows(self.recurrent_state, slots, state)
        return a, [new_conv, new_rec]


class GatedMLA(Module):
    def __init__(self, sd: dict, p: str, cfg, kv_cache: Tensor):
        super().__init__()
        self.H, self.N, self.R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.C, self.V, self.eps = cfg.kv_lora_rank, cfg.v_head_dim, cfg.mla_norm_eps
        self.qr = sd[p + "q_a_proj.weight"].shape[0]
        names = ("q_a_proj", "kv_a_proj_with_mqa")
        self.w_a = frozen(torch.cat([sd[p + n + ".weight"] for n in names], 0).t())
        self.w_parts = nn.ParameterList(frozen(sd[p + n + ".weight"].t()) for n in names)
        self.q_a_norm = frozen(sd[p + "q_a_layernorm.weight"])
        self.kv_a_norm = frozen(sd[p + "kv_a_layernorm.weight"])
        self.w_qb = frozen(sd[p + "q_b_proj.weight"].t())
        kv_b = sd[p + "kv_b_proj.weight"].view(self.H, self.N + self.V, self.C)
        self.w_uk = frozen(kv_b[:, : self.N])  # [H, N, C]
        self.w_uv = frozen(kv_b[:, self.N:].transpose(1, 2))  # [H, C, V]
        self.w_kvb = frozen(sd[p + "kv_b_proj.weight"])
        self.w_g = frozen(sd[p + "g_proj.weight"].t())
        self.w_o = frozen(sd[p + "o_proj.weight"].t())
        self.scale = 1.0 / math.sqrt(self.N + self.R)
        self.register_buffer("kv_cache", kv_cache.clone())

    def forward(self, x: Tensor, positions: Tensor, slots: Tensor) -> tuple[Tensor, list[Tensor]]:
        B, T, _ = x.shape
        H, N, R, C = self.H, self.N, self.R, self.C
        if "mla_rows" in self.probes:
            xa = x.reshape(B * T, -1)
            cq, ckv = torch.split(torch.matmul(xa, self.w_a), [self.qr, C + R], dim=-1)
        else:
            cq, ckv = project(x, self.w_a, self.w_parts, [self.qr, C + R], self.probes)
        cq = rms_norm(cq, self.q_a_norm, self.eps)
        rows = torch.cat([rms_norm(ckv[..., :C], self.kv_a_norm, self.eps), ckv[..., C:]], -1)
        if "mla_rows" in self.probes:
            cq, rows = cq.view(B, T, -1), rows.view(B, T, -1)
        q = torch.matmul(cq, self.w_qb).view(B, T, H, N + R).transpose(1, 2)  # [B, H, T, N + R]
        w_uk, w_uv = self.w_uk, self.w_uv
        if "kv_b" in self.probes:
            kv_b = self.w_kvb.view(H, N + self.V, C)
            w_uk, w_uv = kv_b[:, :N], kv_b[:, N:].transpose(1, 2)
        q_lat = torch.matmul(q[..., :N], w_uk)  # [B, H, T, C]
        q_full = torch.cat([q_lat, q[..., N:]], dim=-1)
        L = self.kv_cache.shape[1]
        steps = torch.arange(T, device=x.device)
        pos = positions.view(B, 1) + (steps if "grid" in self.probes else steps.view(1, T))
        col = torch.arange(L, device=x.device)
        if "cache_put" in self.probes:
            cache = torch.index_put(self.kv_cache, (slots.view(B, 1).expand(B, T), pos),
                                    rows.to(self.kv_cache.dtype))
            block = torch.index_select(cache, 0, slots)
        else:
            block = torch.index_select(self.kv_cache, 0, slots)  # [B, L, C + R]
            for t in range(T):
                hit = (col.view(1, L) == pos[:, t:t + 1]).unsqueeze(-1)  # [B, L, 1]
                block = torch.where(hit, rows[:, t:t + 1].to(block.dtype), block)
            cache = scatter_rows(self.kv_cache, slots, block)
        kv = block.to(x.dtype).unsqueeze(1)  # [B, 1, L, C + R]
        scores = torch.matmul(q_full, kv.transpose(-1, -2)).float() * self.scale  # [B, H, T, L]
        causal = col.view(1, 1, L) <= pos.unsqueeze(-1)  # [B, T, L]
        if "bool_mask" in self.probes:
            scores = scores.masked_fill(~causal.unsqueeze(1), float("-inf"))
        else:
            scores = scores + torch.where(causal, 0.0, torch.finfo(torch.float32).min).unsqueeze(1)
        p = (torch.softmax(scores, dim=-1) if "softmax" in self.probes else
             softmax(scores, dim=-1)).to(x.dtype)
        if "pv_tokens" in self.probes:
            o_lat = torch.matmul(p.transpose(1, 2), kv[..., :C]).transpose(1, 2)
        else:
            o_lat = torch.matmul(p, kv[..., :C])  # [B, H, T, C]
        o = torch.matmul(o_lat, w_uv).transpose(1, 2).reshape(B, T, H * self.V)
        o = o * torch.sigmoid(torch.matmul(x, self.w_g))
        a = (torch.matmul(o.reshape(B * T, -1), self.w_o) if "oproj_rows" in self.probes else
             torch.matmul(o, self.w_o))
        return a, [cache]


class SituMLP(Module):
    """SiTU-GLU with gate|up fused at load (TensorRT-LLM's gated-MLP layout)."""

    def __init__(self, sd: dict, p: str, cfg):
        super().__init__()
        self.w_gate_up = frozen(torch.cat([sd[p + "gate_proj.weight"],
                                           sd[p + "up_proj.weight"]], 0).t())
        self.w_down = frozen(sd[p + "down_proj.weight"].t())
        self.betas = (cfg.situ_beta, cfg.situ_linear_beta)

    def forward(self, x: Tensor) -> Tensor:
        g, u = torch.chunk(torch.matmul(x, self.w_gate_up), 2, dim=-1)
        return torch.matmul(situ(g, u, *self.betas), self.w_down)


class LatentMoE(Module):
    def __init__(self, sd: dict, p: str, cfg):
        super().__init__()
        self.k, self.eps, self.betas = (cfg.num_experts_per_token, cfg.rms_norm_eps,
                                        (cfg.situ_beta, cfg.situ_linear_beta))
        self.scaling = cfg.routed_scaling_factor
        self.w_router = frozen(sd[p + "gate.weight"].t())
        self.bias = frozen(sd[p + "gate.e_score_correction_bias"])
        self.w_down = frozen(sd[p + "routed_expert_down_proj.weight"].t())
        self.w_up = frozen(sd[p + "routed_expert_up_proj.weight"].t())
        self.latent_norm = frozen(sd[p + "routed_expert_norm.weight"])
        for w in ("w1", "w3", "w2"):
            self.register_buffer(f"{w}_packed", sd[f"{p}experts.{w}_packed"].clone())
            self.register_buffer(f"{w}_scale", sd[f"{p}experts.{w}_scale"].clone())
        self.register_buffer("lut", torch.tensor(E2M1))
        self.shared = SituMLP(sd, p + "shared_experts.", cfg)

    def dequant(self, packed: Tensor, scale: Tensor, dtype) -> Tensor:
        if "shift" in self.probes:
            nibbles = [packed & 15, packed >> 4]
        else:
            nibbles = [torch.bitwise_and(packed, 15), torch.bitwise_right_shift(packed, 4)]
        codes = torch.stack(nibbles, dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
        if "lut" in self.probes:
            vals = self.lut[codes.long()]
        else:
            vals = torch.index_select(self.lut, 0, codes.reshape(-1).long()).view(codes.shape)
        blocks = vals.view(*scale.shape, -1) * torch.pow(2.0, scale.float() - 127).unsqueeze(-1)
        return blocks.reshape(codes.shape).to(dtype)

    def picked(self, name: str, flat_ids: Tensor, dtype) -> Tensor:
        packed, scale = getattr(self, name + "_packed"), getattr(self, name + "_scale")
        return self.dequant(torch.index_select(packed, 0, flat_ids),
                            torch.index_select(scale, 0, flat_ids), dtype)

    def forward(self, x: Tensor) -> Tensor:
        n, k = x.shape[0], self.k
        scores = torch.sigmoid(torch.matmul(x.float(), self.w_router.float()))  # [N, E]
        _, ids = torch.topk(scores + self.bias.float(), k, dim=-1)
        w = torch.gather(scores, 1, ids)
        w = w / (torch.sum(w, dim=-1, keepdim=True) + 1e-20) * self.scaling
        z = torch.matmul(x, self.w_down)  # [N, L]
        flat = ids.reshape(-1)
        if "pairs" in self.probes:
            w1, w3, w2 = (self.picked(e, flat, x.dtype) for e in ("w1", "w3", "w2"))
            zr = z.view(n, 1, -1, 1)
            hg = torch.matmul(w1.view(n, k, *w1.shape[1:]), zr)
            hu = torch.matmul(w3.view(n, k, *w3.shape[1:]), zr)
            y = torch.matmul(w2.view(n, k, *w2.shape[1:]), situ(hg, hu, *self.betas))
        else:
            zr = z.unsqueeze(1).expand(n, k, z.shape[-1]).reshape(n * k, -1, 1)  # [N k, L, 1]
            hg = torch.bmm(self.picked("w1", flat, x.dtype), zr)
            hu = torch.bmm(self.picked("w3", flat, x.dtype), zr)
            y = torch.bmm(self.picked("w2", flat, x.dtype), situ(hg, hu, *self.betas))  # [N k, L, 1]
        if "combine" in self.probes:
            u = (w.unsqueeze(-1) * y.view(n, k, -1).float()).sum(1)
        else:
            u = torch.matmul(w.unsqueeze(1), y.view(n, k, -1).float()).squeeze(1)  # [N, L] fp32
        routed = torch.matmul(rms_norm(u, self.latent_norm, self.eps).to(x.dtype), self.w_up)
        return routed + self.shared(x)


class Layer(Module):
    def __init__(self, sd: dict, i: int, cfg, states: dict):
        super().__init__()
        p = f"{_BUILTIN}layers.{i}."
        eps = cfg.rms_norm_eps
        self.attn_mix = DepthMix(sd[p + "self_attention_res_norm.weight"],
                                 sd[p + "self_attention_res_proj.weight"], eps)
        self.mlp_mix = DepthMix(sd[p + "mlp_res_norm.weight"], sd[p + "mlp_res_proj.weight"], eps)
        self.input_norm = frozen(sd[p + "input_layernorm.weight"])
        self.post_norm = frozen(sd[p + "post_attention_layernorm.weight"])
        self.eps, self.is_mla = eps, p + "self_attn.kv_cache" in states
        a = p + "self_attn."
        self.attn = (GatedMLA(sd, a, cfg, states[a + "kv_cache"]) if self.is_mla else
                     KDA(sd, a, cfg, states[a + "conv_state"], states[a + "recurrent_state"]))
        self.ffn = (SituMLP(sd, p + "mlp.", cfg) if i < cfg.first_k_dense_replace else
                    LatentMoE(sd, p + "mlp.", cfg))


class K3Export(Module):
    """K3 decode step: logits [B, V] for ids [B], [B, T, V] for verify rows [B, T]."""

    def __init__(self, sd: dict, cfg, states: dict):
        super().__init__()
        self.cfg, self.eps = cfg, cfg.rms_norm_eps
        self.embed = frozen(sd[_BUILTIN + "embed_tokens.weight"])
        self.layers = nn.ModuleList(Layer(sd, i, cfg, states)
                                    for i in range(cfg.num_hidden_layers))
        self.final_mix = DepthMix(sd[_BUILTIN + "output_attn_res_norm.weight"],
                                  sd[_BUILTIN + "output_attn_res_proj.weight"], self.eps)
        self.final_norm = frozen(sd[_BUILTIN + "norm.weight"])
        self.w_lm = frozen(sd["language_model.lm_head.weight"].t())
        self.probes: set[str] = set()

    def set_probe(self, *names: str) -> K3Export:
        assert set(names) <= set(PROBES), names
        for module in self.modules():
            module.probes = set(names)
        return self

    def state_buffers(self) -> list[Tensor]:
        return [b for layer in self.layers for n, b in layer.attn.named_buffers()
                if n in ("conv_state", "recurrent_state", "kv_cache")]

    def forward(self, input_ids: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
        ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(1)
        B, T = ids.shape
        D, bs = self.embed.shape[1], self.cfg.attn_res_block_size
        prefix = torch.index_select(self.embed, 0, ids.reshape(-1))  # [B T, D]
        delta, blocks, new_states = None, [], []
        for i, layer in enumerate(self.layers):
            if delta is not None:
                prefix = prefix + delta
            n = len(blocks)
            if i % bs == 0:
                blocks = blocks + [prefix]
            h = layer.attn_mix(prefix, blocks[:n])
            x = rms_norm(h, layer.input_norm, self.eps).view(B, T, D)
            if layer.is_mla:
                a, states = layer.attn(x, positions, slots)
            else:
                a, states = layer.attn(x, slots)
            new_states += states
            a = a.reshape(B * T, D)
            prefix = a if i % bs == 0 else prefix + a
            h2 = layer.mlp_mix(prefix, blocks)
            delta = layer.ffn(rms_norm(h2, layer.post_norm, self.eps))
        prefix = prefix + delta
        h = self.final_mix(prefix, blocks)
        logits = torch.matmul(rms_norm(h, self.final_norm, self.eps), self.w_lm)
        for buf, new in zip(self.state_buffers(), new_states):
            buf.copy_(new)
        logits = logits.view(B, T, -1)
        return logits if input_ids.dim() == 2 else logits[:, 0]


def from_builtin(model) -> K3Export:
    """This spelling of `model` (a built-in K3ForCausalLM), from its state dict and buffers."""
    sd = model.state_dict()
    states = {n: b for n, b in model.named_buffers()
              if n.endswith(("conv_state", "recurrent_state", "kv_cache"))}
    return K3Export(sd, model.config, states)


def state_of(model: K3Export) -> dict[str, Tensor]:
    """Its six states under the built-in model's buffer names."""
    out = {}
    for i, layer in enumerate(model.layers):
        for n, b in layer.attn.named_buffers():
            if n in ("conv_state", "recurrent_state", "kv_cache"):
                out[f"{_BUILTIN}layers.{i}.self_attn.{n}"] = b
    return out
