"""A deliberately naive float64 Kimi K3 decode, written from `../shared/k3_arch.md` §2-3 only.

The test oracle for `k3compile.models.k3`: one token at a time, one head at a time, formulas as
the spec states them (the delta rule in its closed form `S <- (I - b k k^T) Diag(a) S + b k v^T`,
MXFP4 decoded bit by bit from the E2M1 layout, top-k by sorting). It imports nothing from the
model; it reads the model's weights by name from a state dict (TP=1, stacked experts) and keeps
its own float64 decode state in its own layout:

* `conv[layer]` [kernel - 1, 3W]: the last pre-conv q|k|v inputs, oldest first (time-major);
* `S[layer]` [H, K, V]: the KDA recurrent state;
* `cache[layer]` [max_len, C + R]: the MLA latent rows [c_kv | k_pe].

Tokens of one request are processed in order through all layers; the model instead runs each
layer over all tokens. Both are causal, so they must agree.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64
GROUP = 32


# ---------------------------------------------------------------------------------------------
# MXFP4


def e2m1(code: int) -> float:
    """E2M1 (1 sign, 2 exponent with bias 1, 1 mantissa bit); exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = 0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1.0 + 0.5 * man)
    return sign * mag


E2M1 = torch.tensor([e2m1(c) for c in range(16)], dtype=F64)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [out, in/2] (low nibble = even input) + E8M0 scale [out, in/32] -> [out, in]."""
    out_dim, half = packed.shape
    w = torch.empty(out_dim, 2 * half, dtype=F64)
    codes = packed.to(torch.int64)
    w[:, 0::2] = E2M1[codes & 0xF]
    w[:, 1::2] = E2M1[(codes >> 4) & 0xF]
    for g in range(scale.shape[1]):
        w[:, g * GROUP:(g + 1) * GROUP] *= 2.0 ** (scale[:, g].to(F64) - 127.0).unsqueeze(1)
    return w


# ---------------------------------------------------------------------------------------------
# weights and state


class Weights:
    """float64 views of a TP=1 state dict in the model's names, dequantised experts cached."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.sd = state_dict
        self._f64: dict[str, torch.Tensor] = {}
        self._experts: dict[tuple[str, str, int], torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._f64:
            self._f64[name] = self.sd[name].detach().to(F64)
        return self._f64[name]

    def expert(self, prefix: str, proj: str, e: int) -> torch.Tensor:
        key = (prefix, proj, e)
        if key not in self._experts:
            packed = self.sd[f"{prefix}experts.{proj}_packed"][e]
            scale = self.sd[f"{prefix}experts.{proj}_scale"][e]
            self._experts[key] = dequant_mxfp4(packed, scale)
        return self._experts[key]


class State:
    """Decode state of one request (slot), float64, zero at the start."""

    def __init__(self, config, max_len: int):
        c = config
        width = c.kda_num_heads * c.kda_head_dim
        self.conv, self.S, self.cache = {}, {}, {}
        for i in range(c.num_hidden_layers):
            if i in c.mla_layers:
                self.cache[i] = torch.zeros(max_len, c.kv_lora_rank + c.qk_rope_head_dim, dtype=F64)
            else:
                self.conv[i] = torch.zeros(c.short_conv_kernel_size - 1, 3 * width, dtype=F64)
                self.S[i] = torch.zeros(c.kda_num_heads, c.kda_head_dim, c.kda_head_dim, dtype=F64)


# ---------------------------------------------------------------------------------------------
# elementwise pieces


def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x):
    return x * sigmoid(x)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / math.sqrt(float((x * x).mean()) + eps) * w


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return beta * torch.tanh(g / beta) * sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def attn_res_mix(sources: list[torch.Tensor], w_norm, w_proj, eps: float) -> torch.Tensor:
    """Softmax over depth of a pseudo-query against RMS-normalised sources; raw sources mixed.
    sources: [v_0 .. v_{n-1}, prefix], each [D]."""
    if len(sources) == 1:
        return sources[0]
    q = w_norm * w_proj.reshape(-1)
    scores = []
    for v in sources:
        rms = math.sqrt(float((v * v).mean()) + eps)
        scores.append(float(((v / rms) * q).sum()))
    top = max(scores)
    ex = [math.exp(s - top) for s in scores]
    total = sum(ex)
    out = torch.zeros_like(sources[0])
    for e, v in zip(ex, sources, strict=True):
        out = out + (e / total) * v
    return out


# ---------------------------------------------------------------------------------------------
# blocks, one token


