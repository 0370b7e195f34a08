"""CuTe DSL kernel of the compiled step's device-side input check (k3compile/validate.py): the
check and the redirect in one launch, in place of Inductor's 1-5 kernels (`K3_CHECK_KERNEL`).

    mask = OR_k bits_k(checked_k, rows);  out_k = checked_k if mask == 0 else safe_k

bits_k as `validate._device_mask` (bit 3·k + RANGE / SCRATCH / DUPLICATE); safe_k the scratch
slot for the slot input, lo for the others (`validate.redirect_ref`, the reference and the CPU
path). One CTA (docs/kernels.md, input_check).

Constraints:
    * 1 to MAX_INPUTS (8) checked inputs, int32 or int64, 1 to MAX_ELEMENTS (4096) elements each
      (any shape; read contiguous, flattened), at most MAX_SLOT_ELEMENTS (1024) in the slot
      inputs together; their limits, shapes and dtypes are compile-time (one build per limit
      structure and bucket); `rows` and `mask` are 0-d int64 CUDA tensors.
    * a slot input has a scratch slot; every bound and fill fits int64, every fill its dtype.
    * Outputs: fresh tensors of the inputs' shapes and dtypes (contiguous), as torch.where gives.
    * With PDL (settings.KERNELS.pdl, bucket of the lead input's rows): nothing loads or stores
      before `griddepcontrol.wait`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from .common.dsl import WARP, bucket, compile_kernel, fake_stream
from .common.launch import Kernel

OP = "input_check"
MAX_INPUTS = 8  # 3 bits each: 24 bits of the Int32 the CTA reduces
MAX_ELEMENTS = 4096  # per input
MAX_SLOT_ELEMENTS = 1024  # of all slot inputs: in shared memory (8 bytes each), O(n²) compares
MAX_THREADS = 256
_DTYPES = {torch.int32: "int32", torch.int64: "int64"}
_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}

log = logging.getLogger("k3compile.kernels")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One checked input as the kernel sees it (compile-time; a stable repr for the caches)."""

    dtype: str  # "int32" or "int64"
    numel: int  # its elements, read flattened
    rows: int | None  # dim 0 of a batched input: rows >= `rows` (the real batch) are padding
    lo: int
    hi: int
    scratch: int | None  # a slot input's scratch slot; None: not a slot input
    fill: int  # what replaces it where the mask is nonzero

    @property
    def slots(self) -> bool:
        return self.scratch is not None


@dataclasses.dataclass(frozen=True)
class Config:
    threads: int


def config(specs: Sequence[Spec]) -> Config:
    """One CTA: a thread per element of the largest input, in whole warps, at most MAX_THREADS
    (more elements loop)."""
    most = max(s.numel for s in specs)
    return Config(min(MAX_THREADS, max(WARP, -(-most // WARP) * WARP)))


def specs_of(limits: Sequence, checked: Sequence[torch.Tensor]) -> tuple[Spec, ...]:
    """validate's `Limit`s and example tensors (or metas) as the kernel's compile-time specs."""
    out = []
    for lim, t in zip(limits, checked):
        slots = lim.role == "slots"
        out.append(Spec(_DTYPES.get(t.dtype, str(t.dtype)), t.numel(),
                        t.shape[0] if lim.batched and t.dim() else None, lim.lo, lim.hi,
                        lim.scratch if slots else None, lim.scratch if slots else lim.lo))
    return tuple(out)


def refusal(limits: Sequence, checked: Sequence[torch.Tensor]) -> str | None:
    """Why the kernel cannot check these inputs (metadata only: fake tensors work), or None."""
    if not 1 <= len(checked) <= MAX_INPUTS or len(limits) != len(checked):
        return f"{len(checked)} checked inputs (want 1 to {MAX_INPUTS})"
    for lim, t in zip(limits, checked):
        if t.dtype not in _DTYPES:
            return f"{lim.name}: dtype {t.dtype} (want int32 or int64)"
        if not 1 <= t.numel() <= MAX_ELEMENTS:
            return f"{lim.name}: {t.numel()} elements (want 1 to {MAX_ELEMENTS})"
        if lim.role == "slots" and lim.scratch is None:
            return f"{lim.name}: a slot input without a scratch slot"
    specs = specs_of(limits, checked)
    if (slots := sum(s.numel for s in specs if s.slots)) > MAX_SLOT_ELEMENTS:
        return f"{slots} slot values (want at most {MAX_SLOT_ELEMENTS}: the duplicate check)"
    for lim, spec in zip(limits, specs):
        lo, hi = _RANGES["int64"]
        if not all(lo <= v <= hi for v in (spec.lo, spec.hi, spec.fill)):
            return f"{lim.name}: bounds [{spec.lo}, {spec.hi}] or fill {spec.fill} past int64"
        lo, hi = _RANGES[spec.dtype]
        if not lo <= spec.fill <= hi:
            return f"{lim.name}: fill {spec.fill} past {spec.dtype}"
    return None


def build(specs, cfg, arch=None, dump_dir=None, pdl=False):
    """Compile now, uncached (`dump_dir` keeps the cubin and PTX; `pdl`: with PDL)."""
    import cutlass
    from cutlass.cute.runtime import make_fake_tensor

    from .device.input_check import InputCheck

    def flat(dtype, n):  # contiguous, aligned to its element only (a view may start anywhere)
        return make_fake_tensor(dtype, (n,), stride=(1,))

    dtypes = {"int32": cutlass.Int32, "int64": cutlass.Int64}
    checked = tuple(flat(dtypes[s.dtype], s.numel) for s in specs)
    outs = tuple(flat(dtypes[s.dtype], s.numel) for s in specs)
    return compile_kernel(InputCheck(specs, cfg, pdl), flat(cutlass.Int64, 1),
                          flat(cutlass.Int64, 1), checked, outs, fake_stream(), arch=arch,
                          dump_dir=dump_dir)


KERNEL = Kernel(OP, build)

_logged: set[str] = set()
# redirect's answers in this process, "kernel" or "refused" (a benchmark's proof that a step with
# K3_CHECK_KERNEL really took the kernel)
redirects: Counter[str] = Counter()


def redirect(limits: Sequence, checked: Sequence[torch.Tensor]) -> Callable | None:
    """`(rows, mask, *checked) -> checked'` by the kernel for inputs shaped as `checked` (a
    bucket's examples), compiled now (outside any capture), or None where the kernel refuses
    them (the reason logged once; the caller takes Inductor's)."""
    if reason := KERNEL.refusal(lambda: refusal(limits, checked)):
        redirects["refused"] += 1
        if reason not in _logged:
            _logged.add(reason)
            log.warning("k3: the device-side input check stays with Inductor (its CuTe kernel "
                        "refused: %s)", reason)
        return None
    specs = specs_of(limits, checked)
    cfg = config(specs)
    lead = checked[0].shape[0] if checked[0].dim() else 1
    compiled = KERNEL.compiled(specs, cfg, rows=bucket(lead))
    redirects["kernel"] += 1

    def run(rows: torch.Tensor, mask: torch.Tensor, *args: torch.Tensor):
        args = tuple(t.contiguous() for t in args)
        outs = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in args)
        compiled(rows.view(1), mask.view(1), tuple(t.view(-1) for t in args),
                 tuple(o.view(-1) for o in outs))
        return outs

    return run
