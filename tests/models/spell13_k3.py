"""A thirteenth spelling of Kimi K3's decode step, written blind (session 36) from
`shared/k3_arch.md` in the style of a Megatron / FSDP-era training codebase ported to decode:
sequence-first activations, flat parameter storage, static shapes everywhere (no data-dependent
indexing in the MoE, one-hot writes into the states). It loads the built-in model's state dict
through a name map (`from_builtin`) and decodes single tokens ([B] ids) and T verify rows
([B, T] ids).

Idioms (chosen to differ from the nine earlier spellings' lists):

* **Sequence-first activations** `[T, B, D]` (Megatron's [s, b, h]) through every layer; logits
  transposed back to [B, T, V] (one token: [B, V]) at the end.
* **Flat parameter storage** (FSDP's `FlatParameter`): each layer's weights of the model dtype
  live in one 1-D `nn.Parameter` (`flat`), its fp32 ones (dt_bias, A_log, the router bias) in a
  second (`flat32`) and its MXFP4 bytes in one uint8 buffer (`qbytes`); every weight is a
  `narrow(...).view(shape)` of them, made in the forward. Neighbouring weights are laid out so
  that one view covers a merged projection: KDA q|k|v|g|f_a|b, MLA q_a|kv_a, gate|up.
* Every projection by **`torch.tensordot(x, W, dims=([-1], [1]))`** (no linear / matmul / einsum
  for the plain projections).
* RMSNorm and the l2 norm by a **self-dot einsum** `einsum("...d,...d->...", x, x)` (the sum of
  squares), `rsqrt(ss / d + eps)` in fp32, cast, times the weight.
* **AttnRes** over a **preallocated zero bank of all slots** `[NB, T, B, D]`, written by a
  depth one-hot `torch.where` blend, every mix over all NB + 1 sources with the unwritten ones
  **masked to -inf**, the softmax spelled **`exp(s - logsumexp(s))`**; n = 0 not skipped (the
  mask leaves the prefix alone, weight exactly 1). Scores `inv_rms * (v . (w_norm * w_proj))`.
* **State writes as one-hot blends**: each state buffer (conv, recurrent, latent cache) is
  rewritten whole, `buf.copy_(where(hit, onehotᵀ @ rows, buf))`, the rows placed by a matmul with
  a [N, R] one-hot of their flat row index (TPU style scatter); reads by `index_select`.
* **KDA**: the short conv **unrolled over its taps** with `addcmul` per tap, a Python loop over
  the T rows with the window rolled by `cat(state[..., 1:], x_t)`; the delta rule in its
  **Householder form** `S <- (I - b k kᵀ) (a ⊙ S) + b k vᵀ` with an explicit identity
  (`torch.eye`), the read `o = q̂ᵀ S` by a broadcast `matmul`; K-major fp32 state.
* **Gated MLA**, absorbed: W_UK / W_UV by broadcast `matmul` over [.., H, 1, N] @ [H, N, C];
  the softmax scale **folded into the query**; the attention two batched `matmul`s over
  [B, T·H, C + R] queries; the causal mask a `where` to **`finfo(float32).min`** (HF style) in
  fp32.
* **LatentMoE, dense**: the top-k as a **`torch.kthvalue` threshold** (`sel >= k-th largest`),
  no indices: the routing weights a dense [N, E] `where(chosen, s, 0)`, renormalised; **every
  expert computed for every token** (`tensordot` over the latent, batched `matmul` for FC2;
  MaxText's dense MoE), combined by the dense weights, fp32 sum over E.
* **MXFP4 by a 256-entry byte table**: each packed byte indexes a [256, 2] table of its (low,
  high) E2M1 pair; E8M0 scales by **bit reinterpretation** `(s.int() << 23).view(float32)`
  (2^(s-127); s = 0 gives 0 where the spec's 2^-127 is subnormal), applied per 32-block.
* SiTU-GLU `4 tanh(g / 4) sigmoid(g) * 25 tanh(u / 25)` in fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# probe -> the other spelling of the same math it switches to (bisecting a lost fusion)
PROBES = {
    "flat": "every weight its own Parameter / buffer (merged projections stay merged)",
    "linear": "projections by F.linear",
    "norm": "RMSNorm and l2 norm by x.pow(2).mean / sum(-1, keepdim=True)",
    "mix": "AttnRes over the n written sources and the prefix only, torch.softmax",
    "writes": "state writes by index_copy_ (rows) / index_put_ (cache rows)",
    "conv": "the short conv a window cat(state, x) times the taps, summed over the taps",
    "delta": "the delta rule S = aS; u = b(v - Sᵀk); S += k uᵀ",
    "mask": "MLA: the scale on the scores, the mask -inf by masked_fill",
    "topk": "router top-k by torch.topk, weights gathered and scattered into the dense [N, E]",
    "experts": "each token's k experts gathered (dequant of packed[ids]), combined by weights",
    "dequant": "MXFP4 by nibbles (& 15, >> 4), the E2M1 table and torch.ldexp",
    "seq": "batch-first activations [B, T, D] everywhere (the same ops on the other layout)",
    "heads": "KDA: q, k, v split before the head view; the decay's head view before its add",
    "qkv_heads": "KDA: q, k, v split before the head view (probe heads' first half)",
    "decay_heads": "KDA: the decay's head view before its add (probe heads' second half)",
    "scores": "MLA: the scores two products, q_lat c_kvᵀ + q_pe k_peᵀ, scaled after",
    "bank": "AttnRes: the bank's block written by slice assignment, bank[j] = prefix",
    "kvb": "MLA: kv_b stored 2-D [H (N + V), C] (as the checkpoint), viewed [H, N + V, C]",
    "lut": "probe dequant's E2M1 table a [16] buffer of its own (not byte_pairs[:16, 0])",
}


def dot_self(x):
    return torch.einsum("...d,...d->...", x, x)


def rmsnorm(x, w, eps, dtype=None):
    xf = x.float()
    y = xf * torch.rsqrt(dot_self(xf)[..., None] / xf.shape[-1] + eps)
    return y.to(dtype or x.dtype) * w


def proj(x, w):
    return torch.tensordot(x, w, dims=([-1], [1]))


def situ(g, u, b1, b2):
    gf, uf = g.float(), u.float()
    return (b1 * torch.tanh(gf / b1) * torch.sigmoid(gf) * (b2 * torch.tanh(uf / b2))).to(g.dtype)


def blend_rows(buf, idx, rows):
    """buf[idx[n]] = rows[n] for every n, as a whole-buffer rewrite through a one-hot matmul."""
    flat = buf.view(buf.shape[0], -1)
    onehot = (idx[:, None] == torch.arange(buf.shape[0], device=idx.device)).to(rows.dtype)
    placed = onehot.t() @ rows.reshape(rows.shape[0], -1).to(buf.dtype)
    hit = onehot.sum(0)[:, None] > 0
    buf.copy_(torch.where(hit, placed, flat).view_as(buf))


class Flat(nn.Module):
    """One layer's weights in flat storage: `layout` is a list of (name, shape, kind) with kind
    "w" (model dtype, `flat`), "f" (fp32, `flat32`) or "q" (uint8, `qbytes`)."""

    def __init__(self, layout, dtype):
        super().__init__()
        self.index, sizes = {}, {"w": 0, "f": 0, "q": 0}
        for name, shape, kind in layout:
            n = math.prod(shape)
            self.index[name] = (kind, sizes[kind], n, tuple(shape))
            sizes[kind] += n
        self.flat = nn.Parameter(torch.zeros(sizes["w"], dtype=dtype), requires_grad=False)
        self.flat32 = nn.Parameter(torch.zeros(sizes["f"]), requires_grad=False)
        self.register_buffer("qbytes", torch.zeros(sizes["q"], dtype=torch.uint8))

    def split_storage(self):
        """Probe `flat`: every weight its own Parameter (uint8: buffer), same values."""
        copies = {name: self[name].detach().clone() for name in self.index}
        self.parts = nn.ParameterDict()
        self.qparts = nn.Module()
        for name, t in copies.items():
            if self.index[name][0] == "q":
                self.qparts.register_buffer(name, t)
            else:
                self.parts[name] = nn.Parameter(t, requires_grad=False)

    def __getitem__(self, name):
        kind, off, n, shape = self.index[name]
        if "parts" in self._modules:
            return self.parts[name] if kind != "q" else getattr(self.qparts, name)
        store = {"w": self.flat, "f": self.flat32, "q": self.qbytes}[kind]
        return store.narrow(0, off, n).view(shape)


class Spell13K3(nn.Module):
    def __init__(self, c, dtype, n_slots, max_len, fa_rank):
        super().__init__()
        self.c, self.dtype, self.n_slots, self.max_len = c, dtype, n_slots, max_len
        self.probes, self.tdim = set(), 0  # tdim: the token dim of activations
        D, L = c.hidden_size, c.num_hidden_layers
        W, H, K = c.kda_num_heads * c.kda_head_dim, c.kda_num_heads, c.kda_head_dim
        self.fa_rank = fa_rank
        self.mla_layers = set(c.full_attn_layers)
        self.nb = -(-L // c.attn_res_block_size)
        layers, states = [], {}
        for i in range(L):
            lay = [("res_norm_a", (D,), "w"), ("res_proj_a", (D,), "w"),
                   ("res_norm_m", (D,), "w"), ("res_proj_m", (D,), "w"),
                   ("ln_in", (D,), "w"), ("ln_post", (D,), "w")]
            if i in self.mla_layers:
                Hm, N, R, V = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, \
                    c.v_head_dim
                C, Q = c.kv_lora_rank, c.q_lora_rank
                lay += [("qa_kva", (Q + C + R, D), "w"), ("q_ln", (Q,), "w"),
                        ("kv_ln", (C,), "w"), ("q_b", (Hm * (N + R), Q), "w"),
                        ("kv_b", (Hm, N + V, C), "w"), ("g", (Hm * V, D), "w"),
                        ("o", (D, Hm * V), "w")]
                states[f"kv_{i}"] = torch.zeros(n_slots, max_len, C + R, dtype=dtype)
            else:
                lay += [("in", (4 * W + fa_rank + H, D), "w"), ("f_b", (W, fa_rank), "w"),
                        ("taps", (3 * W, c.short_conv_kernel_size), "w"),
                        ("o_norm", (K,), "w"), ("o", (D, W), "w"),
                        ("dt_bias", (W,), "f"), ("A_log", (H,), "f")]
                states[f"conv_{i}"] = torch.zeros(n_slots, 3 * W, c.short_conv_kernel_size - 1,
                                                  dtype=dtype)
                states[f"rec_{i}"] = torch.zeros(n_slots, H, K, K)
            if i < c.first_k_dense_replace:
                I = c.intermediate_size
                lay += [("gate_up", (2 * I, D), "w"), ("down", (D, I), "w")]
            else:
                E, Lt, I = c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size
                S = c.num_shared_experts * I
                lay += [("router", (E, D), "w"), ("bias", (E,), "f"),
                        ("lat_down", (Lt, D), "w"), ("lat_norm", (Lt,), "w"),
                        ("lat_up", (D, Lt), "w"),
                        ("sh_gate_up", (2 * S, D), "w"), ("sh_down", (D, S), "w"),
                        ("w1_q", (E, I, Lt // 2), "q"), ("w1_s", (E, I, Lt // 32), "q"),
                        ("w3_q", (E, I, Lt // 2), "q"), ("w3_s", (E, I, Lt // 32), "q"),
                        ("w2_q", (E, Lt, I // 2), "q"), ("w2_s", (E, Lt, I // 32), "q")]
            layers.append(Flat(lay, dtype))
        self.layers = nn.ModuleList(layers)
        self.head = Flat([("embed", (c.vocab_size, D), "w"), ("res_norm", (D,), "w"),
                          ("res_proj", (D,), "w"), ("norm", (D,), "w"),
                          ("lm_head", (c.vocab_size, D), "w")], dtype)
        self.states = nn.Module()
        for name, t in states.items():
            self.states.register_buffer(name, t)
        codes = torch.arange(256)
        table = torch.tensor(E2M1)
        self.register_buffer("e2m1", table.clone())
        self.register_buffer("byte_pairs", torch.stack([table[codes % 16], table[codes // 16]],
                                                       -1))

    def set_probe(self, *names):
        unknown = set(names) - set(PROBES)
        if unknown:
            raise ValueError(f"unknown probes {sorted(unknown)}; known: {PROBES}")
        self.probes = set(names)
        self.tdim = 1 if "seq" in self.probes else 0
        if "kvb" in self.probes:
            for i in self.mla_layers:
                kind, off, n, (h, m, r) = self.layers[i].index["kv_b"]
                self.layers[i].index["kv_b"] = (kind, off, n, (h * m, r))
        if "flat" in self.probes:
            for flat in (*self.layers, self.head):
                flat.split_storage()
        return self

    # -- probe-switched helpers ----------------------------------------------------------
    def proj(self, x, w):
        return F.linear(x, w) if "linear" in self.probes else proj(x, w)

    def rmsnorm(self, x, w, eps, dtype=None):
        if "norm" not in self.probes:
            return rmsnorm(x, w, eps, dtype)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype or x.dtype) * w

    def l2(self, x, eps):
        if "norm" in self.probes:
            return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
        return x * torch.rsqrt(dot_self(x)[..., None] + eps)

    def write(self, buf, idx, rows):
        if "writes" not in self.probes:
            return blend_rows(buf, idx, rows)
        buf.index_copy_(0, idx, rows.reshape(rows.shape[0], *buf.shape[1:]).to(buf.dtype))

    # -- AttnRes --------------------------------------------------------------------------
    def mix(self, prefix, bank, n, w_norm, w_proj):
        if "mix" in self.probes:
            src = torch.cat([bank[:n], prefix[None]], 0).float()
            inv = torch.rsqrt(src.pow(2).mean(-1) + self.c.rms_norm_eps)
            s = (src * inv[..., None] * (w_norm.float() * w_proj.float())).sum(-1)
            return (torch.softmax(s, 0)[..., None] * src).sum(0).to(prefix.dtype)
        src = torch.cat([bank, prefix[None]], 0).float()  # [NB + 1, T, B, D]
        inv = torch.rsqrt(dot_self(src) / src.shape[-1] + self.c.rms_norm_eps)
        s = torch.tensordot(src, w_norm.float() * w_proj.float(), dims=([-1], [0])) * inv
        live = torch.arange(self.nb + 1, device=src.device)
        live = (live < n) | (live == self.nb)
        s = s.masked_fill(~live[:, None, None], float("-inf"))
        alpha = torch.exp(s - torch.logsumexp(s, 0, keepdim=True))
        return (alpha[..., None] * src).sum(0).to(prefix.dtype)

    # -- KDA ------------------------------------------------------------------------------
    def kda(self, p, i, x, slots):
        c = self.c
        W, H, K = c.kda_num_heads * c.kda_head_dim, c.kda_num_heads, c.kda_head_dim
        td = self.tdim
        T = x.shape[td]
        q, k, v, g2, fa, b = self.proj(x, p["in"]).split([W, W, W, W, self.fa_rank, H], -1)
        graw = self.proj(fa, p["f_b"])
        conv_buf = getattr(self.states, f"conv_{i}")
        rec_buf = getattr(self.states, f"rec_{i}")
        taps = p["taps"].float()
        state = conv_buf.index_select(0, slots)  # [B, 3W, 3]
        xs = torch.cat([q, k, v], -1)
        outs = []
        for t in range(T):
            xt = xs.select(td, t)
            if "conv" in self.probes:
                win = torch.cat([state, xt[..., None]], -1).float()
                outs.append(F.silu((win * taps).sum(-1)))
                state = win[..., 1:].to(state.dtype)
                continue
            win = state.float()
            y = win[..., 0] * taps[:, 0]
            for j in range(1, taps.shape[1] - 1):
                y = torch.addcmul(y, win[..., j], taps[:, j])
            y = torch.addcmul(y, xt.float(), taps[:, -1])
            outs.append(F.silu(y))
            state = torch.cat([state[..., 1:], xt[..., None]], -1)
        self.write(conv_buf, slots, state)
        conv = torch.stack(outs, td).to(x.dtype).float()
        if self.probes & {"heads", "qkv_heads"}:
            qc, kc, vc = (y.unflatten(-1, (H, K)) for y in conv.split(W, -1))
        else:
            qc, kc, vc = conv.unflatten(-1, (3 * H, K)).split(H, -2)
        qn = self.l2(qc, c.l2norm_eps) * K ** -0.5
        kn = self.l2(kc, c.l2norm_eps)
        A = p["A_log"][:H].exp()
        if self.probes & {"heads", "decay_heads"}:
            z = (graw.float().unflatten(-1, (H, K)) + p["dt_bias"].view(H, K)) * A[:, None]
        else:
            z = (graw.float() + p["dt_bias"]).unflatten(-1, (H, K)) * A[:, None]
        alpha = torch.exp(c.gate_lower_bound * torch.sigmoid(z))
        beta = torch.sigmoid(b.float())
        S = rec_buf.index_select(0, slots)  # [B, H, K, V]
        eye = torch.eye(K, device=x.device)
        os_ = []
        for t in range(T):
            kt, qt, vt, at, b_t = (y.select(td, t) for y in (kn, qn, vc, alpha, beta))
            if "delta" in self.probes:
                S = at[..., None] * S
                u = b_t[..., None] * (vt - torch.matmul(kt[..., None, :], S).squeeze(-2))
                S = S + kt[..., :, None] * u[..., None, :]
            else:
                bt = b_t[..., None, None]
                P = eye - bt * kt[..., :, None] * kt[..., None, :]
                S = torch.matmul(P, at[..., None] * S) + bt * kt[..., :, None] * vt[..., None, :]
            os_.append(torch.matmul(qt[..., None, :], S).squeeze(-2))
        self.write(rec_buf, slots, S)
        o = self.rmsnorm(torch.stack(os_, td), p["o_norm"], c.rms_norm_eps, x.dtype)
        o = o * torch.sigmoid(g2).unflatten(-1, (H, K))
        return self.proj(o.flatten(-2), p["o"])

    # -- Gated MLA ------------------------------------------------------------------------
    def mla(self, p, i, x, pos, slots):
        c = self.c
        H, N, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        C, Q = c.kv_lora_rank, c.q_lora_rank
        tm = self.tdim == 0
        T, B = x.shape[:2] if tm else x.shape[1::-1]
        pos_bt = pos.t() if tm else pos  # [B, T]
        cq, ckv = self.proj(x, p["qa_kva"]).split([Q, C + R], -1)
        cq = self.rmsnorm(cq, p["q_ln"], c.mla_norm_eps)
        c_kv = self.rmsnorm(ckv[..., :C], p["kv_ln"], c.mla_norm_eps)
        k_pe = ckv[..., C:]
        q = self.proj(cq, p["q_b"]).unflatten(-1, (H, N + R))
        q_nope, q_pe = q.split([N, R], -1)
        g = self.proj(x, p["g"])
        kv_b = p["kv_b"]
        if kv_b.dim() == 2:  # probe `kvb`
            kv_b = kv_b.view(H, N + c.v_head_dim, C)
        w_uk, w_uv = kv_b[:, :N], kv_b[:, N:]
        q_lat = torch.matmul(q_nope[..., None, :], w_uk).squeeze(-2)  # [T, B, H, C]
        cache = getattr(self.states, f"kv_{i}")
        Lmax = cache.shape[1]
        flat_idx = (slots[None, :] * Lmax + pos).reshape(-1) if tm else \
            (slots[:, None] * Lmax + pos).reshape(-1)
        self.write(cache.view(-1, C + R), flat_idx, torch.cat([c_kv, k_pe], -1).reshape(T * B, -1))
        block = cache.index_select(0, slots)  # [B, L, C + R]
        masked = "mask" in self.probes
        qm = torch.cat([q_lat, q_pe], -1) * (1.0 if masked else (N + R) ** -0.5)
        qm = (qm.permute(1, 0, 2, 3) if tm else qm).reshape(B, T * H, C + R)
        if "scores" in self.probes:
            ql = (q_lat.permute(1, 0, 2, 3) if tm else q_lat).reshape(B, T * H, C)
            qp = (q_pe.permute(1, 0, 2, 3) if tm else q_pe).reshape(B, T * H, R)
            scores = torch.matmul(ql, block[..., :C].transpose(1, 2)) \
                + torch.matmul(qp, block[..., C:].transpose(1, 2))
            scores = scores if masked else scores * (N + R) ** -0.5
        else:
            scores = torch.matmul(qm, block.transpose(1, 2))
        scores = scores.view(B, T, H, Lmax).float()
        valid = torch.arange(Lmax, device=x.device) <= pos_bt[..., None]  # [B, T, L]
        if masked:
            scores = (scores * (N + R) ** -0.5).masked_fill(~valid[:, :, None], float("-inf"))
        else:
            scores = torch.where(valid[:, :, None], scores, torch.finfo(torch.float32).min)
        prob = scores.softmax(-1).to(x.dtype).view(B, T * H, Lmax)
        o_lat = torch.matmul(prob, block[..., :C]).view(B, T, H, C)
        o_lat = o_lat.permute(1, 0, 2, 3) if tm else o_lat
        o = torch.matmul(o_lat[..., None, :], w_uv.transpose(-1, -2)).squeeze(-2)
        o = o.flatten(-2) * torch.sigmoid(g)
        return self.proj(o, p["o"])

    # -- FFN ------------------------------------------------------------------------------
    def dense(self, p, x):
        g, u = self.proj(x, p["gate_up"]).chunk(2, -1)
        return self.proj(situ(g, u, self.c.situ_beta, self.c.situ_linear_beta), p["down"])

    def dequant(self, packed, scale, dtype):
        *lead, half = packed.shape
        if "dequant" in self.probes:
            codes = torch.stack([packed & 15, packed >> 4], -1).view(*packed.shape[:-1], -1)
            table = self.e2m1 if "lut" in self.probes else self.byte_pairs[:16, 0]
            vals = table[codes.long()].view(*packed.shape[:-1], -1, 32)
            w = torch.ldexp(vals, scale.to(torch.int32)[..., None] - 127)
            return w.view(*packed.shape[:-1], half * 2).to(dtype)
        vals = self.byte_pairs[packed.long()].view(*lead, half * 2 // 32, 32)
        sc = torch.bitwise_left_shift(scale.to(torch.int32), 23).view(torch.float32)
        return (vals * sc[..., None]).view(*lead, half * 2).to(dtype)

    def moe(self, p, x):
        c = self.c
        shape, dt = x.shape, x.dtype
        xt = x.reshape(-1, shape[-1])
        E, k = c.num_experts, c.num_experts_per_token
        s = torch.sigmoid(self.proj(xt.float(), p["router"].float()))
        sel = s + p["bias"]
        if "topk" in self.probes or "experts" in self.probes:
            ids = torch.topk(sel, k, dim=-1).indices
            wk = s.gather(-1, ids)
            wk = wk / (wk.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
            w = torch.zeros_like(s).scatter(-1, ids, wk)
        else:
            kth = torch.kthvalue(sel, E - k + 1, dim=-1, keepdim=True).values
            w = torch.where(sel >= kth, s, torch.zeros_like(s))
            w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        z = self.proj(xt, p["lat_down"])
        if "experts" in self.probes:
            w1 = self.dequant(p["w1_q"][ids], p["w1_s"][ids], dt)  # [N, k, I, Lt]
            w3 = self.dequant(p["w3_q"][ids], p["w3_s"][ids], dt)
            w2 = self.dequant(p["w2_q"][ids], p["w2_s"][ids], dt)
            h1 = torch.einsum("nl,nkil->nki", z, w1)
            h3 = torch.einsum("nl,nkil->nki", z, w3)
            act = situ(h1, h3, c.situ_beta, c.situ_linear_beta)
            y = torch.einsum("nki,nkli->nkl", act, w2)
            u = (wk[..., None] * y.float()).sum(1)
            return self.moe_tail(p, xt, u, shape, dt)
        w1, w3 = self.dequant(p["w1_q"], p["w1_s"], dt), self.dequant(p["w3_q"], p["w3_s"], dt)
        w2 = self.dequant(p["w2_q"], p["w2_s"], dt)
        h1 = torch.tensordot(z, w1, dims=([-1], [2]))  # [N, E, I]
        h3 = torch.tensordot(z, w3, dims=([-1], [2]))
        act = situ(h1, h3, c.situ_beta, c.situ_linear_beta)
        y = torch.matmul(act.transpose(0, 1), w2.transpose(1, 2))  # [E, N, Lt]
        u = (w.t()[..., None] * y.float()).sum(0)
        return self.moe_tail(p, xt, u, shape, dt)

    def moe_tail(self, p, xt, u, shape, dt):
        c = self.c
        routed = self.proj(self.rmsnorm(u, p["lat_norm"], c.rms_norm_eps, dt), p["lat_up"])
        g, uu = self.proj(xt, p["sh_gate_up"]).chunk(2, -1)
        shared = self.proj(situ(g, uu, c.situ_beta, c.situ_linear_beta), p["sh_down"])
        return (routed + shared).view(shape)

    def attn(self, p, i, x, pos, slots):
        if i in self.mla_layers:
            return self.mla(p, i, x, pos, slots)
        return self.kda(p, i, x, slots)

    # -- the step -------------------------------------------------------------------------
    def forward(self, input_ids, positions, slots):
        c, hd = self.c, self.head
        single = input_ids.dim() == 1
        ids = input_ids[:, None] if single else input_ids
        B, T = ids.shape
        D = c.hidden_size
        pos = positions[None, :] + torch.arange(T, device=ids.device)[:, None]  # [T, B]
        prefix = hd["embed"].index_select(0, ids.t().reshape(-1)).view(T, B, D)
        if self.tdim == 1:
            pos, prefix = pos.t(), prefix.transpose(0, 1).contiguous()
        bank = prefix.new_zeros(self.nb, *prefix.shape)
        depth = torch.arange(self.nb, device=ids.device)[:, None, None, None]
        delta = None
        bs = c.attn_res_block_size
        for i, p in enumerate(self.layers):
            if i > 0:
                prefix = prefix + delta
            write = i % bs == 0
            if write and "bank" in self.probes:
                bank = bank.clone()
                bank[i // bs] = prefix
            elif write:
                bank = torch.where(depth == i // bs, prefix[None], bank)
            n = -(-i // bs)
            h = self.mix(prefix, bank, n, p["res_norm_a"], p["res_proj_a"])
            xn = self.rmsnorm(h, p["ln_in"], c.rms_norm_eps)
            a = self.attn(p, i, xn, pos, slots)
            prefix = a if write else prefix + a
            h2 = self.mix(prefix, bank, n + write, p["res_norm_m"], p["res_proj_m"])
            x2 = self.rmsnorm(h2, p["ln_post"], c.rms_norm_eps)
            delta = self.dense(p, x2) if i < c.first_k_dense_replace else self.moe(p, x2)
        prefix = prefix + delta
        h = self.mix(prefix, bank, self.nb, hd["res_norm"], hd["res_proj"])
        logits = self.proj(self.rmsnorm(h, hd["norm"], c.rms_norm_eps), hd["lm_head"])
        logits = logits.transpose(0, 1) if self.tdim == 0 else logits
        return logits[:, 0] if single else logits


# -- loading the built-in model's state dict ------------------------------------------------
_PRE = "language_model.model."


def _sources(c, i):
    """my weight name -> the built-in names concatenated (dim 0) into it, layer i."""
    L = f"{_PRE}layers.{i}."
    m = {"res_norm_a": [L + "self_attention_res_norm.weight"],
         "res_proj_a": [L + "self_attention_res_proj.weight"],
         "res_norm_m": [L + "mlp_res_norm.weight"], "res_proj_m": [L + "mlp_res_proj.weight"],
         "ln_in": [L + "input_layernorm.weight"],
         "ln_post": [L + "post_attention_layernorm.weight"]}
    a = L + "self_attn."
    if i in set(c.full_attn_layers):
        m.update({"qa_kva": [a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"],
                  "q_ln": [a + "q_a_layernorm.weight"], "kv_ln": [a + "kv_a_layernorm.weight"],
                  "q_b": [a + "q_b_proj.weight"], "kv_b": [a + "kv_b_proj.weight"],
                  "g": [a + "g_proj.weight"], "o": [a + "o_proj.weight"]})
    else:
        m.update({"in": [a + f"{n}_proj.weight" for n in ("q", "k", "v", "g", "f_a", "b")],
                  "f_b": [a + "f_b_proj.weight"],
                  "taps": [a + f"{n}_conv1d.weight" for n in ("q", "k", "v")],
                  "o_norm": [a + "o_norm.weight"], "o": [a + "o_proj.weight"],
                  "dt_bias": [a + "dt_bias"], "A_log": [a + "A_log"]})
    f = L + "mlp."
    if i < c.first_k_dense_replace:
        m.update({"gate_up": [f + "gate_proj.weight", f + "up_proj.weight"],
                  "down": [f + "down_proj.weight"]})
    else:
        m.update({"router": [f + "gate.weight"], "bias": [f + "gate.e_score_correction_bias"],
                  "lat_down": [f + "routed_expert_down_proj.weight"],
                  "lat_norm": [f + "routed_expert_norm.weight"],
                  "lat_up": [f + "routed_expert_up_proj.weight"],
                  "sh_gate_up": [f + "shared_experts.gate_proj.weight",
                                 f + "shared_experts.up_proj.weight"],
                  "sh_down": [f + "shared_experts.down_proj.weight"]})
        for w in ("w1", "w2", "w3"):
            m[f"{w}_q"] = [f + f"experts.{w}_packed"]
            m[f"{w}_s"] = [f + f"experts.{w}_scale"]
    return m


_HEAD = {"embed": [_PRE + "embed_tokens.weight"],
         "res_norm": [_PRE + "output_attn_res_norm.weight"],
         "res_proj": [_PRE + "output_attn_res_proj.weight"], "norm": [_PRE + "norm.weight"],
         "lm_head": ["language_model.lm_head.weight"]}

_STATES = {"conv": "self_attn.conv_state", "rec": "self_attn.recurrent_state",
           "kv": "self_attn.kv_cache"}


def _fill(flat: Flat, sources: dict, sd: dict):
    for name, srcs in sources.items():
        view = flat[name]
        src = torch.cat([sd[s].reshape(sd[s].shape[0], -1) if sd[s].dim() > 1 else sd[s]
                         for s in srcs], 0)
        if name == "A_log":  # stored per head, zero-padded past the heads: the heads' part
            src = src[:view.numel()]
        with torch.no_grad():
            view.copy_(src.reshape(view.shape))


def from_builtin(model) -> Spell13K3:
    c = model.config
    sd = model.state_dict()
    dtype = sd[_HEAD["embed"][0]].dtype
    kda0 = next(i for i in range(c.num_hidden_layers) if i not in set(c.full_attn_layers))
    fa_rank = sd[f"{_PRE}layers.{kda0}.self_attn.f_a_proj.weight"].shape[0]
    m = Spell13K3(c, dtype, model.max_batch + 1, model.max_seq_len, fa_rank)
    for i, flat in enumerate(m.layers):
        _fill(flat, _sources(c, i), sd)
    _fill(m.head, _HEAD, sd)
    bufs = dict(model.named_buffers())  # the states are not in the state dict
    with torch.no_grad():
        for name, buf in m.states.named_buffers():
            kind, i = name.split("_")
            buf.copy_(bufs[f"{_PRE}layers.{i}.{_STATES[kind]}"])
    return m


def state_of(m: Spell13K3) -> dict:
    """The states under the built-in model's buffer names (the same layouts)."""
    out = {}
    for name, buf in m.states.named_buffers():
        kind, i = name.split("_")
        out[f"{_PRE}layers.{i}.{_STATES[kind]}"] = buf
    return out