def kda_token(W: Weights, pre: str, x: torch.Tensor, st: State, layer: int, config) -> torch.Tensor:
    """One token through a KDA layer (pre = 'language_model.model.layers.{i}.self_attn.')."""
    c = config
    A_log = W(pre + "A_log")
    H = A_log.numel()
    K = W(pre + "o_norm.weight").numel()
    q_raw, k_raw, v_raw = (W(pre + f"{n}_proj.weight") @ x for n in "qkv")
    g2 = W(pre + "g_proj.weight") @ x
    graw = W(pre + "f_b_proj.weight") @ (W(pre + "f_a_proj.weight") @ x)
    b = W(pre + "b_proj.weight") @ x

    new = torch.cat([q_raw, k_raw, v_raw])
    window = torch.cat([st.conv[layer], new.unsqueeze(0)])  # [kernel, 3W], oldest first
    taps = torch.cat([W(pre + f"{n}_conv1d.weight") for n in "qkv"])[:, 0, :]  # [3W, kernel]
    conv = torch.zeros_like(new)
    for j in range(window.shape[0]):
        conv = conv + taps[:, j] * window[j]
    conv = silu(conv)
    st.conv[layer] = window[1:].clone()
    q_all, k_all, v_all = conv.split(H * K)

    outs = []
    eye = torch.eye(K, dtype=F64)
    for h in range(H):
        sl = slice(h * K, (h + 1) * K)
        q = q_all[sl] / math.sqrt(float((q_all[sl] ** 2).sum()) + c.l2norm_eps) / math.sqrt(K)
        k = k_all[sl] / math.sqrt(float((k_all[sl] ** 2).sum()) + c.l2norm_eps)
        v = v_all[sl]
        gate = math.exp(float(A_log[h])) * (graw[sl] + W(pre + "dt_bias")[sl])
        alpha = torch.exp(c.gate_lower_bound * sigmoid(gate))  # [K]
        beta = 1.0 / (1.0 + math.exp(-float(b[h])))
        S = st.S[layer][h]
        S = (eye - beta * torch.outer(k, k)) @ (alpha.unsqueeze(1) * S) + beta * torch.outer(k, v)
        st.S[layer][h] = S
        o = S.T @ q
        o = rms_norm(o, W(pre + "o_norm.weight"), c.rms_norm_eps) * sigmoid(g2[sl])
        outs.append(o)
    return W(pre + "o_proj.weight") @ torch.cat(outs)


def mla_token(W: Weights, pre: str, x: torch.Tensor, st: State, layer: int, pos: int,
              config) -> torch.Tensor:
    """One token at cache position `pos` through a Gated MLA layer, absorbed form."""
    c = config
    C, R, NOPE, VD = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    cq = rms_norm(W(pre + "q_a_proj.weight") @ x, W(pre + "q_a_layernorm.weight"), c.mla_norm_eps)
    ckv = W(pre + "kv_a_proj_with_mqa.weight") @ x
    c_kv = rms_norm(ckv[:C], W(pre + "kv_a_layernorm.weight"), c.mla_norm_eps)
    st.cache[layer][pos] = torch.cat([c_kv, ckv[C:]])
    q = W(pre + "q_b_proj.weight") @ cq
    g = W(pre + "g_proj.weight") @ x
    kv_b = W(pre + "kv_b_proj.weight")
    H = q.numel() // (NOPE + R)
    rows = st.cache[layer][: pos + 1]
    outs = []
    for h in range(H):
        qh = q[h * (NOPE + R):(h + 1) * (NOPE + R)]
        q_nope, q_pe = qh[:NOPE], qh[NOPE:]
        w_h = kv_b[h * (NOPE + VD):(h + 1) * (NOPE + VD)]
        w_uk, w_uv = w_h[:NOPE], w_h[NOPE:]  # [NOPE, C], [VD, C]
        q_lat = w_uk.T @ q_nope  # [C]
        scores = []
        for t in range(pos + 1):
            s = float(q_lat @ rows[t, :C]) + float(q_pe @ rows[t, C:])
            scores.append(s / math.sqrt(NOPE + R))
        top = max(scores)
        p = [math.exp(s - top) for s in scores]
        total = sum(p)
        o_lat = torch.zeros(C, dtype=F64)
        for t in range(pos + 1):
            o_lat = o_lat + (p[t] / total) * rows[t, :C]
        o = (w_uv @ o_lat) * sigmoid(g[h * VD:(h + 1) * VD])
        outs.append(o)
    return W(pre + "o_proj.weight") @ torch.cat(outs)


