"""The host skeleton every kernel shares, written once: refuse -> log + reference, else compile
(cached by a scalar key) -> launch.

    KERNEL = Kernel("rms_norm", build)                  # build(*scalars, arch=, pdl=, **options)
    KERNEL.compiled(dim, cfg, rows=b)                   # cached by (scalars, arch, pdl, options)
    KERNEL.run(lambda: refusal(x, w), lambda: reference(x, w), launch, x, w)

`cute.compile` is slow and not thread-safe, so each kernel keeps one in-process cache keyed by
scalars (dtype, sizes, config, PDL); fill it before CUDA-graph capture (`prepare`). Below it the
on-disk cache (`disk_cache`, K3_CACHE_DIR) hands a new process what an earlier one compiled.
Pure Python: `cutlass` is imported by `build`, on the first compile.

Record mode (`recording()`, for `build_pool`): a kernel neither in the in-process cache nor
valid on disk is not built; its `Build` is recorded instead. `run` first walks `launch()` with
every compiled kernel a no-op (so each kernel of a launch of several is recorded and none runs
on another's unwritten output); where one was missing the call returns `reference()`. A
`compiled(...)` outside `run` raises `Deferred` for a missing kernel.

`using()` collects the `Build` of every kernel `compiled(...)` is asked for while it is open
(compiled, loaded or missing): the kernels a bucket's first run needs, which the pipeline keeps
beside the bucket's stage-cache link so a later process can check they are all on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator
from typing import TypeVar

from . import disk_cache
from .dsl import CompileCache, fallback, log, pdl_enabled, runtime_refusal, unaligned16

T = TypeVar("T")


class Deferred(Exception):
    """A kernel record mode did not build (`recording`): the call runs its reference."""


@dataclasses.dataclass(frozen=True)
class Build:
    """One kernel to build: what `Kernel.compiled` was called with (a worker process finds the
    Kernel by `op` in `module` and calls it so, which stores the entry on disk)."""

    op: str
    module: str
    scalars: tuple
    arch: str | None
    pdl: bool | None
    options: tuple[tuple[str, object], ...]

    @property
    def key(self) -> tuple:
        return compile_key(self.scalars, self.arch, {**dict(self.options), **(
            {} if self.pdl is None else {"pdl": self.pdl})})


def compile_key(scalars: tuple, arch: str | None, options: dict) -> tuple:
    """A kernel's in-process (and, with its op and module, on-disk) cache key."""
    return (*scalars, arch, *sorted(options.items()))


class Recording:
    """The kernels one record-mode run met missing, by (op, compile key), in order met."""

    def __init__(self):
        self.builds: dict[tuple[str, Hashable], Build] = {}
        self.probing = False  # inside `Kernel.run`'s walk of a launch: nothing launches
        self.misses = 0

    def probe(self, launch: Callable[[], object]) -> bool:
        """Walk `launch()` with every compiled kernel a no-op; whether one was missing."""
        misses, self.probing = self.misses, True
        try:
            launch()
        except Exception as e:  # noqa: BLE001 - a walk that fails runs the reference
            log.debug("k3: record mode: launch walk stopped (%s: %s)", type(e).__name__, e)
            self.misses += 1
        finally:
            self.probing = False
        return self.misses > misses


_recording: Recording | None = None


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Record mode while open (this process, one at a time): missing kernels are recorded, not
    built, and the calls that need them run their references."""
    global _recording
    if _recording is not None:
        raise RuntimeError("record mode is already on")
    _recording = Recording()
    try:
        yield _recording
    finally:
        _recording = None


_using: dict[tuple[str, Hashable], Build] | None = None


@contextlib.contextmanager
def using() -> Iterator[list[Build]]:
    """The kernels asked for while open (`Kernel.compiled`), in order, once each; the list is
    filled when the block ends. Nested: the inner block collects, the outer one sees nothing."""
    global _using
    outer, _using, out = _using, {}, []
    try:
        yield out
    finally:
        out += _using.values()
        _using = outer


def _skipped(*_args) -> None:
    """A compiled kernel while a launch is walked in record mode: launches nothing."""


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
        key = compile_key(scalars, arch, kw)
        module = self.build.__module__
        if _using is not None and (self.op, key) not in _using:
            _using[self.op, key] = self._build_of(scalars, arch, kw)
        if (rec := _recording) is not None and key not in self.cache:
            if (found := disk_cache.lookup(self.op, key, arch=arch, module=module)) is not None:
                self.cache.get(key, lambda: found)
            elif disk_cache.entry_of(self.op, key, arch, module) is not None:  # a pool can store it
                rec.builds.setdefault((self.op, key), self._build_of(scalars, arch, kw))
                rec.misses += 1
                if rec.probing:
                    return _skipped
                raise Deferred(self.op)
        if rec is not None and rec.probing:
            return _skipped
        return self.cache.get(key, lambda: disk_cache.fetch(
            self.op, key, lambda: self.build(*scalars, arch=arch, **kw), arch=arch,
            module=module))

    def _build_of(self, scalars: tuple, arch: str | None, kw: dict) -> Build:
        return Build(self.op, self.build.__module__, scalars, arch, kw.get("pdl"),
                     tuple(sorted((k, v) for k, v in kw.items() if k != "pdl")))

    def refusal(self, refusal: Callable[[], str | None], *aligned) -> str | None:
        """Why this call cannot launch: no runtime, the kernel's `refusal()` (called only where
        the runtime can launch), or the data of one of `aligned` not 16-byte aligned."""
        return runtime_refusal() or refusal() or unaligned16(*aligned)

    def run(self, refusal: Callable[[], str | None], reference: Callable[[], T],
            launch: Callable[[], T], *aligned, op: str | None = None) -> T:
        """launch() where the kernel takes the call, else reference() (the reason logged once by
        `fallback`, under `op`: a variant's name, or the kernel's)."""
        if reason := self.refusal(refusal, *aligned):
            if _recording is None:  # a record run's call is made again for real: counted there
                fallback(op or self.op, reason)
            return reference()
        if (rec := _recording) is not None:
            if rec.probing:  # a kernel op inside another's launch: walked with it
                return launch()
            if rec.probe(launch):
                return reference()
            try:
                return launch()
            except Deferred:
                return reference()
        return launch()
