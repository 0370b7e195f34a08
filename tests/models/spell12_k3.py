"""A twelfth spelling of Kimi K3's decode step, written blind (session 32) from
/work/shared/k3_arch.md alone, in the style of a *stateless functional* codebase: the layer
modules are a weightless skeleton on the meta device, every step runs it through
`torch.func.functional_call` over one flat dict of weights, and the per-slot states are passed
in and handed back, never mutated inside the network.

Idioms (chosen to differ from the eight earlier foreign spellings):

* Structure: `Spell12K3` owns a flat `ParameterDict` of weights (dots spelled `__`) and a
  `SlotCache` of per-layer states; the network `Net` is built under `torch.device("meta")` and
  called as `functional_call(net, weights | states, (ids, positions, slots))`. It returns the
  logits and the new state tensors, built out of place by `Tensor.put` at flat element indices
  (`slot * numel_per_slot + arange`); the cache object writes them back whole with `.copy_`.
* Weights are `nn.Linear` subclasses: `MergedLinear` holds concatenated projections and returns
  the pieces (`split(sizes, -1)`): KDA q|k|v|g|f_a|b, MLA q_a|kv_a|g (the gate joins the
  low-rank projections), dense and shared gate|up. `RowLinear` is a bias-free `nn.Linear`.
* RMSNorm through `torch.linalg.vector_norm`: `x * rsqrt((|x| / sqrt(d))^2 + eps)`, fp32, cast,
  times the weight. KDA's l2 norm through `torch.linalg.vecdot(x, x)`.
* Activations [B, T, D] inside (one token is T = 1), squeezed at the end for 1-D ids.
* AttnRes: the bank a tuple grown by `bank + (prefix,)`; each source scored by its own
  `vecdot(v / rms(v), w_norm * w_proj)`, the scores stacked and softmaxed, the mix a running
  Python sum `out = out + alpha_i * v_i` over the sources; n = 0 skipped (identity).
* KDA: the three short convs as one over q|k|v's channels, the window a `stack` of 4 shifted
  slices of `cat(state, x)` contracted with the taps by `torch.linalg.vecdot`; decay per channel
  with `A_log.exp()` broadcast over a [.., H, D] view; the recurrence in the **chunked form at
  chunk size 1** (fla's chunk_kda with C = 1): the output and the delta from the *old* state,
  `u = beta (v - S^T (alpha * k))`, `o = S^T (alpha * q) + (q . k) u`, then
  `S = alpha S + k u^T`; K-major fp32 state.
* Gated MLA absorbed: W_UK / W_UV as einsums over a [H, nope + v, C] view of kv_b's weight; the
  attention one `torch.baddbmm` of an additive `where(valid, 0, -inf)` bias with `alpha =
  1/sqrt(nope + rope)` over [B, T*H, C + R] queries, softmax in fp32, a `bmm` with the latent
  rows; gate `o * sigmoid(g)`.
* LatentMoE: fp32 router; **top-k by `torch.sort(descending=True)` and slicing**; unbiased
  weights by `gather`, renormalised; all experts dequantised, then each token's k experts picked
  by a **dense one-hot einsum** (`einsum("nke,eil->nkil", one_hot(ids, E), W)`, exact: one
  nonzero term), FC1 / FC2 as einsums, fp32 combine `einsum("nk,nkl->nl")`.
* MXFP4: nibbles by `remainder(p, 16)` / `div(p, 16, rounding_mode="floor")`, E2M1 values by
  `F.embedding` into a 16-entry table, the E8M0 scale by `torch.ldexp(w, s - 127)`.
* SiTU with `torch.special.expit`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# idioms set_probe switches to another spelling of the same math (to bisect a lost fusion):
# rms: RMSNorm as `x * rsqrt(mean(x²) + eps)`; mix: AttnRes over stacked sources, summed;
# topk: `torch.topk` routing; experts: the picked experts gathered `W[ids]`; delta: the
# sequential delta rule (decay, delta, write, read); writes: states written by `index_put`;
# l2: l2 norm by `pow(2).sum()`; conv: the conv window summed `(windows * taps).sum(-1)`;
# mla_g: MLA's g_proj its own GEMM; split_proj: every merged projection one GEMM per piece;
# decay: dt_bias added per head after the head view, exp(A_log) viewed [H, 1]; window: the conv
# window `xs.unfold(-1, K, 1)`; tail: the conv state's new tail `xs[..., T:]`; beta: β kept
# [B, T, H], a token's row unsqueezed after its select (window, tail, beta: session 33, kda12)
PROBES = ("rms", "mix", "topk", "experts", "delta", "writes", "l2", "conv", "mla_g",
          "split_proj", "decay", "window", "tail", "beta")
_ON: set = set()  # the probes on (set_probe): one set for every live model


def probe(name):
    return name in _ON


class RowLinear(nn.Linear):
    def __init__(self, d_in, d_out):
        super().__init__(d_in, d_out, bias=False)


class MergedLinear(nn.Linear):
    """Several projections of one input stored as one weight; returns the pieces."""

    def __init__(self, d_in, sizes):
        super().__init__(d_in, sum(sizes), bias=False)
        self.sizes = list(sizes)

    def forward(self, x):
        if probe("split_proj"):
            return tuple(F.linear(x, w) for w in self.weight.split(self.sizes))
        return F.linear(x, self.weight).split(self.sizes, -1)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d))
        self.eps = eps

    def forward(self, x, dtype=None):
        return rms_normalize(x, self.eps).to(dtype or x.dtype) * self.weight


def rms_normalize(x, eps):
    xf = x.float()
    if probe("rms"):
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    rms = torch.linalg.vector_norm(xf, dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
    return xf * torch.rsqrt(rms.square() + eps)


def situ(g, u, beta1, beta2):
    g, u = g.float(), u.float()
    return beta1 * torch.tanh(g / beta1) * torch.special.expit(g) * (beta2 * torch.tanh(u / beta2))


class AttnRes(nn.Module):
    """One depth mix: softmax over sources of their normed projections on a pseudo-query."""

    def __init__(self, d, eps):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.empty(d))
        self.proj_weight = nn.Parameter(torch.empty(1, d))
        self.eps = eps

    def forward(self, sources):
        if len(sources) == 1:
            return sources[0]
        query = self.norm_weight.float() * self.proj_weight[0].float()
        if probe("mix"):
            v = torch.stack(sources, -2)
            alpha = (rms_normalize(v, self.eps) * query).sum(-1).softmax(-1)
            return (alpha[..., None] * v.float()).sum(-2).to(v.dtype)
        scores = [torch.linalg.vecdot(rms_normalize(v, self.eps), query) for v in sources]
        alpha = torch.stack(scores, -1).softmax(-1)
        out = alpha[..., 0, None] * sources[0].float()
        for i in range(1, len(sources)):
            out = out + alpha[..., i, None] * sources[i].float()
        return out.to(sources[0].dtype)


class KDA(nn.Module):
    def __init__(self, cfg, idx):
        super().__init__()
        H, D = cfg.kda_num_heads, cfg.kda_head_dim
        W, hid = H * D, cfg.hidden_size
        self.idx, self.H, self.D, self.W = idx, H, D, W
        self.K = cfg.short_conv_kernel_size
        self.in_proj = MergedLinear(hid, (W, W, W, W, D, H))   # q|k|v|g|f_a|b (f_a rank = D)
        self.f_b = RowLinear(D, W)
        self.conv_taps = nn.Parameter(torch.empty(3 * W, self.K))
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(W))
        self.o_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.o_proj = RowLinear(W, hid)
        self.bound, self.l2eps = cfg.gate_lower_bound, cfg.l2norm_eps

    def conv(self, qkv, state):
        """qkv [B, T, 3W] new inputs, state [B, 3W, K-1] -> (SiLU(conv) [B, T, 3W], new state)."""
        T = qkv.shape[1]
        xs = torch.cat([state, qkv.transpose(1, 2)], -1)                 # [B, 3W, K-1+T]
        if probe("window"):
            windows = xs.unfold(-1, self.K, 1)
        else:
            windows = torch.stack([xs[..., j:j + T] for j in range(self.K)], -1)  # [B, 3W, T, K]
        if probe("conv"):
            y = (windows * self.conv_taps[:, None, :]).sum(-1)
        else:
            y = torch.linalg.vecdot(windows, self.conv_taps[:, None, :])
        return F.silu(y).transpose(1, 2), xs[..., T:] if probe("tail") else xs[..., -(self.K - 1):]

    def l2(self, x):
        if probe("l2"):
            return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.l2eps)
        return x * torch.rsqrt(torch.linalg.vecdot(x, x)[..., None] + self.l2eps)

    def forward(self, x, slots, states):
        T = x.shape[1]
        H, D = self.H, self.D
        q, k, v, g, fa, b = self.in_proj(x)
        conv_all, rec_all = states[f"conv{self.idx}"], states[f"rec{self.idx}"]
        qkv, conv_new = self.conv(torch.cat([q, k, v], -1), conv_all[slots])
        q, k, v = (t.float().unflatten(-1, (H, D)) for t in qkv.split(self.W, -1))
        q, k = self.l2(q) * D ** -0.5, self.l2(k)
        if probe("decay"):
            graw = self.f_b(fa).float().unflatten(-1, (H, D)) + self.dt_bias.view(H, D)
            gate = torch.exp(self.A_log.float()).view(H, 1) * graw
            alpha = torch.exp(self.bound * torch.sigmoid(gate))
        else:
            graw = (self.f_b(fa).float() + self.dt_bias).unflatten(-1, (H, D))
            alpha = torch.exp(self.bound * torch.sigmoid(self.A_log.exp()[:, None] * graw))
        beta = torch.sigmoid(b.float()) if probe("beta") else torch.sigmoid(b.float())[..., None]
        S = rec_all[slots]                                                # [B, H, K, V] fp32
        outs = []
        for t in range(T):  # chunks of one token
            if probe("delta"):
                S = alpha[:, t, ..., None] * S
                u = token_beta(beta, t) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
                S = S + k[:, t, ..., :, None] * u[..., None, :]
                outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
                continue
            a_t, q_t, k_t = alpha[:, t], q[:, t], k[:, t]
            u = token_beta(beta, t) * (v[:, t] - torch.einsum("bhk,bhkv->bhv", a_t * k_t, S))
            o = torch.einsum("bhk,bhkv->bhv", a_t * q_t, S)
            outs.append(o + torch.linalg.vecdot(q_t, k_t)[..., None] * u)
            S = a_t[..., None] * S + k_t[..., :, None] * u[..., None, :]
        o = torch.stack(outs, 1)                                          # [B, T, H, V]
        o = self.o_norm(o, x.dtype) * torch.sigmoid(g.unflatten(-1, (H, D)))
        new = {f"conv{self.idx}": put_rows(conv_all, slots, conv_new),
               f"rec{self.idx}": put_rows(rec_all, slots, S)}
        return self.o_proj(o.flatten(-2)), new


def token_beta(beta, t):
    """Token t's β [B, H, 1] (probe beta: β [B, T, H], its row unsqueezed after the select)."""
    return beta[:, t].unsqueeze(-1) if probe("beta") else beta[:, t]


