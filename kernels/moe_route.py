"""CuTe DSL kernel for `k3::moe_route`: sigmoid scores, bias-corrected top-k, renormalised weights
(spec §3.3 steps 1-2, `noaux_tc`).

    s = sigmoid(logits); ids = topk(s + bias, k); w = s[ids] / (Σ s[ids] + 1e-20) · scaling

Ids come out in descending key order, equal keys by ascending expert (torch.topk leaves ties
unspecified). The selection without serial rounds, its fallback (`serial_topk`) and the
measurements: docs/kernels.md, moe_route.

Constraints:
    * logits fp32 [N, E] with contiguous rows, row stride a multiple of 4 elements and 16-byte
      aligned data; bias fp32 or bf16 [E] contiguous, 16-byte-aligned data (a bf16 bias is
      loaded as fp32, as the reference promotes it: a build of its own); outputs ids int64
      [N, k], weights fp32 [N, k].
    * E % 4 == 0, 4 <= E <= 1024; 1 <= k <= min(32, E); scaling is a runtime scalar.
    * the op's renormalisation as K3's: eps 1e-20 added (another eps or a clamp: the reference).
    * NaN logits are not ordered (their selection is unspecified).
    * With PDL (settings.KERNELS.pdl): the bias loads before `griddepcontrol.wait`.
"""

from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.moe_route import EPS, moe_route_ref

from .common.dsl import (
    BUCKETS,
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
    fake_vector,
    flat_refusal,
    flat_rows,
    pick_threads,
    rows_ok,
)
from .common.launch import Kernel

OP = "moe_route"
MAX_EXPERTS = 1024
MAX_TOP_K = 32
CAP = 64  # candidates the ranked selection takes (two per lane); more go the serial way


@dataclass(frozen=True)
class Config:
    threads: int  # of the CTA computing one row's keys; warp 0 then selects
    vec_per_thread: int  # float4s of the row per thread


def config(n_experts: int, top_k: int, batch_bucket: int) -> Config:
    """One row per CTA at every bucket (64 rows take 64 of the H200's 132 SMs): at most two float4
    per thread, an exact split when there is one (896 experts: 224 threads, one float4 each)."""
    return Config(*pick_threads(n_experts // 4, 2))


def can_implement(logits, bias, top_k: int) -> bool:
    return refusal(logits, bias, top_k) is None


def refusal(logits, bias, top_k: int, scaling=None, eps: float = EPS, clamp: bool = False
            ) -> str | None:
    if eps != EPS or clamp:
        return f"renormalises by {'max(sum, eps)' if clamp else 'sum + eps'}, eps {eps} " \
               f"(the kernel adds {EPS})"
    n_experts = logits.shape[-1]
    if n_experts % 4 or not 4 <= n_experts <= MAX_EXPERTS:
        return f"{n_experts} experts (want a multiple of 4 in [4, {MAX_EXPERTS}])"
    if not 1 <= top_k <= min(MAX_TOP_K, n_experts):
        return f"top_k {top_k} (want 1..{min(MAX_TOP_K, n_experts)})"
    if why := rows_ok(logits, n_experts, torch.float32):
        return f"logits: {why}"
    if bias.dtype not in (torch.float32, torch.bfloat16) or bias.shape != (n_experts,) \
            or not bias.is_contiguous():
        return f"bias: {bias.dtype} {tuple(bias.shape)} " \
               f"(want contiguous fp32 or bf16 [{n_experts}])"
    return None


def prepare(n_experts: int, top_k: int, buckets=BUCKETS, bias_bf16=False) -> None:
    """Compile the kernel of every batch bucket for these sizes (call before graph capture)."""
    for b in buckets:
        compiled(n_experts, top_k, b, bias_bf16)


def compiled(n_experts: int, top_k: int, batch_bucket: int, bias_bf16: bool = False):
    """The cached kernel; `bias_bf16` enters the key only when set (the fp32 bias's key and build
    are those from before the variant)."""
    return KERNEL.compiled(n_experts, top_k, config(n_experts, top_k, batch_bucket),
                           rows=batch_bucket, **({"bias_bf16": True} if bias_bf16 else {}))


def build(n_experts, top_k, cfg, arch=None, dump_dir=None, pdl=False, bias_bf16=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL; `bias_bf16`:
    the router bias in bf16, e.g. a Moonshot model cast to bf16 whole)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from .device.moe_route import MoERoute

    n = cute.sym_int()
    f32 = cutlass.Float32
    return compile_kernel(
        MoERoute(n_experts, top_k, cfg, pdl), fake_rows(f32, n, n_experts),
        fake_vector(cutlass.BFloat16 if bias_bf16 else f32, n_experts),
        make_fake_tensor(cutlass.Int64, (n, top_k), stride=(top_k, 1), assumed_align=8),
        make_fake_tensor(f32, (n, top_k), stride=(top_k, 1), assumed_align=4),
        f32(1.0), fake_stream(), arch=arch, dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def moe_route_cuda(logits, bias, top_k, scaling, eps=EPS, clamp=False, *, out=None):
    """CUDA implementation of k3::moe_route: the kernel, or the reference if refused."""
    def launch():
        n, n_experts = logits.shape
        ids, weights = out if out is not None else (
            logits.new_empty((n, top_k), dtype=torch.int64), logits.new_empty((n, top_k)))
        if n:
            compiled(n_experts, top_k, bucket(n), bias.dtype == torch.bfloat16)(
                logits, bias, ids, weights, float(scaling))
        return ids, weights

    return KERNEL.run(lambda: refusal(logits, bias, top_k, scaling, eps, clamp),
                      lambda: moe_route_ref(logits, bias, top_k, scaling, eps, clamp), launch,
                      logits, bias)


def register() -> None:
    registry.register_kernel(OP, refusal=flat_refusal(refusal))
    torch.library.register_kernel(f"k3::{OP}", "cuda", flat_rows(moe_route_cuda))
