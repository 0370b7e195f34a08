"""CUDA implementation of `k3::mla_q_absorb`: Gated MLA's q_b GEMM, then W_UK absorbed per head.

    q = cq·W_qbᵀ (router.linear);  q_lat[n, h, c] = bf16(Σ_d q[n, h, d] · W_UK[h, d, c]) (fp32),
    q_pe[n, h] = q[n, h, D:]

Two launches: the GEMM router's (gemv at one row, gemm_tc or cuBLAS above) and one CuTe kernel
that reads W_UK once for all N rows, writes q_lat and copies q_pe, both contiguous. Opt-in
(`K3_KERNELS_EXTRA=mla_q_absorb`) until its GPU tests pass. Design: docs/kernels.md, mla_q_absorb.

Constraints:
    * bf16 cq [..., Q], W_qb [H·(D + R), Q], W_UK [H, D, C] (a view of kv_b's weight: any
      head and row strides that are multiples of 8 elements, last dim contiguous, 16-byte-
      aligned data); N = prod(cq.shape[:-1]) <= MAX_ROWS.
    * D % 8 == 0, R % 8 == 0, C a multiple of COLS (the CTA's columns), the shared memory of
      the bucket's config <= SMEM_BYTES.
    * The GEMM takes whatever `router.linear` takes (cuBLAS where its engines refuse cq).
    * With PDL (settings.KERNELS.pdl): W_UK's tile loads before `griddepcontrol.wait`.
"""

from dataclasses import dataclass

import torch

from k3compile.ops import registry
from k3compile.ops.mla_q_absorb import mla_q_absorb_ref

from .common.dsl import BUCKETS, bucket, compile_kernel, fake_rows, fake_stream, on_stream
from .common.launch import Kernel
from .common.router import linear

OP = "mla_q_absorb"
MAX_ROWS = BUCKETS[-1]
# the rows the fusion takes a site at: on the H200 (session 18) the op was x1.71 / x1.15 / x0.73
# against cuBLAS's q_b GEMM + the einsum at 1 / 8 / 64 rows (the absorption alone 2x the einsum at
# 64: each thread group re-reads W_UK from shared memory); above, the site stays Inductor's.
# The kernel itself takes up to MAX_ROWS (its tests run it there)
TAKEN_ROWS = 8
COL_VECTORS = 4  # 16-byte column vectors per CTA
COLS = 8 * COL_VECTORS
SMEM_BYTES = 48 * 1024  # no opt-in above the default dynamic shared memory


@dataclass(frozen=True)
class Config:
    col_vectors: int  # CV: a CTA's columns are CV 16-byte vectors
    d_groups: int  # DG: slices of D summed by different threads, added in smem
    row_groups: int  # RG: thread groups over the rows (RG divides the bucket)

    def smem_bytes(self, nope: int, rows: int) -> int:
        """W_UK's tile (D, CT) and q_nope (rows, D) in bf16, the partials (DG, rows, CT) fp32."""
        ct = 8 * self.col_vectors
        return 2 * nope * ct + 2 * rows * nope + (4 * self.d_groups * rows * ct
                                                  if self.d_groups > 1 else 0)


