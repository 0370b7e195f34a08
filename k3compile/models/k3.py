"""Kimi K3 text model, decode step only, written the way the released modeling code reads.

Nothing is pre-fused: separate q/k/v/g projections, separate router and latent projections, plain
RMSNorm modules, SiTU written out. The backend has to find every fusion itself. Block by block this
follows `../shared/k3_arch.md` §2-3:

* Attention Residuals: no residual stream; `prefix`, the block bank (a list of completed block
  sums, slot 0 = the embedding) and `delta` flow through the stack, two depth mixes per layer.
* KDA (layers not in `config.mla_layers`): short conv + SiLU with conv state, L2-normalised q/k,
  lower-bounded decay, delta rule on an fp32 state, per-head RMSNorm x sigmoid gate.
* Gated MLA: absorbed form over a latent cache [c_kv | k_pe], NoPE, sigmoid output gate.
* Stable LatentMoE: fp32 sigmoid router, bias-corrected top-k with unbiased renormalised weights,
  latent down-projection, MXFP4 experts with SiTU-GLU, routed RMSNorm, up-projection, shared experts.

Decode state (KDA recurrent + conv state, MLA latent cache) is preallocated per batch slot by
`setup_cache` and updated in place, so the traced graph is the same at every step. The last slot is
a scratch slot: rows that only pad a batch point there and never touch a real request's state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from k3compile.calls import check_calls
from k3compile.math import (
    delta_rule_step,
    depth_mix,
    e2m1_table,
    l2norm,
    mxfp4_experts,
    rms_norm,
    route_top_k,
    situ,
)
from k3compile.models import mxfp4
from k3compile.models.config import K3Config


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return x
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group)


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, multiply by the weight (Moonshot's reference order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.kda_heads_local
        self.head_dim = c.kda_head_dim
        width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.g_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.f_a_proj = nn.Linear(c.hidden_size, c.kda_head_dim, bias=False)  # replicated under TP
        self.f_b_proj = nn.Linear(c.kda_head_dim, width, bias=False)
        self.b_proj = nn.Linear(c.hidden_size, self.num_heads, bias=False)
        kernel = c.short_conv_kernel_size
        self.q_conv1d = nn.Conv1d(width, width, kernel, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, kernel, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, kernel, groups=width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.o_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.o_proj = nn.Linear(width, c.hidden_size, bias=False)
        self.lower_bound = c.gate_lower_bound
        self.l2_eps = c.l2norm_eps
        self.register_buffer("conv_state", None, persistent=False)  # [slots, 3W, kernel - 1]
        self.register_buffer("recurrent_state", None, persistent=False)  # [slots, H, K, V] fp32

    def setup_cache(self, slots: int, device, dtype):
        width = self.num_heads * self.head_dim
        kernel = self.q_conv1d.kernel_size[0]
        self.register_buffer(
            "conv_state", torch.zeros(slots, 3 * width, kernel - 1, device=device, dtype=dtype),
            persistent=False,
        )
        self.register_buffer(
            "recurrent_state",
            torch.zeros(slots, self.num_heads, self.head_dim, self.head_dim, device=device,
                        dtype=torch.float32),
            persistent=False,
        )

    def _l2norm(self, x: torch.Tensor) -> torch.Tensor:
        return l2norm(x, self.l2_eps)

    def forward(self, x: torch.Tensor, slots: torch.Tensor, group=None) -> torch.Tensor:
        # x: [B, T, D]; rows of one request are consecutive tokens
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        g2 = self.g_proj(x)
        graw = self.f_b_proj(self.f_a_proj(x))
        beta = torch.sigmoid(self.b_proj(x).float())  # [B, T, H]

        # short causal conv + SiLU over [3 cached inputs, T new] per channel
        new = torch.cat([q, k, v], dim=-1).transpose(1, 2)  # [B, 3W, T]
        window = torch.cat([self.conv_state[slots], new], dim=-1)  # [B, 3W, 3 + T]
        self.conv_state[slots] = window[..., T:]
        taps = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        conv = F.conv1d(window.float(), taps.float().to(window.device), groups=taps.shape[0])
        conv = F.silu(conv).to(x.dtype).transpose(1, 2)  # [B, T, 3W]
        q, k, v = conv.split(H * K, dim=-1)

        q = self._l2norm(q.float().view(B, T, H, K)) * K**-0.5
        k = self._l2norm(k.float().view(B, T, H, K))
        v = v.float().view(B, T, H, K)
        gate = torch.exp(self.A_log.float()).view(H, 1) * (graw.float().view(B, T, H, K) + self.dt_bias.view(H, K))
        decay = torch.exp(self.lower_bound * torch.sigmoid(gate))  # [B, T, H, K] in (e^-5, 1)

        state = self.recurrent_state[slots]  # [B, H, K, V]
        outs = []
        for t in range(T):
            state, o_t = delta_rule_step(state, q, k, v, beta, decay, t)
            outs.append(o_t)
        self.recurrent_state[slots] = state
        o = torch.stack(outs, dim=1)  # [B, T, H, V] fp32

        o = self.o_norm(o.to(x.dtype)) * torch.sigmoid(g2.view(B, T, H, K))
        return _all_reduce(self.o_proj(o.reshape(B, T, H * K)), group)


class GatedMLA(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.mla_heads_local
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.mla_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.num_heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.mla_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(c.hidden_size, self.num_heads * self.v_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, c.hidden_size, bias=False)
        self.softmax_scale = (self.nope + self.rope) ** -0.5
        self.register_buffer("kv_cache", None, persistent=False)  # [slots, max_len, C + R]

    def setup_cache(self, slots: int, max_seq_len: int, device, dtype):
        self.register_buffer(
            "kv_cache",
            torch.zeros(slots, max_seq_len, self.kv_lora_rank + self.rope, device=device, dtype=dtype),
            persistent=False,
        )

    def forward(self, x, slots, positions, group=None) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        cq = self.q_a_layernorm(self.q_a_proj(x))
        ckv = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = ckv.split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q = self.q_b_proj(cq).view(B, T, H, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        g = self.g_proj(x)

        # absorbed form: fold W_UK into the query, W_UV after attention
        wkv_b = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = wkv_b.split([self.nope, self.v_dim], dim=1)
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)  # [B, T, H, C]

        # cache write: rows pos .. pos + T - 1 of each request's slot
        pos = positions.view(B, 1) + torch.arange(T, device=x.device)  # [B, T]
        self.kv_cache[slots.view(B, 1), pos] = torch.cat([c_kv, k_pe], dim=-1)
        cache = self.kv_cache[slots]  # [B, L, C + R]
        kv_lat, kv_pe = cache.split([self.kv_lora_rank, self.rope], dim=-1)
        scores = torch.einsum("bthc,blc->bthl", q_lat, kv_lat) + torch.einsum("bthr,blr->bthl", q_pe, kv_pe)
        scores = scores.float() * self.softmax_scale
        visible = torch.arange(cache.shape[1], device=x.device).view(1, 1, -1) <= pos.unsqueeze(-1)
        scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
        p = torch.softmax(scores, dim=-1).to(x.dtype)
        o_lat = torch.einsum("bthl,blc->bthc", p, kv_lat)
        o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * self.v_dim)
        o = o * torch.sigmoid(g)
        return _all_reduce(self.o_proj(o), group)


class SiTUMLP(nn.Module):
    """Dense layer 0 and the shared experts: down(SiTU(gate(x), up(x)))."""

    def __init__(self, config: K3Config, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.beta, self.linear_beta = config.situ_beta, config.situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


class MoEGate(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32))
        self.top_k = config.num_experts_per_token
        self.scaling = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        return route_top_k(logits, self.e_score_correction_bias, self.top_k, self.scaling)


class MXFP4Experts(nn.Module):
    """All routed experts of a layer, stacked. Checkpoint names are per expert
    (`experts.{e}.w1.weight_packed`, ...); the loader maps them onto these stacks."""

    def __init__(self, config: K3Config):
        super().__init__()
        E, L = config.num_experts, config.routed_expert_hidden_size
        inter = config.moe_intermediate_size // config.tp_size
        u8 = dict(dtype=torch.uint8)
        self.w1_packed = nn.Parameter(torch.zeros(E, inter, L // 2, **u8), requires_grad=False)
        self.w1_scale = nn.Parameter(torch.zeros(E, inter, L // 32, **u8), requires_grad=False)
        self.w3_packed = nn.Parameter(torch.zeros(E, inter, L // 2, **u8), requires_grad=False)
        self.w3_scale = nn.Parameter(torch.zeros(E, inter, L // 32, **u8), requires_grad=False)
        self.w2_packed = nn.Parameter(torch.zeros(E, L, inter // 2, **u8), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.zeros(E, L, inter // 32, **u8), requires_grad=False)
        self.register_buffer("e2m1", e2m1_table(), persistent=False)
        self.beta, self.linear_beta = config.situ_beta, config.situ_linear_beta

    def forward(self, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # z [N, L], idx/weights [N, k]; W4A16: dequantise the selected experts, bf16 GEMMs
        return mxfp4_experts(z, idx, weights, self.e2m1.to(z.dtype), self.w1_packed, self.w1_scale,
                             self.w3_packed, self.w3_scale, self.w2_packed, self.w2_scale,
                             self.beta, self.linear_beta)


class LatentMoE(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        c = config
        self.gate = MoEGate(c)
        self.routed_expert_down_proj = nn.Linear(c.hidden_size, c.routed_expert_hidden_size, bias=False)
        self.experts = MXFP4Experts(c)
        self.routed_expert_norm = RMSNorm(c.routed_expert_hidden_size, c.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(c.routed_expert_hidden_size, c.hidden_size, bias=False)
        self.shared_experts = SiTUMLP(c, c.hidden_size, c.shared_intermediate // c.tp_size)

    def forward(self, x: torch.Tensor, group=None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, weights = self.gate(x)
        z = self.routed_expert_down_proj(x)
        u = _all_reduce(self.experts(z, idx, weights), group)  # experts sliced along intermediate
        routed = self.routed_expert_up_proj(self.routed_expert_norm(u))
        shared = _all_reduce(self.shared_experts(x), group)
        return (routed + shared).view(shape)


class DenseMLP(SiTUMLP):
    def forward(self, x: torch.Tensor, group=None) -> torch.Tensor:
        return _all_reduce(super().forward(x), group)


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.is_mla = c.is_mla(layer_idx)
        self.self_attn = GatedMLA(c, layer_idx) if self.is_mla else KimiDeltaAttention(c, layer_idx)
        if c.is_moe(layer_idx):
            self.mlp = LatentMoE(c)
        else:
            self.mlp = DenseMLP(c, c.hidden_size, c.intermediate_size // c.tp_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attention_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attention_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
        self.mlp_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
        self.block_size = c.attn_res_block_size

    def forward(self, prefix, delta, blocks, slots, positions, group=None):
        i = self.layer_idx
        starts_block = i % self.block_size == 0
        n = -(-i // self.block_size)
        if i > 0:
            prefix = prefix + delta
        if starts_block:
            blocks = [*blocks, prefix]
        h = depth_mix(prefix, blocks[:n], self.self_attention_res_norm, self.self_attention_res_proj)
        x = self.input_layernorm(h)
        if self.is_mla:
            a = self.self_attn(x, slots, positions, group)
        else:
            a = self.self_attn(x, slots, group)
        prefix = a if starts_block else prefix + a
        h2 = depth_mix(prefix, blocks[: n + starts_block], self.mlp_res_norm, self.mlp_res_proj)
        delta = self.mlp(self.post_attention_layernorm(h2), group)
        return prefix, delta, blocks


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.output_attn_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, input_ids, slots, positions, group=None) -> torch.Tensor:
        prefix = self.embed_tokens(input_ids)  # [B, T, D]
        delta = torch.zeros_like(prefix)
        blocks: list[torch.Tensor] = []
        for layer in self.layers:
            prefix, delta, blocks = layer(prefix, delta, blocks, slots, positions, group)
        prefix = prefix + delta
        h = depth_mix(prefix, blocks, self.output_attn_res_norm, self.output_attn_res_proj)
        return self.norm(h)


class K3LanguageModel(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // config.tp_size, bias=False)


class K3ForCausalLM(nn.Module):
    """The decode step: `model(input_ids, positions, slots=None) -> logits`.

    input_ids [B] (one new token per request) or [B, T] (T > 1: speculative verify rows);
    positions [B] the cache position of each request's first new token; slots [B] the state slot
    of each request (default 0..B-1; padding rows use `scratch_slot`).
    Returns logits [B, V] or [B, T, V] in the model dtype.
    """

    def __init__(self, config: K3Config, group=None):
        super().__init__()
        self.config = config
        self.group = group  # a ProcessGroup for tensor parallelism, None for world size 1
        self.language_model = K3LanguageModel(config)
        self.max_batch = 0
        check_calls(self, ("input_ids", "positions", "slots"))  # before Dynamo traces

    @property
    def scratch_slot(self) -> int:
        return self.max_batch

    def setup_cache(self, max_batch: int, max_seq_len: int, device=None, dtype=None):
        """Preallocate decode state for max_batch requests (+ one scratch slot)."""
        ref = self.language_model.lm_head.weight
        device = device or ref.device
        dtype = dtype or ref.dtype
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        for layer in self.language_model.model.layers:
            if layer.is_mla:
                layer.self_attn.setup_cache(max_batch + 1, max_seq_len, device, dtype)
            else:
                layer.self_attn.setup_cache(max_batch + 1, device, dtype)
        return self

    def reset_cache(self):
        for buf in self.buffers():
            if buf.dtype != torch.uint8 and buf.dim() >= 3:
                buf.zero_()

    def forward(self, input_ids, positions, slots=None):
        if self.max_batch == 0:
            raise RuntimeError("call setup_cache(max_batch, max_seq_len) before decoding")
        single = input_ids.dim() == 1
        ids = input_ids.unsqueeze(1) if single else input_ids
        if slots is None:
            slots = torch.arange(ids.shape[0], device=ids.device)
        hidden = self.language_model.model(ids, slots, positions, self.group)
        logits = self.language_model.lm_head(hidden)
        if self.group is not None:
            import torch.distributed._functional_collectives as funcol

            # gathered along dim 0 and laid out by hand: torch 2.11's Dynamo cannot trace the
            # chunk-cat that gather_dim=-1 does (the H200 machine's torch)
            world = dist.get_world_size(self.group)
            parts = funcol.all_gather_tensor(logits.contiguous(), gather_dim=0, group=self.group)
            parts = parts.view(world, *logits.shape)  # [W, B, T, V/W]
            logits = parts.permute(1, 2, 0, 3).reshape(*logits.shape[:-1], -1)
        return logits.squeeze(1) if single else logits

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """Seeded random weights that keep activations finite through any depth.

        Each tensor is drawn from its own generator seeded by (seed, name), so a TP rank slice of a
        full model can be cut from the same draw (see `loader.shard_state_dict`).
        """
        for name, p in self.named_parameters():
            gen = torch.Generator(device=p.device).manual_seed(_name_seed(seed, name))
            _init_param(name, p, gen, self.config)
        return self


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _init_param(name: str, p: nn.Parameter, gen: torch.Generator, c: K3Config):
    leaf = name.rsplit(".", 1)[-1]
    if p.dtype == torch.uint8:  # MXFP4 experts: draw packed codes and scales together
        if leaf.endswith("_packed"):
            width = p.shape[-1] * 2
            packed, _ = mxfp4.random_mxfp4(tuple(p.shape[:-1]) + (width,), width**-0.5, gen, p.device)
            p.copy_(packed)
        else:
            width = p.shape[-1] * 32
            _, scale = mxfp4.random_mxfp4(tuple(p.shape[:-1]) + (width,), width**-0.5, gen, p.device)
            p.copy_(scale)
        return
    if name.endswith("A_log"):
        p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0, generator=gen))
    elif name.endswith("dt_bias"):
        p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * 0.5)
    elif name.endswith("e_score_correction_bias"):
        p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * 0.05)
    elif "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device))
    elif "conv1d" in name:
        p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * 0.5)
    elif name.endswith("embed_tokens.weight"):
        p.copy_(torch.randn(p.shape, generator=gen, device=p.device))
    else:  # linear [out, in], the depth mixes' pseudo-queries `*_res_proj` [1, D] among them
        fan_in = p.shape[-1]
        p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * fan_in**-0.5)


def build_model(config: K3Config, device=None, dtype=torch.bfloat16, seed: int = 0, group=None,
                max_batch: int = 8, max_seq_len: int = 256) -> K3ForCausalLM:
    """A seeded random K3 of the given config, state allocated, in eval mode."""
    with torch.device(device or "cpu"):
        model = K3ForCausalLM(config, group)
    model.init_weights(seed)
    model.to(dtype=dtype)
    for mod in model.modules():  # fp32 by the spec: router bias, KDA decay parameters
        for pname in ("e_score_correction_bias", "dt_bias", "A_log"):
            if hasattr(mod, pname) and isinstance(getattr(mod, pname), nn.Parameter):
                getattr(mod, pname).data = getattr(mod, pname).data.float()
    model.setup_cache(max_batch, max_seq_len)
    return model.eval().requires_grad_(False)


__all__ = ["K3ForCausalLM", "RMSNorm", "build_model"]
