"""CUDA implementation of `k3::mla_uv_gate`: MLA's per-head value up-projection times its gate.

    o[b, t, h·V + v] = bf16(bf16(Σ_c o_lat[b, t, h, c] · W_UV[h, v, c]) · bf16(sigmoid(g)))

gemv's gate variant at M <= gemv.GEMV_MAX_M where settings.KERNELS.gemv_fused names "gate" (the
default), else the reference.

Constraints:
    * o_lat [B, T, H, C], W_UV [H, V, C] (a view of kv_b's weight), g [B, T, H·V].
    * The kernel takes B·T <= gemv.GEMV_MAX_M rows and gemv's gate limits (`refusal`); the
      pattern leaves every other site to Inductor, where the reference would run op by op.
"""

import torch

from k3compile.ops import registry
from k3compile.ops.linear_concat import concatenated
from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

from .common import gemv
from .common.dsl import on_stream

OP = "mla_uv_gate"


def refusal(o_lat, w_uv, g) -> str | None:
    """Why the gate variant would not take these operands (tensors or metas), or None."""
    (b, t, h, c), v = o_lat.shape, w_uv.shape[1]
    if not gemv.fused_enabled("gate"):
        return "gemv's gate variant is off (K3_GEMV_FUSED without \"gate\")"
    if b * t > gemv.GEMV_MAX_M:
        return f"{b * t} rows: the gate variant takes {gemv.GEMV_MAX_M}"
    return gemv.gate_refusal(o_lat.reshape(b * t, h * c), w_uv.new_empty(h * v, c),
                             g.reshape(b * t, h * v), v)


def mla_uv_gate_cuda(o_lat, w_uv, g):
    # o_lat [B, T, H, C], w_uv [H, V, C] (a view of kv_b's weight), g [B, T, H·V]
    (b, t, h, c), v = o_lat.shape, w_uv.shape[1]
    x, gate = o_lat.reshape(b * t, h * c), g.reshape(b * t, h * v)
    if gemv.fused_takes(x, "gate"):
        rows = uv_rows(w_uv)
        if gemv.fused_ok("gate", gemv.gate_refusal(x, rows, gate, v)):
            return gemv.gemv_gate_cuda(x, rows, gate, v).view(b, t, h * v)
    return mla_uv_gate_ref(o_lat, w_uv, g)


def _even_heads(w_uv) -> bool:
    return w_uv.stride(2) == 1 and w_uv.stride(0) == w_uv.shape[1] * w_uv.stride(1)


def uv_rows(w_uv):
    """W_UV [H, V, C] as [H·V, C] rows: a view where the heads are evenly spaced, else the heads
    concatenated at every call (the model's W_UV is a view of kv_b's weight with W_UK's rows
    between heads; a cached copy would miss writes through `.data`). One copy kernel per MLA
    layer (2.6 µs at TP16 on the H200, BENCHMARKS.md session 8) until gemv's gate variant
    takes the head stride."""
    h, v, c = w_uv.shape
    return w_uv.reshape(h * v, c) if _even_heads(w_uv) else concatenated(list(w_uv))


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    # per-head operands: flat_rows would merge the heads
    torch.library.register_kernel(f"k3::{OP}", "cuda", on_stream(mla_uv_gate_cuda))