def config(nope: int, batch_bucket: int) -> Config:
    """Few rows: D split 16 ways (8 d a thread, the most loads and FMAs side by side); more
    rows: fewer slices and more row groups, so a thread keeps <= 2 rows and the partials
    <= 16 KB at 64 rows. DG only where D / DG stays a multiple of 8."""
    dg = min(16, max(2, 128 // batch_bucket))
    while dg > 1 and nope % (8 * dg):
        dg //= 2
    return Config(COL_VECTORS, dg, min(batch_bucket, max(1, 64 // dg)))


def refusal(cq, q_b_weight, w_uk) -> str | None:
    """Why the kernel would not take these operands (tensors or metas), or None."""
    bf16 = torch.bfloat16
    if any(t.dtype != bf16 for t in (cq, q_b_weight, w_uk)):
        return f"dtypes cq {cq.dtype}, W_qb {q_b_weight.dtype}, W_UK {w_uk.dtype} (want bf16)"
    if w_uk.dim() != 3 or q_b_weight.dim() != 2:
        return f"W_UK {tuple(w_uk.shape)}, W_qb {tuple(q_b_weight.shape)} (want 3-d, 2-d)"
    heads, nope, latent = w_uk.shape
    rope = q_b_weight.shape[0] // heads - nope
    if nope % 8 or rope % 8 or rope < 0 or q_b_weight.shape[0] % heads or latent % COLS:
        return (f"sizes D {nope}, R {rope}, C {latent} of W_qb {tuple(q_b_weight.shape)} "
                f"(want D, R multiples of 8, C a multiple of {COLS})")
    if w_uk.stride(2) != 1 or w_uk.stride(0) % 8 or w_uk.stride(1) % 8:
        return f"W_UK strides {w_uk.stride()} (want (8·i, 8·j, 1))"
    rows = cq.numel() // max(cq.shape[-1], 1)
    if rows > MAX_ROWS:
        return f"{rows} rows (at most {MAX_ROWS})"
    b = bucket(max(rows, 1))
    if (need := config(nope, b).smem_bytes(nope, b)) > SMEM_BYTES:
        return f"shared memory {need} B at {b} rows (at most {SMEM_BYTES})"
    return None


def taken_refusal(cq, q_b_weight, w_uk) -> str | None:
    """The fusion's refusal: the kernel's, and more rows than TAKEN_ROWS."""
    if why := refusal(cq, q_b_weight, w_uk):
        return why
    rows = cq.numel() // max(cq.shape[-1], 1)
    return (f"{rows} rows (taken at most {TAKEN_ROWS}: slower than the unfused GEMM + einsum "
            "on the H200)" if rows > TAKEN_ROWS else None)


def prepare(heads: int, nope: int, rope: int, latent: int, buckets=BUCKETS) -> None:
    """Compile the kernel of every batch bucket for these sizes (call before graph capture)."""
    for b in buckets:
        KERNEL.compiled(heads, nope, rope, latent, b, config(nope, b), rows=b)


def build(heads, nope, rope, latent, rows, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    from .device.mla_q_absorb import MLAQAbsorb

    bf16, n = cutlass.BFloat16, cute.sym_int()
    w_uk = make_fake_tensor(bf16, (heads, nope, latent), stride=(
        cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1), assumed_align=16)
    return compile_kernel(
        MLAQAbsorb(heads, nope, rope, latent, rows, cfg, pdl),
        fake_rows(bf16, n, heads * (nope + rope)), w_uk,
        fake_rows(bf16, n, heads * latent, heads * latent),
        fake_rows(bf16, n, heads * rope, heads * rope), fake_stream(), arch=arch,
        dump_dir=dump_dir)


KERNEL = Kernel(OP, build)


def mla_q_absorb_cuda(cq, q_b_weight, w_uk):
    """(q_lat [..., H, C], q_pe [..., H, R]), contiguous: the GEMM router and the kernel, or
    the reference (reason logged) where the kernel refuses the operands."""
    def reference():
        return tuple(t.contiguous() for t in mla_q_absorb_ref(cq, q_b_weight, w_uk))

    def launch():
        lead, (heads, nope, latent) = cq.shape[:-1], w_uk.shape
        rope = q_b_weight.shape[0] // heads - nope
        x = cq.reshape(-1, cq.shape[-1])
        n = x.shape[0]
        q_lat, q_pe = cq.new_empty((*lead, heads, latent)), cq.new_empty((*lead, heads, rope))
        if n:
            b = bucket(n)
            KERNEL.compiled(heads, nope, rope, latent, b, config(nope, b), rows=b)(
                linear(x, q_b_weight), w_uk, q_lat.view(n, heads * latent),
                q_pe.view(n, heads * rope))
        return q_lat, q_pe

    def why():
        if not (cq.is_cuda and q_b_weight.is_cuda and w_uk.is_cuda):
            return "not on a CUDA device"
        return refusal(cq, q_b_weight, w_uk)

    return KERNEL.run(why, reference, launch, w_uk)


def register() -> None:
    registry.register_kernel(OP, refusal=taken_refusal)
    # per-head operands and two outputs: flat_rows would not give them their lead dims back
    torch.library.register_kernel(f"k3::{OP}", "cuda", on_stream(mla_q_absorb_cuda))
