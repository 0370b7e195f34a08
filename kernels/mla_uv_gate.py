"""CUDA implementation of `k3::mla_uv_gate`: MLA's per-head value up-projection times its gate.

    o[b, t, h·V + v] = bf16(bf16(Σ_c o_lat[b, t, h, c] · W_UV[h, v, c]) · bf16(sigmoid(g)))

gemv's gate variant at M <= gemv.GEMV_MAX_M where settings.KERNELS.gemv_fused names "gate" (the
default), else the reference.

Constraints:
    * o_lat [B, T, H, C], W_UV [H, V, C] (a view of kv_b's weight, read in place through its
      head stride; copied per call only where a stride or its start is not 16-byte aligned),
      g [B, T, H·V].
    * The kernel takes B·T <= gemv.GEMV_MAX_M rows and gemv's gate limits (`refusal`); the
      pattern leaves every other site to Inductor, where the reference would run op by op.
    * `gate_fp32` (the product with an unrounded fp32 sigmoid) has no build: the reference.
"""

import torch

from k3compile.ops import registry
from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

from .common import gemv
from .common.dsl import log, on_stream, unaligned16

OP = "mla_uv_gate"


def refusal(o_lat, w_uv, g, gate_fp32=False) -> str | None:
    """Why the gate variant would not take these operands (tensors or metas), or None. W_UV's
    strides are not asked about: the CUDA path copies heads the kernel cannot read in place."""
    (b, t, h, c), v = o_lat.shape, w_uv.shape[1]
    if gate_fp32:
        return "gate_fp32: the gate variant multiplies by sigmoid(g) rounded to bf16"
    if not gemv.fused_enabled("gate"):
        return "gemv's gate variant is off (K3_GEMV_FUSED without \"gate\")"
    if b * t > gemv.GEMV_MAX_M:
        return f"{b * t} rows: the gate variant takes {gemv.GEMV_MAX_M}"
    return gemv.gate_refusal(o_lat.reshape(b * t, h * c), _stand_in(w_uv),
                             g.reshape(b * t, h * v))


def mla_uv_gate_cuda(o_lat, w_uv, g, gate_fp32=False):
    # o_lat [B, T, H, C], w_uv [H, V, C] (a view of kv_b's weight), g [B, T, H·V]
    (b, t, h, c), v = o_lat.shape, w_uv.shape[1]
    x, gate = o_lat.reshape(b * t, h * c), g.reshape(b * t, h * v)
    if gate_fp32:
        return mla_uv_gate_ref(o_lat, w_uv, g, gate_fp32)
    if gemv.fused_takes(x, "gate"):
        heads = uv_heads(x, w_uv, gate)
        if gemv.fused_ok("gate", gemv.gate_refusal(x, heads, gate)):
            return gemv.gemv_gate_cuda(x, heads, gate).view(b, t, h * v)
    return mla_uv_gate_ref(o_lat, w_uv, g)


_COPIED: set[str] = set()  # reasons already logged


def uv_heads(x, w_uv, gate):
    """W_UV [H, V, C] as gemv's gate variant reads it: the view itself, in place through its
    head stride (the model's W_UV lies inside kv_b's weight, W_UK's rows between heads). Where
    only its strides or alignment keep the kernel from it, a contiguous copy made at this call
    (one copy kernel per layer; the reason logged once): a cached copy would miss writes through
    `.data`."""
    reason = gemv.gate_refusal(x, w_uv, gate) or unaligned16(w_uv)
    if reason is None or gemv.gate_refusal(x, _stand_in(w_uv), gate):
        return w_uv  # read in place, or refused whatever its layout (the caller says why)
    if reason not in _COPIED:
        _COPIED.add(reason)
        log.warning("k3::%s: W_UV copied on every call: %s", OP, reason)
    return w_uv.contiguous()


def _stand_in(w_uv):
    """A contiguous meta tensor of W_UV's shape and dtype (what `uv_heads` can always hand on)."""
    return torch.empty(w_uv.shape, dtype=w_uv.dtype, device="meta")


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    # per-head operands: flat_rows would merge the heads
    torch.library.register_kernel(f"k3::{OP}", "cuda", on_stream(mla_uv_gate_cuda))
