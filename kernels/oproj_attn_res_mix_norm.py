"""CUDA implementation of `k3::oproj_attn_res_mix_norm`: the output projection, then the mix.

    a = o · W_oᵀ;  (h, x) = attn_res_mix_norm(prefix + a, blocks)      (the reference's roundings)

Two launches by default: the GEMM through `router.linear`, then the attn_res_mix_norm kernel.
With K3_KERNELS_EXTRA=oproj_mix (kernels/oproj_mix.py), one launch at up to MAX_ROWS rows
(`oproj_mix_cuda`): gemv's plain build over W_o writes a to a scratch buffer, and its last CTA
to finish (kernels/common/last_cta.py, as moe_front_route) runs the attn_res_mix_norm kernel's
device code for every row, playing that kernel's grid warp by warp
(kernels/device/oproj_attn_res_mix_norm.py): a, prefix_out and x are the two launches' bit for
bit (the same gemv config and sums, the same mix sums in the same order).

Constraints:
    * The GEMM goes through `router.linear` (any shape: cuBLAS where our GEMMs refuse).
    * The mix takes the attn_res_mix_norm kernel's limits (both score variants); refused inputs
      run its reference (reason logged).
    * One launch: gemv's (bf16 o [N, K], W_o [D, K]) and the mix kernel's limits together, and
      N <= MAX_ROWS: one CTA mixes the rows one after another (three passes over ~9 sources of
      D, expected ~3 µs a row against one launch boundary saved; docs/kernels.md,
      oproj_attn_res_mix_norm; `benchmarks/oproj_mix.py` decides); more rows, or a refused call,
      take the two launches (the reason logged).
    * `norm_weight_fp32` (the mix's norm weight multiplied in fp32): the two launches only, the
      mix kernel's build for that flag; the one launch refuses it (logged).
"""

import torch

from k3compile.ops import registry
from k3compile.ops.attn_res_mix_norm import mix_norm_after

from . import attn_res_mix_norm
from .attn_res_mix_norm import attn_res_mix_norm_cuda
from .common import gemv
from .common.dsl import (
    bucket,
    compile_kernel,
    fake_rows,
    fake_stream,
    fake_vector,
    flat_rows,
    log,
    on_stream,
)
from .common.last_cta import counter
from .common.launch import Kernel
from .common.router import linear

OP = "oproj_attn_res_mix_norm"
MAX_ROWS = 1  # the H200 (2026-12-04): the last CTA's mix costs ~15 µs a row, the two launches
# with PDL 6.2 µs in all at 1 row (opt-in only)


def oproj_attn_res_mix_norm_cuda(o, o_proj_weight, prefix, blocks, mix_norm_weight,
                                 mix_proj_weight, norm_weight, mix_eps, norm_eps,
                                 scores_fp32=False, norm_weight_fp32=False):
    # o, prefix, blocks: [N, ·] rows (flat_rows)
    a = linear(o, o_proj_weight)
    return mix_norm_after(a, prefix, list(blocks), mix_norm_weight, mix_proj_weight, norm_weight,
                          mix_eps, norm_eps, scores_fp32, mix_norm=attn_res_mix_norm_cuda,
                          norm_weight_fp32=norm_weight_fp32)


def refusal(o, o_proj_weight, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
            mix_eps=None, norm_eps=None, scores_fp32=False, norm_weight_fp32=False) -> str | None:
    """Why the one launch cannot take these arguments (metadata only; fake tensors work)."""
    n, dim = o.shape[0], o_proj_weight.shape[0]
    if norm_weight_fp32:
        return "norm_weight_fp32: the one launch has no build for it (two launches)"
    if n > MAX_ROWS:
        return f"{n} rows (one CTA mixes at most {MAX_ROWS}: two launches)"
    if why := gemv.refusal(o, o_proj_weight):
        return f"o_proj: {why}"
    a = torch.empty((n, dim), dtype=o.dtype, device="meta")
    first, delta = (a, None) if prefix is None else (prefix, a)
    if why := attn_res_mix_norm.refusal(first, delta, list(blocks), mix_norm_weight,
                                        mix_proj_weight, norm_weight):
        return f"mix: {why}"
    return None


def prepare(dim: int, k: int, n_blocks: int, has_prefix: bool, buckets=(1,)) -> None:
    """Compile the kernel of every batch bucket for these sizes (call before graph capture)."""
    for b in buckets:
        compiled(dim, k, b, n_blocks, has_prefix)


