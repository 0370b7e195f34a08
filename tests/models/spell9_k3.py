"""Kimi K3 decode written a ninth time, blind, as a port from JAX/Flax (spell9), from
`../shared/k3_arch.md` §2-3 alone.

Written without reading `k3compile/models/k3.py`, `k3compile/math.py`, `patterns/`,
`k3compile/canonical/` or the other spellings' code. Taken from outside the spec: the harness
(`tests/spellings/foreign.py`, `tests/e2e/test_spell5_spelling.py`): the decode-step interface
`model(input_ids [B] or [B, T], positions [B], slots [B]) -> logits [B, (T,) V]`, state per slot
(the last slot the scratch slot); the built-in model's state-dict and buffer names and shapes
(printed); README's MXFP4 conventions (low nibble first, `2^(s - 127)`); the idiom lists of
spell5-8 and the red-team spelling (docstrings only, to pick different ones). Single rank.

Idioms: a functional port, as someone who thinks in JAX/Flax would write it.

* **parameters as a tree, used as a flat dict**: every weight lives in a `ParamTree` (nested
  containers built from path strings, as Flax's `unflatten_dict`); the step reads it back as one
  flat `dict` keyed by dotted paths (`"layers.3.attn.wq.kernel"`) and hands each pure function
  its sub-dict (`subtree(p, "layers.3.attn")`). Dense weights are **Flax kernels [in, out]** used
  as `x @ kernel` (the checkpoint's [out, in] transposed at load); conv kernels Flax's [K, 1, C];
  norm weights are `scale`; the embedding `embedding` [V, D] read with `torch.take_along_dim`-free
  `jnp.take`-style indexing; MXFP4 packed bytes and scales are uint8 buffers in the same tree.
* **dtype policy** (jmp style): `Policy(param_dtype, compute_dtype=fp32)`, `policy.cast_to_compute`
  around norms, softmax, routing, decay and the recurrence, `policy.cast_to_output` after them.
* RMSNorm as `x * rsqrt(mean(x * x, -1, keepdim=True) + eps)` in fp32, times the scale in fp32
  (Flax's order), then cast; one function for every norm (input, post-attention, final, MLA
  low-rank with eps 1e-6, KDA head norm, latent MoE norm, AttnRes source norms without scale).
* everything shape-polymorphic with ellipsis `einsum` strings ("...hd,...hde->...he");
  activations keep the ids' shape ([B, D] or [B, T, D]).
* AttnRes: the bank a preallocated zeros [..., NB, D] updated out of place (`.at[j].set` as
  `torch.index_copy` without the underscore); a mix stacks `narrow`ed bank sources and the
  prefix on axis -2, scores by `einsum("...sd,d->...s")` against the pseudo-query kernel,
  `torch.softmax` in fp32, mixes raw sources by `einsum("...s,...sd->...d")`; n = 0 skipped
  (a static Python branch, the identity).
* KDA: six separate Dense kernels; a **recurrent cell scanned over T** (`scan(cell, carry, xs)`,
  `lax.scan` written as a Python loop that stacks the outputs): the carry is (conv window
  time-major [B, K-1, 3W], recurrent state [B, H, K, V] fp32); the short conv runs **inside the
  cell**, one token at a time, as `einsum("bkc,kc->bc", cat(window, x_t), taps)` + SiLU; l2 norm
  `x * rsqrt(sum(square(x)) + eps)`, q scaled by d^-1/2; decay `exp(-5 * sigmoid(exp(A_log) *
  (g + dt_bias)))` computed for all T before the scan; the delta rule for one head written for
  [K, V] and **`torch.vmap`ped over heads and batch** (`jax.vmap`); the new carry returned and
  written into the caller's state at the end of the step (`index_copy_` on the slots, after
  every layer ran); the conv state stored time-major [slots, K-1, 3W] (`state_of` transposes).
* Gated MLA, absorbed, functional cache: the request's whole cache row block gathered
  (`cache[slots]`, [B, L, C+R]), the new rows put in out of place with `torch.index_put`
  (`.at[b, pos].set`), attention over all L rows, `torch.where(pos_k <= pos_q, s, -inf)` mask,
  W_UK / W_UV as einsums against kv_b's kernel viewed [C, H, n + v]; `cat(q_lat, q_pe)` scored
  with one `einsum("b...hr,blr->b...hl")`; the updated block written back with `index_copy_` at
  the end of the step.
* LatentMoE: router `x @ kernel` in fp32, sigmoid, `torch.topk` of the biased scores,
  `torch.take_along_dim` of the unbiased ones, renormalised; the experts' packed bytes gathered by
  the [N, k] ids (`packed[idx]`), MXFP4 decoded by integer arithmetic (`bitwise_and`,
  `bitwise_right_shift`, E2M1 from its sign / exponent / mantissa bits, sign via `torch.where`),
  scales by `torch.ldexp` on 32-blocks (`unflatten` of the input axis); one expert's SiTU-GLU
  written for a single token and **`torch.vmap`ped over the k slots and the tokens**; the combine
  `einsum("...k,...kd->...d")` in fp32.
* SiTU-GLU `b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2)` in fp32 (`soft_clip` helper).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "language_model."

# Idioms `Spell9K3.set_probe` switches to another spelling of the same math, to bisect a lost
# fusion (added after the blind commit; the default path is the blind one):
# linear: Dense weights stored [out, in] (torch's layout) and applied by `F.linear`;
# einsum_kda: the delta rule as ellipsis einsums over [B, H, ...] (no vmap);
# einsum_experts: the experts' GEMMs as einsums over [N, k, ...] (no vmap);
# gather: `torch.gather` for `take_along_dim`;
# cache_inplace: the MLA cache row written in place (`index_put_`) before the rows are read;
# pow: the norms' mean of `x.pow(2)` for `x * x`;
# ffn_flat: the FFN (dense or MoE) on tokens flattened [B*T, D] (no unit T dim at T = 1).
# conv_outside: the short conv over all T before the recurrence's scan (`unfold(1, K, 1)` of the
# time-major window times the taps, summed), not one token at a time inside the cell;
# rows: the AttnRes mixes and the norms after them on tokens flattened [B*T, ...].
PROBES = ("linear", "einsum_kda", "einsum_experts", "gather", "cache_inplace", "pow", "ffn_flat",
          "conv_outside", "rows")
_probes: frozenset = frozenset()  # the probes of the step being traced (set by `forward`)


@dataclasses.dataclass(frozen=True)
class Policy:
    """jmp-style mixed precision: parameters and activations in `param_dtype`, the sensitive math
    in `compute_dtype`."""

    param_dtype: torch.dtype
    compute_dtype: torch.dtype = torch.float32

    def cast_to_compute(self, x):
        return x.to(self.compute_dtype)

    def cast_to_output(self, x):
        return x.to(self.param_dtype)


class ParamTree(nn.Module):
    """Nested containers made from a flat {path: tensor} dict (Flax's unflatten_dict); floats are
    Parameters, integers (the packed experts) buffers, `persistent` as given."""

    def __init__(self, flat: dict, buffers: bool = False):
        super().__init__()
        for path, t in flat.items():
            node = self
            *parents, leaf = path.split(".")
            for name in parents:
                if not hasattr(node, name):
                    node.add_module(name, nn.Module())
                node = getattr(node, name)
            if buffers or not t.is_floating_point():
                node.register_buffer(leaf, t)
            else:
                node.register_parameter(leaf, nn.Parameter(t, requires_grad=False))

    def flat(self) -> dict:
        return {**dict(self.named_parameters()), **dict(self.named_buffers())}


def kernel(p: dict, name: str):
    """The Dense kernel [in, out] (a transposed view where the probe `linear` stores [out, in])."""
    w = p[name + ".kernel"]
    return w.t() if "linear" in _probes else w


def dense(x, p: dict, name: str):
    w = p[name + ".kernel"]
    return F.linear(x, w) if "linear" in _probes else x @ w


def subtree(p: dict, prefix: str) -> dict:
    n = len(prefix) + 1
    return {k[n:]: v for k, v in p.items() if k.startswith(prefix + ".")}


def scan(cell, carry, xs):
    """lax.scan over axis 1 of every tensor in the tuple `xs`; outputs stacked on axis 1."""
    ys = []
    for t in range(xs[0].shape[1]):
        carry, y = cell(carry, tuple(x[:, t] for x in xs))
        ys.append(y)
    return carry, torch.stack(ys, 1)


# ----------------------------------------------------------------------------------- basics


def rms_norm(policy, x, scale, eps):
    x = policy.cast_to_compute(x)
    y = x * torch.rsqrt(torch.mean(x.pow(2) if "pow" in _probes else x * x, -1, keepdim=True)
                        + eps)
    if scale is not None:
        y = y * policy.cast_to_compute(scale)
    return policy.cast_to_output(y)


def soft_clip(x, beta):
    return beta * torch.tanh(x / beta)


def situ(policy, g, u, b1, b2):
    g, u = policy.cast_to_compute(g), policy.cast_to_compute(u)
    return policy.cast_to_output(soft_clip(g, b1) * torch.sigmoid(g) * soft_clip(u, b2))


def l2_normalize(x, eps):
    return x * torch.rsqrt(torch.sum(torch.square(x), -1, keepdim=True) + eps)


# ------------------------------------------------------------------------------------ AttnRes


def attn_res(policy, p, prefix, bank, n, eps):
    """Mix of bank[..., :n, :] and the prefix; n = 0 is the identity."""
    if n == 0:
        return prefix
    src = torch.cat([bank.narrow(-2, 0, n), prefix.unsqueeze(-2)], -2)
    src = policy.cast_to_compute(src)
    normed = src * torch.rsqrt(torch.mean(src * src, -1, keepdim=True) + eps)
    query = policy.cast_to_compute(p["norm.scale"]) * policy.cast_to_compute(kernel(p, "query")[:, 0])
    scores = torch.einsum("...sd,d->...s", normed, query)
    alpha = torch.softmax(scores, -1)
    return policy.cast_to_output(torch.einsum("...s,...sd->...d", alpha, src))


def mix_norm(policy, p, prefix, bank, n, scale, eps):
    """RMSNorm(attn_res(...)); probe `rows`: on the tokens flattened [B*T, ...]."""
    if "rows" in _probes:
        rows = mix_norm_rows(policy, p, prefix.flatten(0, 1), bank.flatten(0, 1), n, scale, eps)
        return rows.view_as(prefix)
    return mix_norm_rows(policy, p, prefix, bank, n, scale, eps)


def mix_norm_rows(policy, p, prefix, bank, n, scale, eps):
    return rms_norm(policy, attn_res(policy, p, prefix, bank, n, eps), scale, eps)


def bank_set(bank, j, value):
    """bank.at[..., j, :].set(value), out of place."""
    index = torch.tensor([j], device=bank.device)
    return torch.index_copy(bank, bank.dim() - 2, index, value.unsqueeze(-2))


# ---------------------------------------------------------------------------------------- KDA


def delta_rule_head(S, q, k, v, alpha, beta):
    """One head, one token: S [K, V]; q, k, alpha [K]; v [V]; beta []."""
    S = alpha[:, None] * S
    u = beta * (v - k @ S)
    S = S + torch.outer(k, u)
    return q @ S, S


delta_rule = torch.vmap(torch.vmap(delta_rule_head))  # over batch, then heads


def kda_step(policy, cfg, p, x, state):
    """x [B, T, D]; state (conv window [B, K-1, 3W], S [B, H, K, V] fp32) -> (y, new state)."""
    H, dk = cfg.kda_num_heads, cfg.kda_head_dim
    W = H * dk
    q, k, v = dense(x, p, "wq"), dense(x, p, "wk"), dense(x, p, "wv")
    g2 = dense(x, p, "wg")
    graw = dense(dense(x, p, "wf_a"), p, "wf_b")
    b = dense(x, p, "wb")
    taps = torch.cat([p[f"{s}_conv.kernel"][:, 0] for s in "qkv"], -1)  # [K, 3W]

    graw = policy.cast_to_compute(graw).unflatten(-1, (H, dk))
    a_log = policy.cast_to_compute(p["A_log"][:H])
    dt = policy.cast_to_compute(p["dt_bias"]).view(H, dk)
    alpha = torch.exp(cfg.gate_lower_bound * torch.sigmoid(torch.exp(a_log)[:, None] * (graw + dt)))
    beta = torch.sigmoid(policy.cast_to_compute(b))

    qkv = torch.cat([q, k, v], -1)
    if "conv_outside" in _probes:  # the conv over all T before the scan, spell5's accepted form
        window = torch.cat([state[0], qkv], 1)  # [B, K-1+T, 3W]
        conv = F.silu((window.unfold(1, taps.shape[0], 1) * taps.t()).sum(-1))  # [B, T, 3W]
        state, qkv = (None, state[1]), conv

    def cell(carry, inputs):
        window, S = carry
        qkv_t, alpha_t, beta_t = inputs
        if window is None:
            win, y = None, qkv_t
        else:
            win = torch.cat([window, qkv_t.unsqueeze(1)], 1)
            y = F.silu(torch.einsum("bkc,kc->bc", win, taps))
        qt, kt, vt = (policy.cast_to_compute(t).unflatten(-1, (H, dk)) for t in y.split(W, -1))
        qt = l2_normalize(qt, cfg.l2norm_eps) * dk ** -0.5
        kt = l2_normalize(kt, cfg.l2norm_eps)
        if "einsum_kda" in _probes:
            S = alpha_t.unsqueeze(-1) * S
            u = beta_t.unsqueeze(-1) * (vt - torch.einsum("...hk,...hkv->...hv", kt, S))
            S = S + torch.einsum("...hk,...hv->...hkv", kt, u)
            o = torch.einsum("...hk,...hkv->...hv", qt, S)
        else:
            o, S = delta_rule(S, qt, kt, vt, alpha_t, beta_t)
        return (None if win is None else win[:, 1:], S), o

    new_state, o = scan(cell, state, (qkv, alpha, beta))
    if "conv_outside" in _probes:
        new_state = (window[:, -(taps.shape[0] - 1):], new_state[1])
    o = rms_norm(policy, o, p["o_norm.scale"], cfg.rms_norm_eps)
    o = o * torch.sigmoid(g2.unflatten(-1, (H, dk)))
    return dense(o.flatten(-2), p, "wo"), new_state


# ---------------------------------------------------------------------------------------- MLA


def mla_step(policy, cfg, p, x, cache, slots, positions):
    """x [B, T, D]; cache [slots, L, C+R] -> (y, the requests' updated block [B, L, C+R])."""
    H, C, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    B, T, L = x.shape[0], x.shape[1], cache.shape[1]
    cq = rms_norm(policy, dense(x, p, "wq_a"), p["q_norm.scale"], cfg.mla_norm_eps)
    ckv = dense(x, p, "wkv_a")
    c_kv = rms_norm(policy, ckv[..., :C], p["kv_norm.scale"], cfg.mla_norm_eps)
    k_pe = ckv[..., C:]
    q = dense(cq, p, "wq_b").unflatten(-1, (H, n + R))
    q_nope, q_pe = q[..., :n], q[..., n:]
    g = dense(x, p, "wg")

    kv_b = kernel(p, "wkv_b").unflatten(-1, (H, n + dv))  # [C, H, n + v]
    w_uk, w_uv = kv_b[..., :n], kv_b[..., n:]
    q_lat = torch.einsum("...hn,chn->...hc", q_nope, w_uk)

    pos_q = positions[:, None] + torch.arange(T, device=x.device)  # [B, T]
    batch = torch.arange(B, device=x.device)[:, None].expand(B, T)
    if "cache_inplace" in _probes:
        cache.index_put_((slots[:, None].expand(B, T), pos_q), torch.cat([c_kv, k_pe], -1))
        rows = cache[slots]
    else:
        rows = torch.index_put(cache[slots], (batch, pos_q), torch.cat([c_kv, k_pe], -1))

    scores = torch.einsum("b...hr,blr->b...hl", torch.cat([q_lat, q_pe], -1), rows)
    scores = policy.cast_to_compute(scores) * (n + R) ** -0.5
    pos_k = torch.arange(L, device=x.device)
    visible = pos_k[None, None, None, :] <= pos_q[:, :, None, None]  # [B, T, 1, L]
    probs = torch.softmax(torch.where(visible, scores, -math.inf), -1)
    o_lat = torch.einsum("b...hl,blc->b...hc", policy.cast_to_output(probs), rows[..., :C])
    o = torch.einsum("...hc,chv->...hv", o_lat, w_uv).flatten(-2)
    o = o * torch.sigmoid(g)
    return dense(o, p, "wo"), rows


# ---------------------------------------------------------------------------------------- MoE


def e2m1_decode(codes):
    """E2M1 nibble -> value, from its sign / exponent / mantissa bits."""
    sign = torch.bitwise_and(torch.bitwise_right_shift(codes, 3), 1)
    exp = torch.bitwise_and(torch.bitwise_right_shift(codes, 1), 3)
    man = torch.bitwise_and(codes, 1).float()
    mag = torch.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * torch.exp2(exp.float() - 1.0))
    return torch.where(sign == 1, -mag, mag)


def mxfp4_decode(packed, scale):
    """packed uint8 [..., out, in/2], scale E8M0 [..., out, in/32] -> fp32 [..., out, in]."""
    lo = torch.bitwise_and(packed, 15)
    hi = torch.bitwise_right_shift(packed, 4)
    codes = torch.stack([lo, hi], -1).flatten(-2)
    vals = e2m1_decode(codes).unflatten(-1, (scale.shape[-1], 32))
    return torch.ldexp(vals, scale.int().unsqueeze(-1) - 127).flatten(-2)


def moe_step(policy, cfg, p, x):
    """x [..., D] -> [..., D]."""
    b1, b2, k = cfg.situ_beta, cfg.situ_linear_beta, cfg.num_experts_per_token
    logits = dense(policy.cast_to_compute(x), {k: policy.cast_to_compute(v) for k, v in p.items()
                                                  if k.startswith("router.")}, "router")
    scores = torch.sigmoid(logits)
    _, idx = torch.topk(scores + policy.cast_to_compute(p["router.bias"]), k, -1)
    if "gather" in _probes:
        w = torch.gather(scores, -1, idx)
    else:
        w = torch.take_along_dim(scores, idx, -1)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor

    z = dense(x, p, "latent_down")
    flat_z, flat_idx = z.reshape(-1, z.shape[-1]), idx.reshape(-1, k)
    w1, w3, w2 = (
        mxfp4_decode(p[f"experts.{m}.packed"][flat_idx], p[f"experts.{m}.scale"][flat_idx])
        .to(x.dtype) for m in ("w1", "w3", "w2"))

    def expert(w1, w3, w2, z):
        return w2 @ situ(policy, w1 @ z, w3 @ z, b1, b2)

    if "einsum_experts" in _probes:
        h = situ(policy, torch.einsum("nkil,nl->nki", w1, flat_z),
                 torch.einsum("nkil,nl->nki", w3, flat_z), b1, b2)
        ys = torch.einsum("nkli,nki->nkl", w2, h)
    else:
        ys = torch.vmap(torch.vmap(expert, in_dims=(0, 0, 0, None)))(w1, w3, w2, flat_z)
    ys = ys.reshape(*idx.shape, -1)
    u = torch.einsum("...k,...kd->...d", w, policy.cast_to_compute(ys))
    u = rms_norm(policy, u, p["latent_norm.scale"], cfg.rms_norm_eps)
    routed = dense(u, p, "latent_up")
    shared = situ(policy, dense(x, p, "shared.gate"), dense(x, p, "shared.up"), b1, b2)
    return routed + dense(shared, p, "shared.down")


def dense_step(policy, cfg, p, x):
    h = situ(policy, dense(x, p, "gate"), dense(x, p, "up"), cfg.situ_beta,
             cfg.situ_linear_beta)
    return dense(h, p, "down")


# -------------------------------------------------------------------------------------- model


class Spell9K3(nn.Module):
    def __init__(self, cfg, params: dict, cache: dict, dtype):
        super().__init__()
        self.cfg, self.policy = cfg, Policy(dtype)
        self.params = ParamTree(params)
        self.cache = ParamTree(cache, buffers=True)
        self.probes = frozenset()

    def set_probe(self, *probes):
        assert set(probes) <= set(PROBES), probes
        if "linear" in probes and "linear" not in self.probes:
            for name, w in self.params.named_parameters():
                if name.endswith(".kernel") and w.dim() == 2:
                    w.data = w.data.t().contiguous()
        self.probes = frozenset(probes)
        return self

    def is_mla(self, i):
        return i in self.cfg.full_attn_layers

    def forward(self, input_ids, positions, slots=None):
        global _probes
        _probes = self.probes
        cfg, policy = self.cfg, self.policy
        p, cache = self.params.flat(), self.cache.flat()
        rows = input_ids.dim() == 2
        ids = input_ids if rows else input_ids[:, None]
        B, T = ids.shape
        if slots is None:
            slots = torch.arange(B, device=ids.device)
        eps, bs = cfg.rms_norm_eps, cfg.attn_res_block_size
        nb = -(-cfg.num_hidden_layers // bs)

        prefix = p["embed.embedding"][ids]  # [B, T, D]
        bank = prefix.new_zeros(B, T, nb, cfg.hidden_size)
        delta, new_cache = None, {}
        for i in range(cfg.num_hidden_layers):
            lp = subtree(p, f"layers.{i}")
            n, write = -(-i // bs), i % bs == 0
            if delta is not None:
                prefix = prefix + delta
            if write:
                bank = bank_set(bank, i // bs, prefix)
            x = mix_norm(policy, subtree(lp, "attn_res"), prefix, bank, n, lp["attn_norm.scale"],
                         eps)
            ap = subtree(lp, "attn")
            if self.is_mla(i):
                key = f"layers.{i}.attn.kv_cache"
                a, rows_ = mla_step(policy, cfg, ap, x, cache[key], slots, positions)
                if "cache_inplace" not in _probes:
                    new_cache[key] = rows_
            else:
                keys = (f"layers.{i}.attn.conv_state", f"layers.{i}.attn.recurrent_state")
                state = tuple(cache[key][slots] for key in keys)
                a, new_state = kda_step(policy, cfg, ap, x, state)
                new_cache.update(zip(keys, new_state))
            prefix = a if write else prefix + a
            x2 = mix_norm(policy, subtree(lp, "ffn_res"), prefix, bank, n + write,
                          lp["ffn_norm.scale"], eps)
            fp = subtree(lp, "ffn")
            ffn = dense_step if i < cfg.first_k_dense_replace else moe_step
            if "ffn_flat" in _probes:
                delta = ffn(policy, cfg, fp, x2.flatten(0, 1)).view_as(x2)
            else:
                delta = ffn(policy, cfg, fp, x2)

        prefix = prefix + delta
        h = mix_norm(policy, subtree(p, "final_res"), prefix, bank, nb, p["final_norm.scale"], eps)
        logits = dense(h, p, "lm_head")
        for key, value in new_cache.items():
            cache[key].index_copy_(0, slots, value.to(cache[key].dtype))
        return logits if rows else logits[:, 0]


# ------------------------------------------------------------------------------ loading


def _names(cfg):
    """(builtin name, spell9 path, transform) for every weight."""
    T = torch.Tensor.t
    out = [("model.embed_tokens.weight", "embed.embedding", None),
           ("model.output_attn_res_norm.weight", "final_res.norm.scale", None),
           ("model.output_attn_res_proj.weight", "final_res.query.kernel", T),
           ("model.norm.weight", "final_norm.scale", None),
           ("lm_head.weight", "lm_head.kernel", T)]
    for i in range(cfg.num_hidden_layers):
        b, s = f"model.layers.{i}.", f"layers.{i}."
        out += [(b + "input_layernorm.weight", s + "attn_norm.scale", None),
                (b + "post_attention_layernorm.weight", s + "ffn_norm.scale", None),
                (b + "self_attention_res_norm.weight", s + "attn_res.norm.scale", None),
                (b + "self_attention_res_proj.weight", s + "attn_res.query.kernel", T),
                (b + "mlp_res_norm.weight", s + "ffn_res.norm.scale", None),
                (b + "mlp_res_proj.weight", s + "ffn_res.query.kernel", T)]
        a, sa = b + "self_attn.", s + "attn."
        if i in cfg.full_attn_layers:
            out += [(a + f"{src}.weight", sa + f"{dst}.kernel", T) for src, dst in (
                ("q_a_proj", "wq_a"), ("q_b_proj", "wq_b"), ("kv_a_proj_with_mqa", "wkv_a"),
                ("kv_b_proj", "wkv_b"), ("g_proj", "wg"), ("o_proj", "wo"))]
            out += [(a + "q_a_layernorm.weight", sa + "q_norm.scale", None),
                    (a + "kv_a_layernorm.weight", sa + "kv_norm.scale", None)]
        else:
            out += [(a + f"{m}_proj.weight", sa + f"w{m}.kernel", T)
                    for m in ("q", "k", "v", "g", "f_a", "f_b", "b", "o")]
            out += [(a + f"{m}_conv1d.weight", sa + f"{m}_conv.kernel",
                     lambda w: w.permute(2, 1, 0)) for m in "qkv"]
            out += [(a + "dt_bias", sa + "dt_bias", None), (a + "A_log", sa + "A_log", None),
                    (a + "o_norm.weight", sa + "o_norm.scale", None)]
        m, sm = b + "mlp.", s + "ffn."
        if i < cfg.first_k_dense_replace:
            out += [(m + f"{x}_proj.weight", sm + f"{x}.kernel", T) for x in ("gate", "up", "down")]
        else:
            out += [(m + "gate.weight", sm + "router.kernel", T),
                    (m + "gate.e_score_correction_bias", sm + "router.bias", None),
                    (m + "routed_expert_down_proj.weight", sm + "latent_down.kernel", T),
                    (m + "routed_expert_norm.weight", sm + "latent_norm.scale", None),
                    (m + "routed_expert_up_proj.weight", sm + "latent_up.kernel", T)]
            out += [(m + f"shared_experts.{x}_proj.weight", sm + f"shared.{x}.kernel", T)
                    for x in ("gate", "up", "down")]
            out += [(m + f"experts.{w}_{kind}", sm + f"experts.{w}.{kind2}", None)
                    for w in ("w1", "w3", "w2") for kind, kind2 in (("packed", "packed"),
                                                                  ("scale", "scale"))]
    return out


def _state_names(cfg):
    """(builtin buffer, spell9 cache path, to-builtin layout)."""
    out = []
    for i in range(cfg.num_hidden_layers):
        b, s = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        if i in cfg.full_attn_layers:
            out.append((b + "kv_cache", s + "kv_cache", lambda t: t))
        else:
            out.append((b + "conv_state", s + "conv_state", lambda t: t.transpose(1, 2)))
            out.append((b + "recurrent_state", s + "recurrent_state", lambda t: t))
    return out


def from_builtin(model) -> Spell9K3:
    """A Spell9K3 with the built-in model's weights and (copied, re-laid-out) states."""
    cfg = model.config if hasattr(model, "config") else model.cfg
    sd = {k.removeprefix(PREFIX): v for k, v in model.state_dict().items()}
    bufs = {k.removeprefix(PREFIX): v for k, v in model.named_buffers()}
    params = {dst: (fn(sd[src]) if fn else sd[src]).detach().clone().contiguous()
              for src, dst, fn in _names(cfg)}
    cache = {dst: fn(bufs[src]).detach().clone().contiguous()
             for src, dst, fn in _state_names(cfg)}
    # the conv state's layout is time-major here: builtin [slots, 3W, K-1] -> [slots, K-1, 3W]
    dtype = sd["model.embed_tokens.weight"].dtype
    return Spell9K3(cfg, params, cache, dtype)


def state_of(model: Spell9K3) -> dict:
    """The states under the built-in model's buffer names and layouts."""
    cache = model.cache.flat()
    return {PREFIX + src: fn(cache[dst]) for src, dst, fn in _state_names(model.cfg)}