def put_rows(buf, slots, rows):
    """`buf` with its rows at `slots` replaced by `rows` (out of place, flat indices)."""
    if probe("writes"):
        return buf.index_put((slots,), rows.to(buf.dtype))
    per = buf[0].numel()
    flat = slots[:, None] * per + torch.arange(per, device=buf.device)
    return buf.put(flat, rows.reshape(len(slots), per).to(buf.dtype))


class MLA(nn.Module):
    def __init__(self, cfg, idx):
        super().__init__()
        self.idx, self.H = idx, cfg.num_attention_heads
        self.C, self.R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.N, self.V = cfg.qk_nope_head_dim, cfg.v_head_dim
        hid, H = cfg.hidden_size, self.H
        self.a_proj = MergedLinear(hid, (cfg.q_lora_rank, self.C + self.R, H * self.V))
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps)
        self.kv_norm = RMSNorm(self.C, cfg.mla_norm_eps)
        self.q_b = RowLinear(cfg.q_lora_rank, H * (self.N + self.R))
        self.kv_b = RowLinear(self.C, H * (self.N + self.V))
        self.o_proj = RowLinear(H * self.V, hid)

    def forward(self, x, positions, slots, states):
        B, T, _ = x.shape
        H, C, R, N = self.H, self.C, self.R, self.N
        if probe("mla_g"):
            cq, ckv = F.linear(x, self.a_proj.weight[:-H * self.V]).split(self.a_proj.sizes[:2], -1)
            g = F.linear(x, self.a_proj.weight[-H * self.V:])
        else:
            cq, ckv, g = self.a_proj(x)
        q = self.q_b(self.q_norm(cq)).unflatten(-1, (H, N + R))
        q_nope, q_pe = q.split([N, R], -1)
        kv_b = self.kv_b.weight.unflatten(0, (H, N + self.V))            # [H, N + V, C]
        w_uk, w_uv = kv_b[:, :N], kv_b[:, N:]
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)
        row = torch.cat([self.kv_norm(ckv[..., :C]), ckv[..., C:]], -1)   # [B, T, C + R]
        cache = states[f"kv{self.idx}"]
        L = cache.shape[1]
        at = positions[:, None] + torch.arange(T, device=x.device)       # [B, T]
        flat = (slots[:, None] * L + at)[..., None] * (C + R) + torch.arange(C + R,
                                                                             device=x.device)
        if probe("writes"):
            cache = cache.index_put((slots[:, None].expand(B, T), at), row.to(cache.dtype))
        else:
            cache = cache.put(flat, row.to(cache.dtype))
        kv = cache[slots]                                                 # [B, L, C + R]
        valid = torch.arange(L, device=x.device) <= at[..., None]         # [B, T, L]
        bias = torch.where(valid, 0.0, float("-inf")).to(x.dtype)
        bias = bias[:, :, None, :].expand(B, T, H, L).reshape(B, T * H, L)
        qm = torch.cat([q_lat, q_pe], -1).reshape(B, T * H, C + R)
        scores = torch.baddbmm(bias, qm, kv.transpose(1, 2), alpha=(N + R) ** -0.5)
        p = scores.float().softmax(-1).to(x.dtype)
        o_lat = torch.bmm(p, kv[..., :C]).unflatten(1, (T, H))           # [B, T, H, C]
        o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).flatten(-2)
        return self.o_proj(o * torch.sigmoid(g)), {f"kv{self.idx}": cache}


