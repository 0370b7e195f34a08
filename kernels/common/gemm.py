"""What the skinny-GEMM engines (gemv, gemm_tc) share: their common limits, the torch reference
(cuBLAS), and the host side of a GEMM launch (`run_gemm`; `run_split` for k3::moe_front's split
variant). The router that picks an engine by shape is `common.router.linear`.

Constraints shared by both engines:
    * x bf16 [M, K] and W bf16 [N, K] with 16-byte-aligned rows (last dim contiguous, row stride a
      multiple of 8 elements), K % 8 == 0 and K <= 65536, N >= 1.
    * Output bf16 or fp32 [M, N], last dim contiguous; optional residual bf16 [M, N].
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from .dsl import log, runtime_refusal, unaligned16
from .launch import Kernel

MAX_K = 65536
OUT_DTYPES = (torch.bfloat16, torch.float32)
# Rows up to which the router takes gemv instead of gemm_tc or cuBLAS, and the one-launch variants
# of the fused ops run (measured: docs/kernels.md, gemv; 2 since session 31: gemv beat gemm_tc at
# M = 2 by 7-18% on the four large shapes, and the B2 step by 3-5%, on an H100)
GEMV_MAX_M = 2


def gemm_refusal(x, w, residual, out_dtype, *, max_m: int, min_k: int) -> str | None:
    """The constraints this kernel and the tensor-core one (gemm_tc) share: bf16 x [M <= max_m,
    K] and w [N, K] with 16-byte rows, min_k <= K <= MAX_K a multiple of 8, an optional bf16
    residual [M, N], bf16 or fp32 output."""
    bf16 = torch.bfloat16
    if x.dim() != 2 or w.dim() != 2:
        return f"x {tuple(x.shape)}, w {tuple(w.shape)} (want x [M, K], w [N, K])"
    (m, k), n = x.shape, w.shape[0]
    if m > max_m:
        return f"batch above {max_m}: cuBLAS"
    if n < 1:
        return "w has no rows"
    if k % 8 or not min_k <= k <= MAX_K or w.shape[1] != k:
        return (f"K {k}, w {tuple(w.shape)} (want w [N, K], K a multiple of 8 in "
                f"[{min_k}, {MAX_K}])")
    for name, t in (("x", x), ("w", w)):
        if t.dtype != bf16:
            return f"{name}: dtype {t.dtype} (want {bf16})"
        if t.stride(-1) != 1 or t.stride(0) % 8:
            return f"{name}: strides {t.stride()} (last dim contiguous, rows 16-byte aligned)"
    if residual is not None and (residual.dtype != bf16 or residual.shape != (m, n)
                                 or residual.stride(-1) != 1):
        return (f"residual: {residual.dtype} {tuple(residual.shape)} {residual.stride()} "
                f"(want bf16 [{m}, {n}], last dim contiguous)")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        return f"output dtype {out_dtype} (want bf16 or fp32)"
    return None


def launch_refusal(refuse, x, w, residual, out, out_dtype) -> str | None:
    """Why a GEMM kernel with refusal `refuse` cannot run this call now (shapes, device,
    alignment, the `out` buffer), or None."""
    reason = (runtime_refusal() or refuse(x, w, residual, out_dtype=out_dtype)
              or (None if x.is_cuda and w.is_cuda else "not on a CUDA device")
              or unaligned16(x, w))
    if reason is None and out is not None and (
            out.dtype != out_dtype or out.shape != (x.shape[0], w.shape[0])
            or out.stride(-1) != 1):
        reason = f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
    return reason


def outs_refusal(outs) -> str | None:
    """Why one of a variant's output buffers is unfit, or None: `outs` holds (buffer or None,
    its shape, its dtype) of each output (last dim contiguous)."""
    for out, shape, dtype in outs:
        if out is not None and (out.dtype != dtype or tuple(out.shape) != shape
                                or out.stride(-1) != 1):
            return f"out: {out.dtype} {tuple(out.shape)} {out.stride()}"
    return None


def load_tuned(path: Path, op: str, make_config) -> dict:
    """A tuned table {(N, K, bucket): make_config(entry's config), or None where the entry has
    none}, from the JSON a benchmark's `--table` writes. One table per GPU model: `path`
    (the yardstick GPU's, also read without a GPU, where it decides the plan's routing) and
    siblings `<stem>_<name>.json` (e.g. gemm_tc_tuned_h100.json); on a GPU the one measured on
    it, else none (another GPU's choices need not hold there): heuristic configs."""
    tables = [path, *sorted(path.parent.glob(f"{path.stem}_*.json"))]
    tables = [json.loads(t.read_text()) for t in tables if t.exists()]
    if not tables:
        return {}
    data = tables[0]
    if torch.cuda.is_available():
        here = torch.cuda.get_device_name()
        data = next((t for t in tables if t["device"] == here), None)
        if data is None:
            log.info("%s: no table tuned on %s (tables: %s): heuristic configs", op, here,
                     ", ".join(t["device"] for t in tables))
            return {}
    return {(e["N"], e["K"], e["bucket"]): e["config"] and make_config(e["config"])
            for e in data["entries"]}


def gemm_ref(x, w, residual=None, out_dtype=None):
    """torch: one cuBLAS call when every dtype agrees (addmm adds the residual before its single
    rounding, like the kernel); a 16-bit GEMM writing fp32 on a GPU (exact products, fp32 sums:
    no upcast copy of w); otherwise fp32 math, cast once."""
    out_dtype = out_dtype or x.dtype
    if (out_dtype == torch.float32 and x.is_cuda and residual is None and x.dim() == 2
            and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)):
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    if x.dtype == w.dtype == out_dtype and (residual is None or residual.dtype == out_dtype):
        if residual is None:
            return F.linear(x, w)
        lead = x.shape[:-1]
        y = torch.addmm(residual.reshape(-1, w.shape[0]), x.reshape(-1, x.shape[-1]), w.t())
        return y.view(*lead, w.shape[0])
    y = F.linear(x.float(), w.float())
    if residual is not None:
        y = y + residual.float()
    return y.to(out_dtype)


def run_gemm(kernel: Kernel, refusal_of, launch, x, w, residual, out, out_dtype):
    """The host side of a skinny-GEMM engine (gemv, gemm_tc): y = x · wᵀ [+ residual] by
    `launch(y, out_dtype)` where `refusal_of` takes the inputs, else torch (`gemm_ref`, reason
    logged). `out` [M, N] (last dim contiguous) is written only when the kernel runs; the
    fallback returns a new tensor."""
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else x.dtype

    def kernel_call():
        y = x.new_empty((len(x), w.shape[0]), dtype=out_dtype) if out is None else out
        if len(x):
            launch(y, out_dtype)
        return y

    return kernel.run(lambda: launch_refusal(refusal_of, x, w, residual, out, out_dtype),
                      lambda: gemm_ref(x, w, residual, out_dtype), kernel_call)


def run_split(kernel: Kernel, refusal_of, launch, x, w, split: int, out, out2, op: str):
    """The host side of an engine's split variant (k3::moe_front over [W_r; W_d]): (x ·
    w[:split]ᵀ in fp32, x · w[split:]ᵀ in bf16) by `launch(y, y2)` where `refusal_of(outs)` takes
    the call (`outs` as `outs_refusal` reads them), else torch (`gemm_ref` per piece, reason
    logged under `op`). `out` and `out2` are written only when the kernel runs."""
    m, n = len(x), w.shape[0]

    def kernel_call():
        y = x.new_empty((m, split), dtype=torch.float32) if out is None else out
        y2 = x.new_empty((m, n - split)) if out2 is None else out2
        launch(y, y2)
        return y, y2

    return kernel.run(
        lambda: refusal_of([(out, (m, split), torch.float32),
                            (out2, (m, n - split), torch.bfloat16)]),
        lambda: (gemm_ref(x, w[:split], out_dtype=torch.float32),
                 gemm_ref(x, w[split:], out_dtype=torch.bfloat16)), kernel_call, op=op)
