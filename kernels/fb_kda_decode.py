"""CUDA implementation of `k3::fb_kda_decode`: the KDA gate's low-rank up-projection, then the
KDA recurrent step.

    graw = bf16(fa · W_fbᵀ);  o = kda_decode(q, k, v, g, graw, b, ...)

Two launches by default: `router.linear` on the flat rows (our skinny GEMM at one row, cuBLAS
above), then the kda_decode kernel. With K3_KDA_FB (`settings.KERNELS.kda_fb`), one launch: the
kda_decode kernel's f_b build (`fb_rank` R), each CTA computing the graw of its head in its
prologue (fp32 sums, one bf16 rounding, as the GEMM's output), at batch buckets of at least
K3_KDA_FB requests (`1`: every bucket); where that build refuses (reason logged and counted),
the two launches. Opt-in: on the H200 (session 20, A/B/A in one machine
start) it lost 6.6% at B1 and 5.4% at B1xT8 and tied at B8: the graw sums read W_fb from global
memory after the PDL wait, on the critical path, where the GEMM's weight loads ran before its own
wait. Since session 21 each CTA copies its head's W_fb rows to shared memory before the wait
(cp.async), so only fa's loads and the sums follow it; not measured on the H200 yet.

Constraints:
    * fa [B, T, R], W_fb [H·K, R]; the rest as kda_decode (refused inputs run its reference,
      reason logged).
    * One launch: kda_decode.fb_refusal (bf16 fa with its last dim contiguous, any row stride;
      contiguous bf16 W_fb with 16-byte-aligned data; R = 8·2^i <= kda_decode.MAX_FB_RANK; the
      CTA's shared memory with the head's W_fb rows <= kda_decode.SMEM_BYTES). W_fb is a weight
      (the pattern takes only a graph input): the one launch reads it before its PDL wait.
"""

import torch

from k3compile.ops import registry
from k3compile.ops.kda_decode import BUILTIN, KDAVariant
from k3compile.settings import KERNELS

from . import kda_decode
from .common.dsl import bucket, fallback
from .common.router import linear
from .kda_decode import KERNEL, call_refusal, compiled, fb_refusal, kda_decode_cuda

OP = "fb_kda_decode"


def refusal(q, k, v, g, fa, fb_weight, b, *rest, **options) -> str | None:
    """The kda_decode kernel's limits, with graw [B, T, H·K] as the GEMM writes it. Inputs the
    one-launch build refuses on top (`kda_decode.fb_refusal`) take the two launches, still our
    kernels."""
    graw = torch.empty((*fa.shape[:2], fb_weight.shape[0]), dtype=fa.dtype, device="meta")
    return kda_decode.refusal(q, k, v, g, graw, b, *rest, **options)


def one_launch_wanted(batch: int, step: KDAVariant) -> bool:
    """K3_KDA_FB asks for the one-launch build at this batch's bucket, and the build has this
    variant (the built-in step or fla's fp32 norm; the kernel's own limits are checked after)."""
    return bool(KERNELS.kda_fb) and bucket(batch) >= KERNELS.kda_fb and \
        step in (BUILTIN, KDAVariant(norm_fp32=True))


def fb_kda_decode_cuda(q, k, v, g, fa, fb_weight, b, conv_state, recurrent_state, slots,
                       q_conv_weight, k_conv_weight, v_conv_weight, A_log, dt_bias,
                       o_norm_weight, lower_bound, l2_eps, q_scale, norm_eps, k_conv_state=None,
                       v_conv_state=None, variant: str = "", *, out=None):
    args = (q, k, v, g, fa, fb_weight, b, conv_state, recurrent_state, slots, q_conv_weight,
            k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight)
    scalars = (lower_bound, l2_eps, q_scale, norm_eps)
    B, T, R = fa.shape

    def two_launches():
        graw = linear(fa.reshape(B * T, R), fb_weight).view(B, T, -1)
        return kda_decode_cuda(*args[:4], graw, *args[6:], *scalars, k_conv_state, v_conv_state,
                               variant, out=out)

    # the default (K3_KDA_FB off): kda_decode checks its own inputs once; any variant but fla's
    # fp32 norm (a time-major conv state, a V-major recurrent state, three conv states, o_fp32,
    # the Flax norm, a rounded conv): kda_decode's build for it after our GEMM (the one-launch
    # build has none of those)
    step = KDAVariant.parse(variant, k_conv_state is not None)
    if not one_launch_wanted(B, step):
        return two_launches()
    if refusal(*args, variant=variant):  # kda_decode's own: its fallback, logged there
        return two_launches()
    if reason := fb_refusal(fa, fb_weight, q):
        fallback(OP, f"{reason}; two launches")
        return two_launches()

    def launch():
        H, K = recurrent_state.shape[1:3]
        o = q.new_empty((B, T, H, K)) if out is None else out
        if B:
            compiled(T, H, conv_state.shape[2] + 1, bucket(B), step,
                     A_log.dtype == torch.bfloat16, dt_bias.dtype == torch.bfloat16, R,
                     conv_weight_fp32=q_conv_weight.dtype == torch.float32)(
                *args, o, *map(float, scalars))
        return o

    # no runtime, devices, out or W_fb's alignment: the two launches (each falls back on its own)
    return KERNEL.run(lambda: call_refusal(args, q, recurrent_state, out), two_launches, launch,
                      recurrent_state, fb_weight, op=OP)


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", fb_kda_decode_cuda)