class GatedMLP(nn.Module):
    def __init__(self, d, inter, cfg):
        super().__init__()
        self.gate_up = MergedLinear(d, (inter, inter))
        self.down = RowLinear(inter, d)
        self.betas = cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, x):
        g, u = self.gate_up(x)
        return self.down(situ(g, u, *self.betas).to(x.dtype))


class MXFP4Experts(nn.Module):
    """Routed experts: w1 / w3 [E, I, L/2] and w2 [E, L, I/2] packed, scales per 32 inputs."""

    def __init__(self, E, L, I):
        super().__init__()
        for name, (rows, cols) in {"w1": (I, L), "w3": (I, L), "w2": (L, I)}.items():
            self.register_buffer(f"{name}_packed", torch.empty(E, rows, cols // 2,
                                                               dtype=torch.uint8))
            self.register_buffer(f"{name}_scale", torch.empty(E, rows, cols // 32,
                                                              dtype=torch.uint8))
        self.register_buffer("table", torch.empty(16, 1))

    def weight(self, name, dtype):
        p, s = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
        lo, hi = torch.remainder(p, 16), torch.div(p, 16, rounding_mode="floor")
        nib = torch.stack([lo, hi], -1).flatten(-2).long()               # low nibble first
        w = F.embedding(nib, self.table.float()).squeeze(-1)
        exp = s.int().repeat_interleave(32, -1) - 127
        return torch.ldexp(w, exp).to(dtype)


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hid, L = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.E, self.k = cfg.num_experts, cfg.num_experts_per_token
        self.scale = cfg.routed_scaling_factor
        self.router = RowLinear(hid, self.E)
        self.router_bias = nn.Parameter(torch.empty(self.E))
        self.latent_down = RowLinear(hid, L)
        self.experts = MXFP4Experts(self.E, L, cfg.moe_intermediate_size)
        self.latent_norm = RMSNorm(L, cfg.rms_norm_eps)
        self.latent_up = RowLinear(L, hid)
        self.shared = GatedMLP(hid, cfg.num_shared_experts * cfg.moe_intermediate_size, cfg)
        self.betas = cfg.situ_beta, cfg.situ_linear_beta

    def forward(self, x):
        shape, dtype = x.shape, x.dtype
        x = x.flatten(0, -2)                                              # [N, hid]
        s = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))
        if probe("topk"):
            ids = torch.topk(s + self.router_bias.float(), self.k, -1).indices
        else:
            ids = torch.sort(s + self.router_bias.float(), -1, descending=True).indices[:, :self.k]
        w = s.gather(-1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * self.scale
        z = self.latent_down(x)
        pick = F.one_hot(ids, self.E).to(dtype)                           # [N, k, E]
        w1, w3, w2 = (torch.einsum("nke,eio->nkio", pick, self.experts.weight(n, dtype))
                      if not probe("experts") else self.experts.weight(n, dtype)[ids]
                      for n in ("w1", "w3", "w2"))
        hg = torch.einsum("nl,nkil->nki", z, w1)
        hu = torch.einsum("nl,nkil->nki", z, w3)
        y = torch.einsum("nki,nkli->nkl", situ(hg, hu, *self.betas).to(dtype), w2)
        u = torch.einsum("nk,nkl->nl", w, y.float())
        routed = self.latent_up(self.latent_norm(u, dtype))
        return (routed + self.shared(x)).view(shape)


class Layer(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.attn_res, self.mlp_res = AttnRes(cfg.hidden_size, eps), AttnRes(cfg.hidden_size, eps)
        self.attn_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps)
        self.is_mla = i in cfg.full_attn_layers
        self.attn = MLA(cfg, i) if self.is_mla else KDA(cfg, i)
        self.mlp = (GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg)
                    if i < cfg.first_k_dense_replace else MoE(cfg))