def route(W: Weights, pre: str, x: torch.Tensor, config) -> tuple[list[int], list[float]]:
    """Bias-corrected top-k: choose by sigmoid score + bias, weigh by renormalised raw scores."""
    s = sigmoid(W(pre + "gate.weight") @ x)
    biased = s + W(pre + "gate.e_score_correction_bias")
    order = sorted(range(s.numel()), key=lambda e: -float(biased[e]))
    chosen = order[: config.num_experts_per_token]
    total = sum(float(s[e]) for e in chosen)
    return chosen, [float(s[e]) / (total + 1e-20) * config.routed_scaling_factor for e in chosen]


def moe_token(W: Weights, pre: str, x: torch.Tensor, config) -> torch.Tensor:
    """Stable LatentMoE for one token (pre = 'language_model.model.layers.{i}.mlp.')."""
    c = config
    chosen, weights = route(W, pre, x, c)
    z = W(pre + "routed_expert_down_proj.weight") @ x
    u = torch.zeros_like(z)
    for e, w in zip(chosen, weights, strict=True):
        hg = W.expert(pre, "w1", e) @ z
        hu = W.expert(pre, "w3", e) @ z
        y = W.expert(pre, "w2", e) @ situ(hg, hu, c.situ_beta, c.situ_linear_beta)
        u = u + w * y
    u = rms_norm(u, W(pre + "routed_expert_norm.weight"), c.rms_norm_eps)
    routed = W(pre + "routed_expert_up_proj.weight") @ u
    return routed + mlp_token(W, pre + "shared_experts.", x, c)


def mlp_token(W: Weights, pre: str, x: torch.Tensor, config) -> torch.Tensor:
    """SiTU-GLU MLP: the dense layer 0 and the shared experts."""
    g = W(pre + "gate_proj.weight") @ x
    u = W(pre + "up_proj.weight") @ x
    return W(pre + "down_proj.weight") @ situ(g, u, config.situ_beta, config.situ_linear_beta)


# ---------------------------------------------------------------------------------------------
# the whole model


def decode_token(W: Weights, config, st: State, token: int, pos: int) -> torch.Tensor:
    """Logits [V] of one token of one request, updating its state."""
    c = config
    eps, bs = c.rms_norm_eps, c.attn_res_block_size
    prefix = W("language_model.model.embed_tokens.weight")[token]
    delta = None
    blocks: list[torch.Tensor] = []
    for i in range(c.num_hidden_layers):
        pre = f"language_model.model.layers.{i}."
        starts = i % bs == 0
        n = (i + bs - 1) // bs
        if i > 0:
            prefix = prefix + delta
        if starts:
            blocks.append(prefix)
        h = attn_res_mix(blocks[:n] + [prefix], W(pre + "self_attention_res_norm.weight"),
                         W(pre + "self_attention_res_proj.weight"), eps)
        x = rms_norm(h, W(pre + "input_layernorm.weight"), eps)
        if i in c.mla_layers:
            a = mla_token(W, pre + "self_attn.", x, st, i, pos, c)
        else:
            a = kda_token(W, pre + "self_attn.", x, st, i, c)
        prefix = a if starts else prefix + a
        h2 = attn_res_mix(blocks[: n + starts] + [prefix], W(pre + "mlp_res_norm.weight"),
                          W(pre + "mlp_res_proj.weight"), eps)
        x2 = rms_norm(h2, W(pre + "post_attention_layernorm.weight"), eps)
        if i >= c.first_k_dense_replace:
            delta = moe_token(W, pre + "mlp.", x2, c)
        else:
            delta = mlp_token(W, pre + "mlp.", x2, c)
    prefix = prefix + delta
    h = attn_res_mix(blocks + [prefix], W("language_model.model.output_attn_res_norm.weight"),
                     W("language_model.model.output_attn_res_proj.weight"), eps)
    h = rms_norm(h, W("language_model.model.norm.weight"), eps)
    return W("language_model.lm_head.weight") @ h


def decode_step(W: Weights, config, states: dict[int, State], input_ids: torch.Tensor,
                positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """input_ids [B, T], positions [B], slots [B] -> logits [B, T, V]; states keyed by slot."""
    B, T = input_ids.shape
    out = torch.empty(B, T, W("language_model.lm_head.weight").shape[0], dtype=F64)
    for b in range(B):
        st = states[int(slots[b])]
        for t in range(T):
            out[b, t] = decode_token(W, config, st, int(input_ids[b, t]), int(positions[b]) + t)
    return out
