"""CUDA implementation of `k3::moe_front_route`: the router logits, the latent down-projection
and the routing in one launch.

    logits = x · W_rᵀ (fp32),  z = x · W_dᵀ (bf16),  ids, w = moe_route(logits, bias)

gemv's split variant over [W_r; W_d] (kernels/common/gemv.py) writes the logits to a scratch
buffer; the last of its CTAs to finish ("last block": a global atomic counter, no CTA ever waits
for another) routes every row with moe_route's device code (`MoERoute.route_row`), so ids and
weights are those of the moe_route kernel on the same logits, bit for bit. Which CTA is last
changes nothing: the logits are complete and the routing reads only them.

The counter: one int32 per (device, stream), reset by the last CTA (kernels/common/last_cta.py,
shared with the other last-CTA kernels).

Constraints:
    * moe_front's split variant (bf16 x [N, D], W_r and W_d back to back in one buffer: stage
      `pack`'s group, else refused: a fresh [W_r; W_d] copy per call costs more than the launch
      it saves) and moe_route's kernel (E % 4 == 0, E <= 1024, k <= 32, eps 1e-20, no clamp,
      fp32 or bf16 bias).
    * N <= MAX_ROWS: one CTA routes the rows one after another (~1-2 µs each, against one
      launch saved); more rows take moe_front and moe_route's two launches, as does a refused
      call (the reason logged).
"""

import torch

from k3compile.ops import registry
from k3compile.ops.linear_concat import adjacent, concatenated
from k3compile.ops.moe_front_route import moe_front_route_refusal
from k3compile.ops.moe_route import EPS

from . import moe_route
from .common import gemv
from .common.dsl import bucket, compile_kernel, fake_rows, fake_stream, fake_vector, flat_rows
from .common.last_cta import counter
from .common.launch import Kernel
from .moe_front import moe_front_cuda

OP = "moe_front_route"
MAX_ROWS = 8


def refusal(x, router_w, down_w, bias, top_k: int, scaling=None, eps: float = EPS,
            clamp: bool = False) -> str | None:
    """Why the one launch cannot take these arguments (metadata only; fake tensors work)."""
    if why := moe_front_route_refusal(x, router_w, down_w, bias):
        return why
    n, experts = x.shape[0], router_w.shape[0]
    if n > MAX_ROWS:
        return f"{n} rows (one CTA routes at most {MAX_ROWS}: two launches)"
    if x.dtype != torch.bfloat16 or router_w.dtype != torch.bfloat16:
        return f"x {x.dtype}, router weight {router_w.dtype} (want bf16)"
    logits = torch.empty((n, experts), dtype=torch.float32, device="meta")
    if why := moe_route.refusal(logits, bias, top_k, scaling, eps, clamp):
        return f"route: {why}"
    both = torch.empty((experts + down_w.shape[0], x.shape[1]), dtype=x.dtype, device="meta")
    return gemv.fused_refusal(gemv.Fusion(split=experts), x, both, out_dtype=torch.float32)


def prepare(n: int, k: int, split: int, top_k: int, buckets=(1, 2, 4, 8),
            bias_bf16: bool = False) -> None:
    """Compile the kernel of every batch bucket for these sizes (call before graph capture)."""
    for b in buckets:
        compiled(n, k, b, split, top_k, bias_bf16)


def compiled(n: int, k: int, batch_bucket: int, split: int, top_k: int, bias_bf16: bool):
    cfg = gemv.config(n, k, batch_bucket, gemv.Fusion(split=split))
    return KERNEL.compiled(n, k, batch_bucket, split, top_k, cfg, bias_bf16, rows=batch_bucket)


def build(n, k, m_bucket, split, top_k, cfg, bias_bf16, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from .device.moe_front_route import MoEFrontRoute

    bf16, f32, m = cutlass.BFloat16, cutlass.Float32, cute.sym_int()
    y2 = make_fake_tensor(bf16, (m, n - split), stride=(cute.sym_int64(), 1), assumed_align=2)
    return compile_kernel(
        MoEFrontRoute(n, k, m_bucket, cfg, split, top_k, pdl), fake_rows(bf16, m, k),
        fake_rows(bf16, n, k), fake_rows(f32, m, split, split), y2,
        fake_vector(bf16 if bias_bf16 else f32, split),
        make_fake_tensor(cutlass.Int64, (m, top_k), stride=(top_k, 1), assumed_align=8),
        make_fake_tensor(f32, (m, top_k), stride=(top_k, 1), assumed_align=4),
        make_fake_tensor(cutlass.Int32, (1,), stride=(1,), assumed_align=4), f32(1.0),
        fake_stream(), arch=arch, dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def moe_front_route_cuda(x, router_w, down_w, bias, top_k, scaling, eps=EPS, clamp=False):
    """CUDA implementation of k3::moe_front_route: the one launch, or (reason logged) moe_front's
    and moe_route's CUDA implementations in turn."""
    n, experts = x.shape[0], router_w.shape[0]
    count = []  # this stream's counter, found once the call is taken

    def why():
        if reason := refusal(x, router_w, down_w, bias, top_k, scaling, eps, clamp):
            return reason
        if not (x.is_cuda and bias.is_cuda and adjacent([router_w, down_w])):
            return "W_r and W_d are not back to back in one CUDA buffer (stage pack)"
        count.append(counter(x.device))
        return count[0] if isinstance(count[0], str) else None

    def two_launches():
        logits, z = moe_front_cuda(x, router_w, down_w)
        ids, weights = moe_route.moe_route_cuda(logits, bias, top_k, scaling, eps, clamp)
        return ids, weights, z

    def launch():
        logits = x.new_empty((n, experts), dtype=torch.float32)
        z = x.new_empty((n, down_w.shape[0]))
        ids = x.new_empty((n, top_k), dtype=torch.int64)
        weights = x.new_empty((n, top_k), dtype=torch.float32)
        if n:
            w = concatenated([router_w, down_w])
            compiled(w.shape[0], x.shape[1], bucket(n), experts, top_k,
                     bias.dtype == torch.bfloat16)(x, w, logits, z, bias, ids, weights, count[0],
                                                   float(scaling))
        return ids, weights, z

    return KERNEL.run(why, two_launches, launch, x, router_w, bias)


def register() -> None:
    registry.register_kernel(OP, refusal=refusal)
    torch.library.register_kernel(f"k3::{OP}", "cuda", flat_rows(moe_front_route_cuda))