class Net(nn.Module):
    """The weightless decode step: (ids, positions, slots, states) -> (logits, new states)."""

    def __init__(self, cfg):
        super().__init__()
        self.block_size = cfg.attn_res_block_size
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.out_res = AttnRes(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = RowLinear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, ids, positions, slots, states):
        prefix = self.embed(ids)                                          # [B, T, D]
        bank, delta, new = (), None, {}
        for i, layer in enumerate(self.layers):
            starts = i % self.block_size == 0
            n = -(-i // self.block_size)
            if i > 0:
                prefix = prefix + delta
            if starts:
                bank = bank + (prefix,)
            x = layer.attn_norm(layer.attn_res(bank[:n] + (prefix,)))
            if layer.is_mla:
                a, upd = layer.attn(x, positions, slots, states)
            else:
                a, upd = layer.attn(x, slots, states)
            new.update(upd)
            prefix = a if starts else prefix + a
            delta = layer.mlp(layer.mlp_norm(layer.mlp_res(bank[:n + starts] + (prefix,))))
        prefix = prefix + delta
        return self.lm_head(self.norm(self.out_res(bank + (prefix,)))), new


class SlotCache(nn.Module):
    """Per-layer states, one row per slot; written back whole from the step's new tensors."""

    def __init__(self, specs):
        super().__init__()
        for name, (shape, dtype) in specs.items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))

    def states(self):
        return dict(self.named_buffers())

    def update(self, new):
        for name, t in new.items():
            getattr(self, name).copy_(t)


