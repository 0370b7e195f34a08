"""The fused-op layer: every fused op is a `torch.library` custom op in the `k3` namespace, one op
per module, named as the op (`k3.kda_decode` is `k3compile/ops/kda_decode.py`).

Each op has a fake (shape) implementation and a CPU implementation that is its torch reference
(written with `k3compile.math`, the math the model uses, so a rewritten graph equals eager on CPU)
and, where it has any, the op-level constraints (`<op>_refusal`). The reference is registered for
every device; a CuTe DSL kernel in `k3compile.kernels` replaces it on CUDA when its module is
imported and the DSL is present (`k3compile.kernels.register_all`), and registers its own limits
in `registry`. `side_streams` is the stream runtime of the ops with a `stream` argument and of
the scheduling ops (`stream_fork`, `stream_join`, `prefetch_l2`).
"""

from k3compile.ops import (
    allreduce_attn_res_mix_norm,
    attn_res_mix_norm,
    expert_stack,
    fb_kda_decode,
    kda_decode,
    linear,
    linear_concat,
    mla_decode,
    mla_lowrank_norm,
    mla_q_absorb,
    mla_uv_gate,
    moe_experts,
    moe_front,
    moe_front_route,
    moe_route,
    norm_linear,
    oproj_attn_res_mix_norm,
    prefetch_l2,
    rms_norm,
    situ_gate_up,
    stream_fork,
    stream_join,
)

__all__ = [
    "allreduce_attn_res_mix_norm", "attn_res_mix_norm", "expert_stack", "fb_kda_decode", "kda_decode", "linear",
    "linear_concat", "mla_decode", "mla_lowrank_norm", "mla_q_absorb", "mla_uv_gate",
    "moe_experts", "moe_front", "moe_front_route", "moe_route", "norm_linear", "oproj_attn_res_mix_norm",
    "prefetch_l2", "rms_norm", "situ_gate_up", "stream_fork", "stream_join",
]
OPS = tuple(__all__)  # every module above is the op torch.ops.k3.<its name>
