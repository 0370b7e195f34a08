"""Moonshot's `KimiLinearForCausalLM` as the built-in decode step: `step(input_ids, positions,
slots) -> logits`, one static graph per step.

What Moonshot's code does around the layer math does not trace into one graph: the expert loop
counts tokens per expert through `.cpu().numpy()`, the model forward branches on cache positions
and runs under transformers' input-check wrapper, `KimiDynamicCache` grows full K/V by `torch.cat`,
and the KDA core is a call into fla's Triton kernels. The adapter replaces exactly that plumbing:

* a structural clone of the model whose parameters and buffers *are* the model's (no copy; the
  user's model is left as it was, so it stays the eager reference);
* static per-slot state on the clone's attention modules: KDA conv state [S, 3D, W - 1] (q|k|v:
  the inputs the next step's window reads; fla keeps W, the oldest never read again) and fp32 recurrent state [S, H, K, V]; MLA a latent cache [S, L, kv_lora_rank + rope],
  S = max_batch + 1 (the last slot is scratch for batch padding);
* `SlotCache`, handed to Moonshot's decoder layers as their cache: it gathers and writes the
  state rows of `slots`;
* the expert loop as per-token gathers of the stacked expert weights (`moe_infer` below); experts
  loaded as compressed-tensors MXFP4 (the release's checkpoint) are gathered packed and
  dequantised as compressed-tensors does (`k3compile.adapt.compressed`), so they fuse into
  `k3.moe_experts`; packed experts in another layout are refused;
  at W > 1 ranks (`adapt(..., group=)`, experts loaded 1/W per rank by
  `moonshot.from_pretrained(..., group=)`) the ranks' expert outputs are summed (all-reduce);
* the MLA forward over the latent cache (kv_b applied to the cached latents: the non-absorbed form
  the canonical rule `mla_absorb` rewrites), the rest of the layer as Moonshot wrote it;
* fla's entry points bound to k3compile's torch stand-ins (`k3compile.adapt.fla`).

Moonshot's decoder layers (AttnRes, norms, MoE block, router, KDA projections) run unchanged.
Slots start empty: `reset_cache()` (or a fresh adapter) before a request's first step, which
consumes its prompt as one [B, T] step at position 0.
"""

from __future__ import annotations

import copy
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from k3compile.adapt import compressed, fla
from k3compile.adapt.stacks import stack_experts, tensor_names