class Spell12K3(nn.Module):
    def __init__(self, cfg, slots, max_len, dtype):
        super().__init__()
        with torch.device("meta"):
            self.net = Net(cfg)
        self.weights = nn.ParameterDict({
            name.replace(".", "__"): nn.Parameter(torch.empty_like(t, device="cpu"),
                                                  requires_grad=False)
            for name, t in self.net.state_dict(keep_vars=True).items()})
        H, D = cfg.kda_num_heads, cfg.kda_head_dim
        specs = {}
        for i, layer in enumerate(self.net.layers):
            if layer.is_mla:
                width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
                specs[f"kv{i}"] = ((slots, max_len, width), dtype)
            else:
                specs[f"conv{i}"] = ((slots, 3 * H * D, cfg.short_conv_kernel_size - 1), dtype)
                specs[f"rec{i}"] = ((slots, H, D, D), torch.float32)
        self.cache = SlotCache(specs)
        _ON.clear()  # a new model steps without probes (all live models share them)

    def set_probe(self, *names):
        unknown = set(names) - set(PROBES)
        assert not unknown, unknown
        _ON.clear()
        _ON.update(names)
        return self

    def forward(self, input_ids, positions, slots):
        ids = input_ids[:, None] if input_ids.dim() == 1 else input_ids
        weights = {name.replace("__", "."): p for name, p in self.weights.items()}
        logits, new = torch.func.functional_call(
            self.net, weights, (ids, positions, slots, self.cache.states()), strict=True)
        self.cache.update(new)
        return logits[:, 0] if input_ids.dim() == 1 else logits


# built-in name (after "language_model.model.layers.{i}.") -> this spelling's, per layer
_KDA_IN = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")


