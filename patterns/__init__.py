"""Rewrite patterns, one per file. The order of `ORDER` is the priority order: larger fusions
first, so a smaller pattern never splits a site a larger one would take."""

from __future__ import annotations

import functools
import importlib

ORDER = (
    "kda_decode",
    "mla_decode",
    "mla_lowrank_norm",
    "linear_concat",  # after mla_lowrank_norm: the MLA variant is the two GEMMs feeding its op
    "fb_kda_decode",  # consumes kda_decode's op where f_b's GEMM (on linear_concat's f_a) feeds it
    "mla_q_absorb",
    "mla_uv_gate",
    "attn_res_mix_norm",
    "allreduce_attn_res_mix_norm",  # consumes attn_res_mix_norm's op where a collective feeds it
    "oproj_attn_res_mix_norm",  # consumes attn_res_mix_norm's op where o_proj feeds it (W = 1)
    "moe_experts",
    "moe_front",
    "moe_route",  # after moe_front: its logits come from the fused front
    "moe_front_route",  # consumes moe_front's and moe_route's ops (option front_route)
    "situ_gate_up",
    "norm_linear",
    "norm_linear_residual",  # consumes norm_linear's op where the shared experts' output is added
    "rms_norm",  # after every larger fusion above: each ends in or holds an RMSNorm
    "linear",  # last: a plain GEMM, what every fusion above left of the GEMMs
)


@functools.cache
def all_patterns():
    """Every pattern variant, in priority order (traced lazily, once per process)."""
    out = []
    for name in ORDER:
        out += importlib.import_module(f"{__name__}.{name}").patterns()
    return tuple(out)