class SlotCache:
    """The cache Moonshot's layers read and write, backed by the adapter's slot buffers."""

    def __init__(self, attn: dict[int, nn.Module], slots: torch.Tensor, positions: torch.Tensor):
        self.attn, self.slots, self.positions = attn, slots, positions
        self.conv_states = _ConvStates(self)
        self.recurrent_states = _RecurrentStates(self)

    def latent_window(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """Write latent [B, T, C] at rows positions .. positions + T - 1 of each slot's MLA cache;
        the slots' whole caches [B, L, C]."""
        cache = self.attn[layer].kv_cache
        B, T = latent.shape[:2]
        rows = self.positions.view(B, 1) + torch.arange(T, device=latent.device)
        cache[self.slots.view(B, 1), rows] = latent
        return cache[self.slots]

    def causal_mask(self, T: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, T, L]: token t of a request sees cache rows <= its position."""
        B = self.positions.shape[0]
        rows = self.positions.view(B, 1) + torch.arange(T, device=self.positions.device)
        cols = torch.arange(length, device=self.positions.device)
        visible = cols.view(1, 1, -1) <= rows.unsqueeze(-1)
        mask = torch.zeros(B, T, length, dtype=dtype, device=self.positions.device)
        return mask.masked_fill(~visible, torch.finfo(dtype).min).unsqueeze(1)


class _ConvStates:
    """conv_states[layer]: (q, k, v) states [B, D, W - 1] of the slots; assignment writes them.
    The three are slices of one gathered buffer, written back as one: what lets the canonical rule
    `conv_merge` make Moonshot's three ShortConvolutions the one q|k|v conv kda_decode takes."""

    def __init__(self, cache: SlotCache):
        self.cache = cache

    def __getitem__(self, layer: int):
        state = self.cache.attn[layer].conv_state[self.cache.slots]
        return state.chunk(3, dim=1)

    def __setitem__(self, layer: int, qkv) -> None:
        self.cache.attn[layer].conv_state[self.cache.slots] = torch.cat(qkv, dim=1)


class _RecurrentStates:
    """recurrent_states[layer]: the slots' fp32 states in the layout Moonshot asks fla for
    (`transpose_state_layout=True`: [B, H, V, K]); stored [S, H, K, V]."""

    def __init__(self, cache: SlotCache):
        self.cache = cache

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.cache.attn[layer].recurrent_state[self.cache.slots].transpose(-1, -2)

    def __setitem__(self, layer: int, state: torch.Tensor) -> None:
        self.cache.attn[layer].recurrent_state[self.cache.slots] = state.transpose(-1, -2)


# ---- the replaced forwards ----------------------------------------------------------------------


def moe_infer(self, x, topk_ids, topk_weight):
    """`KimiSparseMoeBlock.moe_infer` without the host loop: each token's k experts' weights
    gathered from the stacked expert weights, the expert's activation on its GEMMs, the same
    fp32-weighted sum."""
    w1 = expert_weights(self, "w1", topk_ids, x.dtype)  # [N, k, F, D]
    w3 = expert_weights(self, "w3", topk_ids, x.dtype)
    w2 = expert_weights(self, "w2", topk_ids, x.dtype)  # [N, k, D, F]
    gate = torch.einsum("nd,nkfd->nkf", x, w1)
    up = torch.einsum("nd,nkfd->nkf", x, w3)
    expert = self.experts[0]
    if expert.config.hidden_act == "situ":
        act = expert.act_fn(torch.cat([gate, up], dim=-1))
    else:
        act = expert.act_fn(gate) * up
    y = torch.einsum("nkf,nkdf->nkd", act, w2)
    y = y.type(topk_weight.dtype).mul(topk_weight.unsqueeze(-1)).sum(dim=1).type(y.dtype)
    if self.expert_group is not None:  # this rank's intermediate slice: a partial sum
        y = funcol.all_reduce(y, "sum", self.expert_group)
    return y


def expert_weights(block: nn.Module, projection: str, ids: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The `projection` ("w1", "w3", "w2") weights [N, k, out, in] of each token's experts:
    gathered from the stacked weights, or dequantised from the stacked packed bytes of
    compressed-tensors MXFP4 experts (`k3compile.adapt.compressed`)."""
    if block.mxfp4_experts:
        packed, scale = expert_tensors(block, projection)
        return compressed.dequant(packed[ids], scale[ids], dtype)
    (weight,) = expert_tensors(block, projection)
    return weight[ids]


def expert_tensors(block: nn.Module, projection: str) -> list[torch.Tensor]:
    """The experts' `projection` tensors stacked [E, ...] (weight; or packed bytes and scales):
    the block's stacks (`stacks.stack_experts`), one graph input each, or else stacked from the E
    experts' parameters (the canonical rule `expert_stack` makes that a view)."""
    names = tensor_names(block)
    if block.expert_stacks is not None:
        return [getattr(block, f"stacked_{projection}_{name}") for name in names]
    return [torch.stack([getattr(getattr(e, projection), name) for e in block.experts])
            for name in names]


def mla_forward(attention_fn):
    """`KimiMLAAttention.forward` over the latent cache: the new token's normalised latent and
    rope part are cached, kv_b is applied to every cached latent, then Moonshot's attention."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None,
                past_key_values=None, **kwargs):
        cache: SlotCache = past_key_values
        B, T = hidden_states.shape[:-1]
        if self.q_lora_rank is not None:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q_states = self.q_proj(hidden_states)
        q_states = q_states.view(B, T, -1, self.q_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], -1)

        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states),
                                    [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        window = cache.latent_window(self.layer_idx,
                                     torch.cat([self.kv_a_layernorm(latent), k_rot], dim=-1))
        L = window.shape[1]
        latents, k_rot = torch.split(window, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pass = self.kv_b_proj(latents).view(B, L, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_pass, value_states = torch.split(k_pass.transpose(1, 2),
                                           [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rot = k_rot.view(B, 1, L, self.qk_rope_head_dim).expand(*k_pass.shape[:-1], -1)
        query_states = torch.cat((q_pass, q_rot), dim=-1)
        key_states = torch.cat((k_pass, k_rot), dim=-1)

        mask = cache.causal_mask(T, L, query_states.dtype)
        attn_output, _ = attention_fn(self, query_states, key_states, value_states, mask,
                                      dropout=0.0, scaling=self.scaling)
        attn_output = attn_output.reshape(B, T, -1).contiguous()
        if self.use_output_gate:
            attn_output = attn_output * self.g_proj(hidden_states).sigmoid()
        return self.o_proj(attn_output)

    return forward


def _rebound(fn, **names):
    """fn with some of its module globals replaced (Moonshot's KDA forward calling the
    stand-ins instead of fla's kernels)."""
    scope = dict(fn.__globals__, **names)
    new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def _subclass(cls: type, **methods) -> type:
    """The adapted class, also bound to its name in this module: pickle finds a class by its
    module and name, and Dynamo pickles the module types its guards name where torch's warm
    start is on (`TORCH_CACHING_PRECOMPILE=1`, k3compile/precompile.py); unbound, that pickle
    failed the whole compile."""
    name = f"Adapted{cls.__name__}"
    made = type(name, (cls,), {"__module__": __name__, "__qualname__": name, **methods})
    globals()[name] = made
    return made


def _adapt_modules(lm: nn.Module, users: nn.Module, group=None) -> None:
    """Swap the classes of the clone's modules whose forward is plumbing (in place); `users`:
    the model `lm` is a clone of."""
    made: dict[type, type] = {}
    names = {module: name for name, module in lm.named_modules()}

    def swap(module, **methods):
        cls = type(module)
        if cls not in made:
            made[cls] = _subclass(cls, **methods)
        module.__class__ = made[cls]

    for module in lm.modules():
        name = type(module).__name__
        globals_ = sys.modules[type(module).__module__].__dict__
        if name == "KimiSparseMoeBlock":
            swap(module, moe_infer=moe_infer)
            module.mxfp4_experts = compressed.check_experts(names[module], module.experts)
            module.expert_group = _expert_group(names[module], module, group)
            stack_experts(names[module], module, users.get_submodule(names[module]))
        elif name == "KimiMLAAttention":
            swap(module, forward=mla_forward(globals_["eager_attention_forward"]))
        elif name == "KimiDeltaAttention":
            swap(module, forward=_rebound(type(module).forward, chunk_kda=fla.chunk_kda,
                                          fused_recurrent_kda=fla.fused_recurrent_kda))
        elif name == "ShortConvolution" and not isinstance(module, fla.ShortConvolution):
            swap(module, forward=fla.ShortConvolution.forward)
        elif name == "FusedRMSNormGated" and not isinstance(module, fla.FusedRMSNormGated):
            swap(module, forward=fla.FusedRMSNormGated.forward)


def _expert_group(name: str, block: nn.Module, group):
    """The group whose ranks' expert outputs the block sums (None: experts whole), checked
    against the part of the experts the block holds (`compressed.shard_experts`)."""
    rank, world = getattr(block, "expert_shard", (0, 1))
    ranks = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    if (rank, world) != ranks:
        raise ValueError(f"{name} holds expert part {rank} of {world}, adapted as rank "
                         f"{ranks[0]} of {ranks[1]}: load with moonshot.from_pretrained(..., "
                         "group=) and adapt with the same group")
    return group if world > 1 else None


def structural_clone(module: nn.Module) -> nn.Module:
    """A copy of the module tree that holds the same Parameter and buffer objects."""
    memo = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return copy.deepcopy(module, memo)


class MoonshotStep(nn.Module):
    """The decode step over Moonshot's `KimiLinearForCausalLM` (see the module docstring).

    `forward(input_ids, positions, slots=None)`: input_ids [B] or [B, T], positions [B] (cache
    position of each request's first new token), slots [B] (default 0..B-1) -> logits [B, V] or
    [B, T, V] in the model dtype.
    """

    def __init__(self, causal_lm: nn.Module, max_batch: int, max_seq_len: int, device=None,
                 dtype=None, group=None):
        super().__init__()
        self.lm = structural_clone(causal_lm)
        _adapt_modules(self.lm, causal_lm, group)
        self.config = self.lm.config
        self.setup_cache(max_batch, max_seq_len, device, dtype)

    @property
    def scratch_slot(self) -> int:
        return self.max_batch

    def _attention(self) -> dict[int, nn.Module]:
        return {i: layer.self_attn for i, layer in enumerate(self.lm.model.layers)}

    def setup_cache(self, max_batch: int, max_seq_len: int, device=None, dtype=None):
        ref = self.lm.lm_head.weight
        device, dtype = device or ref.device, dtype or ref.dtype
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        slots = max_batch + 1
        for attn in self._attention().values():
            if hasattr(attn, "kv_a_proj_with_mqa"):
                width = attn.kv_lora_rank + attn.qk_rope_head_dim
                attn.register_buffer("kv_cache", torch.zeros(
                    slots, max_seq_len, width, device=device, dtype=dtype), persistent=False)
            else:
                conv = attn.q_conv1d
                width = conv.weight.shape[0] + attn.k_conv1d.weight.shape[0] + \
                    attn.v_conv1d.weight.shape[0]
                attn.register_buffer("conv_state", torch.zeros(
                    slots, width, conv.weight.shape[-1] - 1, device=device, dtype=dtype),
                    persistent=False)
                attn.register_buffer("recurrent_state", torch.zeros(
                    slots, attn.num_heads, attn.head_k_dim, attn.head_dim, device=device,
                    dtype=torch.float32), persistent=False)
        return self

    def reset_cache(self):
        for attn in self._attention().values():
            for name in ("kv_cache", "conv_state", "recurrent_state"):
                if getattr(attn, name, None) is not None:
                    getattr(attn, name).zero_()

    def forward(self, input_ids, positions, slots=None):
        single = input_ids.dim() == 1
        ids = input_ids.unsqueeze(1) if single else input_ids
        if slots is None:
            slots = torch.arange(ids.shape[0], device=ids.device)
        model = self.lm.model
        hidden = model.embed_tokens(ids)
        cache = SlotCache(self._attention(), slots, positions)
        if model.use_attn_residuals:
            B, T, D = hidden.shape
            blocks = hidden.new_zeros(B * T, 0, D)
            for layer in model.layers:
                hidden, blocks = layer(hidden, past_key_values=cache, block_residual=blocks)
            hidden = model._apply_output_attn_res(hidden, blocks)
        else:
            for layer in model.layers:
                hidden = layer(hidden, past_key_values=cache)
        logits = self.lm.lm_head(model.norm(hidden))
        return logits.squeeze(1) if single else logits


def adapt(model: nn.Module, max_batch: int = 8, max_seq_len: int = 256, device=None,
          dtype=None, group=None) -> MoonshotStep:
    """The built-in decode-step call over Moonshot's model (`KimiLinearForCausalLM`, or a
    `KimiK3ForConditionalGeneration`'s language model), sharing its parameters. `group`: the
    ranks a model loaded by `moonshot.from_pretrained(..., group=)` splits its experts over."""
    causal_lm = getattr(model, "language_model", model)
    if not hasattr(causal_lm, "lm_head") or not hasattr(getattr(causal_lm, "model", None),
                                                        "layers"):
        raise TypeError(f"adapt takes Moonshot's KimiLinearForCausalLM or "
                        f"KimiK3ForConditionalGeneration, not {type(model).__name__}")
    compressed.check_not_wrapped(causal_lm)
    _einops_ready()
    return MoonshotStep(causal_lm, max_batch, max_seq_len, device, dtype, group).eval()


def _einops_ready() -> None:
    """einops picks its torch backend at its first call and keeps it in a module dict; Dynamo's
    guards over Moonshot's `rearrange` read that dict's first entry. Torch's warm start
    (`TORCH_CACHING_PRECOMPILE=1`) builds those guards before the first call, and on an empty
    dict it failed (IndexError). One call now fills it as the traced process had."""
    try:
        import einops
    except ImportError:
        return
    einops.rearrange(torch.zeros(1), "a -> a")