def from_builtin(model):
    """This spelling loaded from the built-in model's state dict (its slots, cache length and
    dtype too)."""
    cfg, sd = model.config, model.state_dict()
    kv = next(b for n, b in model.named_buffers() if n.endswith("kv_cache"))
    dtype = sd["language_model.lm_head.weight"].dtype
    out = Spell12K3(cfg, kv.shape[0], kv.shape[1], dtype)

    def get(name):
        return sd[f"language_model.{name}"]

    w = {"embed.weight": get("model.embed_tokens.weight"),
         "out_res.norm_weight": get("model.output_attn_res_norm.weight"),
         "out_res.proj_weight": get("model.output_attn_res_proj.weight"),
         "norm.weight": get("model.norm.weight"), "lm_head.weight": get("lm_head.weight")}
    for i, layer in enumerate(out.net.layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for a, b in (("attn_res", "self_attention_res"), ("mlp_res", "mlp_res")):
            w[dst + a + ".norm_weight"] = get(src + b + "_norm.weight")
            w[dst + a + ".proj_weight"] = get(src + b + "_proj.weight")
        w[dst + "attn_norm.weight"] = get(src + "input_layernorm.weight")
        w[dst + "mlp_norm.weight"] = get(src + "post_attention_layernorm.weight")
        at, sa = dst + "attn.", src + "self_attn."
        if layer.is_mla:
            w[at + "a_proj.weight"] = torch.cat([get(sa + n + ".weight") for n in (
                "q_a_proj", "kv_a_proj_with_mqa", "g_proj")])
            w[at + "q_norm.weight"] = get(sa + "q_a_layernorm.weight")
            w[at + "kv_norm.weight"] = get(sa + "kv_a_layernorm.weight")
            for a, b in (("q_b", "q_b_proj"), ("kv_b", "kv_b_proj"), ("o_proj", "o_proj")):
                w[at + a + ".weight"] = get(sa + b + ".weight")
        else:
            w[at + "in_proj.weight"] = torch.cat([get(sa + n + ".weight") for n in _KDA_IN])
            w[at + "f_b.weight"] = get(sa + "f_b_proj.weight")
            w[at + "conv_taps"] = torch.cat([get(sa + f"{c}_conv1d.weight")[:, 0]
                                             for c in "qkv"])
            w[at + "A_log"] = get(sa + "A_log")[:layer.attn.H]
            w[at + "dt_bias"] = get(sa + "dt_bias")
            w[at + "o_norm.weight"] = get(sa + "o_norm.weight")
            w[at + "o_proj.weight"] = get(sa + "o_proj.weight")
        ml, sm = dst + "mlp.", src + "mlp."
        if isinstance(layer.mlp, GatedMLP):
            w[ml + "gate_up.weight"] = torch.cat([get(sm + "gate_proj.weight"),
                                                  get(sm + "up_proj.weight")])
            w[ml + "down.weight"] = get(sm + "down_proj.weight")
            continue
        w[ml + "router.weight"] = get(sm + "gate.weight")
        w[ml + "router_bias"] = get(sm + "gate.e_score_correction_bias")
        w[ml + "latent_down.weight"] = get(sm + "routed_expert_down_proj.weight")
        w[ml + "latent_norm.weight"] = get(sm + "routed_expert_norm.weight")
        w[ml + "latent_up.weight"] = get(sm + "routed_expert_up_proj.weight")
        for part in ("w1", "w3", "w2"):
            for kind in ("packed", "scale"):
                w[f"{ml}experts.{part}_{kind}"] = get(f"{sm}experts.{part}_{kind}")
        w[ml + "experts.table"] = torch.tensor(E2M1, dtype=dtype)[:, None]
        w[ml + "shared.gate_up.weight"] = torch.cat([get(sm + "shared_experts.gate_proj.weight"),
                                                     get(sm + "shared_experts.up_proj.weight")])
        w[ml + "shared.down.weight"] = get(sm + "shared_experts.down_proj.weight")
    assert set(w) == {n.replace("__", ".") for n in out.weights}, set(w) ^ {
        n.replace("__", ".") for n in out.weights}
    for name, t in w.items():
        p = out.weights[name.replace(".", "__")]
        p.data = t.detach().clone().to(p.dtype if t.dtype == torch.uint8 else t.dtype)
    return out.eval()


def state_of(model):
    """The spelling's states under the built-in model's buffer names and layouts."""
    names = {"conv": "conv_state", "rec": "recurrent_state", "kv": "kv_cache"}
    out = {}
    for name, t in model.cache.named_buffers():
        kind, i = name.rstrip("0123456789"), name[len(name.rstrip("0123456789")):]
        out[f"language_model.model.layers.{i}.self_attn.{names[kind]}"] = t
    return out
