"""CuTe DSL kernel for `k3::attn_res_mix_norm`: prefix add + AttnRes depth mix + RMSNorm (spec §2).

    p = bf16(prefix + delta); α = softmax_i(rstd(v_i)·Σ_d v_i·wn·wp), v = (*blocks, p);
    h = bf16(Σ_i α_i·v_i); x = bf16(wx · bf16(h · rstd(h)))      (scores in fp32)
    (`norm_weight_fp32`: x = bf16(h · rstd(h) · wx), one rounding: a build of its own)

Design and measurements: docs/kernels.md, attn_res_mix_norm.

Constraints:
    * bf16 tensors; prefix, delta, blocks [N, D] with contiguous rows, row stride a multiple of 8
      elements and 16-byte-aligned data; mix_norm_weight, norm_weight [D], mix_proj_weight [1, D].
    * D % 8 == 0, 8 <= D <= 16384, and every source row fits one CTA's registers (e.g. 9
      sources up to D = 8192, prefix + delta alone up to 16384); clusters of c CTAs only when
      D % (8·c) == 0.
    * 0 <= len(blocks) <= 8 (at most 9 sources); mix_eps, norm_eps are runtime scalars.
    * One build for both score variants: its scores are `scores_fp32`'s math (Moonshot's, to
      fp32 summation order); the default reference rounds v·rstd, its product with wn and the
      score to bf16, which the kernel skips (docs/kernels.md, attn_res_mix_norm).
    * With PDL (settings.KERNELS.pdl, launches of at most .pdl_max_rows rows): wn and wp load
      before `griddepcontrol.wait`, the sources after it.
    * `norm_weight_fp32` is a build option (in the key only when set: the plain builds and their
      keys are unchanged); built for sm_90a, not yet run on a GPU (session 26), so the patterns
      leave its sites to Inductor on GPU graphs (`patterns/attn_res_mix_norm.py`).
"""

from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.attn_res_mix_norm import attn_res_mix_norm_ref

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

OP = "attn_res_mix_norm"
MAX_BLOCKS = 8
MAX_DIM = 16384


@dataclass(frozen=True)
class Config:
    threads: int
    vec_per_thread: int  # 16-byte vectors of each source row per thread
    cluster_n: int = 1  # CTAs per row; each takes dim / cluster_n columns


