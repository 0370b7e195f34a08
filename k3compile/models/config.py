"""Kimi K3 text-model configurations (`../shared/k3_arch.md` §1) and one tensor-parallel rank's slice.

`tp_size` only shapes the weights a rank holds (heads split, experts sliced along the intermediate
dim, router/latent projections replicated as in vLLM, spec §4.2). Whether collectives run is decided
at run time by the process group handed to the model, so a TP16-rank model can be benchmarked on
one GPU with world size 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class K3Config:
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-5
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792
    # Stable LatentMoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    routed_scaling_factor: float = 1.0
    # Gated MLA (NoPE, output gate)
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_norm_eps: float = 1e-6  # Moonshot's reference builds the low-rank norms with its default
    # Attention Residuals
    attn_res_block_size: int = 12
    # KDA
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    l2norm_eps: float = 1e-6
    # Full-attention (MLA) layers, 0-based; None = K3's schedule (every 4th layer and the last).
    full_attn_layers: tuple[int, ...] | None = None
    # Tensor-parallel slice this model holds.
    tp_size: int = 1
    name: str = "k3"

    def __post_init__(self):
        for heads, what in ((self.kda_num_heads, "KDA heads"), (self.num_attention_heads, "MLA heads")):
            if heads % self.tp_size:
                raise ValueError(f"tp_size={self.tp_size} does not divide the {heads} {what}")
        for width, what in (
            (self.moe_intermediate_size, "moe_intermediate_size"),
            (self.intermediate_size, "intermediate_size"),
            (self.vocab_size, "vocab_size"),
        ):
            if width % self.tp_size:
                raise ValueError(f"tp_size={self.tp_size} does not divide {what}={width}")
        if (self.moe_intermediate_size // self.tp_size) % 32 or self.routed_expert_hidden_size % 32:
            raise ValueError("MXFP4 experts need input widths that are multiples of 32 per rank")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        if self.full_attn_layers is not None:
            return self.full_attn_layers
        n = self.num_hidden_layers
        return tuple(i for i in range(n) if (i + 1) % 4 == 0 or i == n - 1)

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def num_blocks(self) -> int:
        """Slots of the AttnRes block bank: ceil(layers / block size)."""
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    def with_tp(self, tp_size: int) -> K3Config:
        return dataclasses.replace(self, tp_size=tp_size, name=f"{self.name.split('_tp')[0]}_tp{tp_size}")

    def with_layers(self, n: int) -> K3Config:
        """The same model cut to its first n layers (benchmarks keep K3's per-layer shapes)."""
        mla = tuple(i for i in self.mla_layers if i < n)
        return dataclasses.replace(self, num_hidden_layers=n, full_attn_layers=mla)

    # Per-rank widths.
    @property
    def kda_heads_local(self) -> int:
        return self.kda_num_heads // self.tp_size

    @property
    def mla_heads_local(self) -> int:
        return self.num_attention_heads // self.tp_size

    @property
    def shared_intermediate(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size


_K3 = K3Config()

CONFIGS: dict[str, K3Config] = {
    "k3": _K3,
    "k3_tp8": _K3.with_tp(8),
    "k3_tp16": _K3.with_tp(16),
    # a few hundred MB: K3's structure (3:1 KDA:MLA, 12-layer blocks, head dim 128) at 1/7 width
    "small": K3Config(
        name="small", vocab_size=32768, hidden_size=1024, num_hidden_layers=13,
        intermediate_size=2816, num_experts=64, num_experts_per_token=8, num_shared_experts=2,
        moe_intermediate_size=256, routed_expert_hidden_size=512, num_attention_heads=8,
        q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, kda_num_heads=8, kda_head_dim=128,
    ),
    # CPU tests: every block type, two AttnRes blocks, MLA in the middle and last
    "tiny": K3Config(
        name="tiny", vocab_size=512, hidden_size=256, num_hidden_layers=6, attn_res_block_size=3,
        intermediate_size=512, num_experts=16, num_experts_per_token=4, num_shared_experts=2,
        moe_intermediate_size=128, routed_expert_hidden_size=128, num_attention_heads=4,
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, kda_num_heads=4, kda_head_dim=64,
    ),
}


def get_config(name: str, tp_size: int | None = None) -> K3Config:
    try:
        cfg = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; known: {sorted(CONFIGS)}") from None
    return cfg.with_tp(tp_size) if tp_size not in (None, cfg.tp_size) else cfg


__all__ = ["CONFIGS", "K3Config", "get_config"]
