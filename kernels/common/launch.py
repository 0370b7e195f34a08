"""The host skeleton every kernel shares, written once: refuse -> log + reference, else compile
(cached by a scalar key) -> launch.

    KERNEL = Kernel("rms_norm", build)                  # build(*scalars, arch=, pdl=, **options)
    KERNEL.compiled(dim, cfg, rows=b)                   # cached by (scalars, arch, pdl, options)
    KERNEL.run(lambda: refusal(x, w), lambda: reference(x, w), launch, x, w)

`cute.compile` is slow and not thread-safe, so each kernel keeps one in-process cache keyed by
scalars (dtype, sizes, config, PDL); fill it before CUDA-graph capture (`prepare`). Below it the
on-disk cache (`disk_cache`, K3_CACHE_DIR) hands a new process what an earlier one compiled.
Pure Python: `cutlass` is imported by `build`, on the first compile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from . import disk_cache
from .dsl import CompileCache, fallback, pdl_enabled, runtime_refusal, unaligned16

T = TypeVar("T")


class Kernel:
    """One kernel's compile cache and call skeleton. `pdl`: whether `build` takes `pdl=` (the
    setting now, for the launch's rows, goes into the key); mla_decode's does not."""

    def __init__(self, op: str, build: Callable[..., object], *, pdl: bool = True):
        self.op, self.build, self.pdl = op, build, pdl
        self.cache = CompileCache(op)

    def compiled(self, *scalars, arch: str | None = None, rows: int = 1, pdl: bool | None = None,
                 **options):
        """The compiled kernel for these scalars (and build options) and, where the kernel takes
        PDL, the PDL setting for `rows` now (or `pdl` given)."""
        kw = dict(options)
        if self.pdl:
            kw["pdl"] = pdl_enabled(rows) if pdl is None else pdl
        key = (*scalars, arch, *sorted(kw.items()))
        return self.cache.get(key, lambda: disk_cache.fetch(
            self.op, key, lambda: self.build(*scalars, arch=arch, **kw), arch=arch,
            module=self.build.__module__))

    def refusal(self, refusal: Callable[[], str | None], *aligned) -> str | None:
        """Why this call cannot launch: no runtime, the kernel's `refusal()` (called only where
        the runtime can launch), or the data of one of `aligned` not 16-byte aligned."""
        return runtime_refusal() or refusal() or unaligned16(*aligned)

    def run(self, refusal: Callable[[], str | None], reference: Callable[[], T],
            launch: Callable[[], T], *aligned, op: str | None = None) -> T:
        """launch() where the kernel takes the call, else reference() (the reason logged once by
        `fallback`, under `op`: a variant's name, or the kernel's)."""
        if reason := self.refusal(refusal, *aligned):
            fallback(op or self.op, reason)
            return reference()
        return launch()