def config(dim: int, n_blocks: int, has_delta: bool, batch_bucket: int) -> Config:
    """With a mix (issue-bound) a row is split over a cluster: 4 CTAs up to 16 rows, 2 above (at
    most 128 CTAs), each CTA keeping at least 512 columns; add + norm alone stays one CTA per
    row. At batch <= 8 a thread takes at most 2 vectors per source; above, up to 4 while the
    fragments stay in registers. (H200 sweep, 9 sources at D = 7168: 8 CTAs per row tie with 4
    up to 8 rows and lose above; 2 win at 32 and 64 rows.)"""
    want = 4 if batch_bucket <= 16 else 2
    cluster_n = next(c for c in (8, 4, 2, 1) if c <= want and (c == 1 or (
        n_blocks and dim % (8 * c) == 0 and dim // c >= 512)))
    max_v = min(4, max(1, 28 // _frags(n_blocks, has_delta)))
    if batch_bucket <= 8:
        max_v = min(max_v, 2)
    return Config(*pick_threads(dim // 8 // cluster_n, max_v), cluster_n)


def _frags(n_blocks: int, has_delta: bool) -> int:
    """Register fragments live at once: sources, delta, and wn, wp when there is a mix."""
    return n_blocks + 1 + int(has_delta) + (2 if n_blocks else 0)


def _fits(cfg: Config, frags: int) -> bool:
    """4 registers per 16-byte vector plus ~24 for the rest, within the per-thread share of the
    64K-register file (warps allocated in groups of 4)."""
    warps = -(-cfg.threads // 128) * 4
    limit = min(255, 65536 // (warps * 32) // 8 * 8)
    return 4 * frags * cfg.vec_per_thread + 24 <= limit


def can_implement(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight) -> bool:
    return refusal(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight) is None


def refusal(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps=None,
            norm_eps=None, scores_fp32=False, norm_weight_fp32=False) -> str | None:
    """Why the kernel cannot take these inputs (shapes, dtypes, strides), or None. Works on fake
    tensors; data alignment is checked at launch."""
    bf16 = torch.bfloat16
    del scores_fp32  # the kernel's scores are fp32 throughout either way
    del norm_weight_fp32  # a build flag: the same inputs
    dim = prefix.shape[-1]
    if dim % 8 or not 8 <= dim <= MAX_DIM:
        return f"hidden {dim} (want a multiple of 8 in [8, {MAX_DIM}])"
    if len(blocks) > MAX_BLOCKS:
        return f"{len(blocks) + 1} sources (at most {MAX_BLOCKS + 1})"
    frags = _frags(len(blocks), delta is not None)
    if not all(_fits(config(dim, len(blocks), delta is not None, b), frags) for b in (1, 64)):
        return f"hidden {dim} with {len(blocks) + 1} sources does not fit one CTA's registers"
    for name, t in [("prefix", prefix), ("delta", delta), *(("block", b) for b in blocks)]:
        if t is None:
            continue
        if (why := rows_ok(t, dim, bf16)) or t.shape[0] != prefix.shape[0]:
            return f"{name}: {why or 'row count differs from prefix'}"
    for name, w in [("norm_weight", norm_weight), ("mix_norm_weight", mix_norm_weight),
                    ("mix_proj_weight", mix_proj_weight)]:
        if w.dtype != bf16 or w.numel() != dim or not w.is_contiguous():
            return f"{name}: {w.dtype} {tuple(w.shape)} (want contiguous bf16 of {dim})"
    return None


def prepare(dim: int, n_blocks: int, has_delta: bool, buckets=BUCKETS,
            norm_weight_fp32: bool = False) -> None:
    """Compile the kernel of every batch bucket for these scalars (call before graph capture)."""
    for b in buckets:
        compiled(dim, n_blocks, has_delta, b, norm_weight_fp32)


def compiled(dim: int, n_blocks: int, has_delta: bool, batch_bucket: int,
             norm_weight_fp32: bool = False):
    """The cached kernel; `norm_weight_fp32` enters the key only when set (the plain build's key
    and build are those from before the variant)."""
    options = {"norm_weight_fp32": True} if norm_weight_fp32 else {}
    return KERNEL.compiled(dim, n_blocks, has_delta,
                           config(dim, n_blocks, has_delta, batch_bucket), rows=batch_bucket,
                           **options)


def build(dim, n_blocks, has_delta, cfg, arch=None, dump_dir=None, pdl=False,
          norm_weight_fp32=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL;
    `norm_weight_fp32`: the norm's weight multiplied in fp32 before the one rounding)."""
    import cutlass
    from cutlass import cute

    from .device.attn_res_mix_norm import AttnResMixNorm

    bf16 = cutlass.BFloat16
    n = cute.sym_int()
    weight = (lambda: fake_vector(bf16, dim)) if n_blocks else (lambda: None)
    return compile_kernel(
        AttnResMixNorm(dim, n_blocks, has_delta, cfg, pdl, norm_weight_fp32),
        fake_rows(bf16, n, dim), fake_rows(bf16, n, dim) if has_delta else None,
        tuple(fake_rows(bf16, n, dim) for _ in range(n_blocks)) or None, weight(), weight(),
        fake_vector(bf16, dim), fake_rows(bf16, n, dim, dim), fake_rows(bf16, n, dim, dim),
        cutlass.Float32(1e-5), cutlass.Float32(1e-5), fake_stream(), arch=arch,
        dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def attn_res_mix_norm_cuda(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
                           mix_eps, norm_eps, scores_fp32=False, norm_weight_fp32=False, *,
                           out=None):
    """CUDA implementation of k3::attn_res_mix_norm: the kernel, or the reference if refused.
    `out` = (prefix_out, x) preallocated [N, D] contiguous (tests poison them)."""
    blocks = list(blocks)
    tensors = [prefix, *blocks, mix_norm_weight, mix_proj_weight, norm_weight]
    if delta is not None:
        tensors.append(delta)

    def reference():
        p, x = attn_res_mix_norm_ref(prefix, delta, blocks, mix_norm_weight, mix_proj_weight,
                                     norm_weight, mix_eps, norm_eps, scores_fp32,
                                     norm_weight_fp32)
        return (p.clone() if delta is None else p), x

    def launch():
        n, dim = prefix.shape
        prefix_out, x = out if out is not None else (prefix.new_empty((n, dim)),
                                                     prefix.new_empty((n, dim)))
        if n:
            has_mix = len(blocks) > 0
            compiled(dim, len(blocks), delta is not None, bucket(n), norm_weight_fp32)(
                prefix, delta, tuple(blocks) or None, mix_norm_weight if has_mix else None,
                mix_proj_weight.view(-1) if has_mix else None, norm_weight, prefix_out, x,
                float(mix_eps), float(norm_eps))
        return prefix_out, x

    return KERNEL.run(lambda: refusal(prefix, delta, blocks, mix_norm_weight, mix_proj_weight,
                                      norm_weight), reference, launch, *tensors)


def register() -> None:
    registry.register_kernel(OP, refusal=flat_refusal(refusal))
    torch.library.register_kernel(f"k3::{OP}", "cuda", flat_rows(attn_res_mix_norm_cuda))