def configs(dim: int, k: int, batch_bucket: int, n_blocks: int, has_prefix: bool):
    """(gemv's config, the mix kernel's): the two launches' own, which fix the sums' order."""
    return (gemv.config(dim, k, batch_bucket),
            attn_res_mix_norm.config(dim, n_blocks, has_prefix, batch_bucket))


def compiled(dim: int, k: int, batch_bucket: int, n_blocks: int, has_prefix: bool):
    return KERNEL.compiled(dim, k, batch_bucket, n_blocks, has_prefix,
                           *configs(dim, k, batch_bucket, n_blocks, has_prefix), rows=batch_bucket)


def build(dim, k, m_bucket, n_blocks, has_prefix, cfg, mix_cfg, arch=None, dump_dir=None,
          pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from .device.oproj_attn_res_mix_norm import OProjMixNorm

    bf16, f32, m = cutlass.BFloat16, cutlass.Float32, cute.sym_int()
    weight = (lambda: fake_vector(bf16, dim)) if n_blocks else (lambda: None)
    return compile_kernel(
        OProjMixNorm(dim, k, m_bucket, cfg, n_blocks, has_prefix, mix_cfg, pdl),
        fake_rows(bf16, m, k), fake_rows(bf16, dim, k), fake_rows(bf16, m, dim, dim),
        fake_rows(bf16, m, dim) if has_prefix else None,
        tuple(fake_rows(bf16, m, dim) for _ in range(n_blocks)) or None, weight(), weight(),
        fake_vector(bf16, dim), fake_rows(bf16, m, dim, dim), fake_rows(bf16, m, dim, dim),
        make_fake_tensor(cutlass.Int32, (1,), stride=(1,), assumed_align=4), f32(1e-5),
        f32(1e-5), fake_stream(), arch=arch, dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def oproj_mix_cuda(o, o_proj_weight, prefix, blocks, mix_norm_weight, mix_proj_weight,
                   norm_weight, mix_eps, norm_eps, scores_fp32=False, norm_weight_fp32=False):
    """CUDA implementation of k3::oproj_attn_res_mix_norm in one launch (K3_KERNELS_EXTRA=
    oproj_mix), or (reason logged) the two launches of `oproj_attn_res_mix_norm_cuda`."""
    blocks = list(blocks)
    args = (o, o_proj_weight, prefix, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
            mix_eps, norm_eps, scores_fp32, norm_weight_fp32)
    n, dim = o.shape[0], o_proj_weight.shape[0]
    if n > MAX_ROWS:  # not a fallback: the two launches are this op's kernels too
        log.debug("k3::oproj_mix: %d rows (one CTA mixes at most %d): the two launches", n,
                  MAX_ROWS)
        return oproj_attn_res_mix_norm_cuda(*args)
    count = []  # this stream's counter, found once the call is taken

    def why():
        if reason := refusal(*args):
            return reason
        count.append(counter(o.device))
        return count[0] if isinstance(count[0], str) else None

    def launch():
        a, prefix_out, x = (o.new_empty((n, dim)) for _ in range(3))
        if n:
            has_mix = len(blocks) > 0
            compiled(dim, o.shape[1], bucket(n), len(blocks), prefix is not None)(
                o, o_proj_weight, a, prefix, tuple(blocks) or None,
                mix_norm_weight if has_mix else None,
                mix_proj_weight.view(-1) if has_mix else None, norm_weight, prefix_out, x,
                count[0], float(mix_eps), float(norm_eps))
        return prefix_out, x

    tensors = [o, o_proj_weight, *blocks, mix_norm_weight, mix_proj_weight, norm_weight]
    return KERNEL.run(why, lambda: oproj_attn_res_mix_norm_cuda(*args), launch,
                      *tensors, *([prefix] if prefix is not None else []), op="oproj_mix")


def register(one_launch: bool = False) -> None:
    """The two launches; `one_launch` (kernels/oproj_mix.py): `oproj_mix_cuda`."""
    registry.register_kernel(OP)  # refused inputs take the unfused launches
    fn = oproj_mix_cuda if one_launch else oproj_attn_res_mix_norm_cuda
    torch.library.register_kernel(f"k3::{OP}", "cuda", on_stream(flat_rows(fn)))
