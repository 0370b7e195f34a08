"""A bucket's CuTe DSL kernels built at once by worker processes (K3_BUILD_WORKERS), then loaded.

    pooled = prebuild(step, args, written=, workers=)   # step once in record mode, on clones of
                                                        # the inputs it writes; what it lacked
                                                        # built by the pool into the disk cache
    step(*args)                                         # the real first call loads every kernel

`cute.compile` is slow, single-threaded and not thread-safe: a bucket's first call built its
kernels one after the other (~25 kernels, ~7 s per bucket of the yardstick on the H200). The
record run (`launch.recording`) runs each kernel op's torch reference where its kernel is
missing and collects the missing `launch.Build`s; each worker (a spawned process: the DSL's state
does not survive a fork) imports the kernel's module, finds its `Kernel` by op and calls
`compiled(...)`, which stores the entry under K3_CACHE_DIR (`disk_cache.fetch`, under the
entry's lock: TP ranks' pools never build one entry twice). The pool starts once per process
(`start`, at the first compile, so the workers import the DSL meanwhile) and serves every bucket.
A pool's wait is bounded by its last build to finish, so builds are submitted slowest first
(`order`: the seconds an entry of the same op recorded, `disk_cache.build_seconds`, else the op's
`FAMILY_SECONDS`). Each finished build is reported to the main process as it arrives (`Built`,
`prebuild`'s `on_done`: the progress display counts them, the k3_kernels log names them).
Its workers do not import the parent's `__main__` script (`_no_main`): a user's script without a
main guard is not run again in each.

Constraints:
    * Needs the on-disk cache (K3_CACHE_DIR); without it `prebuild` does nothing (logged once).
    * The step must be safe to run twice: only the inputs at `written` are cloned (the caller
      knows which the step writes); `written=None` (unknown) runs nothing.
    * Never fails the compile: a failed record run, a failed or dead worker, or a worker's key
      that is not the main process's is logged, and the real call builds what is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import multiprocessing
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

import torch

from k3compile import settings

from . import disk_cache
from .dsl import log, watch_builds
from .launch import Build, Kernel, recording

_pool: ProcessPoolExecutor | None = None
_workers = 0
_told: set[str] = set()  # reasons for doing nothing, logged once each

# An op's expected build seconds where the disk cache holds none of its entries (a cold cache):
# measured one by one on a loaded 2-core CPU in session 16 (mla_decode, kda_decode, moe_experts,
# moe_route, attn_res_mix_norm, gemv, rms_norm, situ_gate_up); the others guessed from their
# kind (a TMA/WGMMA GEMM like the largest, a fused norm + projection like moe_route). Only their
# order matters.
FAMILY_SECONDS = {
    "mla_decode": 6.3, "gemm_tc": 6.0, "kda_decode": 5.1, "moe_experts": 4.2,
    "moe_front_route": 3.5, "moe_route": 3.4, "oproj_attn_res_mix_norm": 3.0, "mla_q_absorb": 3.0,
    "attn_res_mix_norm": 2.5, "gemv": 2.0, "mla_lowrank_norm": 1.5, "rms_norm": 0.9,
    "situ_gate_up": 0.9,
}
UNKNOWN_SECONDS = 2.0  # an op in neither


@dataclasses.dataclass
class Pooled:
    """What `prebuild` did for one bucket."""

    workers: int = 0
    kernels: int = 0  # built by the workers
    failed: int = 0  # left to the real call
    record_seconds: float = 0.0  # the record run
    build_seconds: float = 0.0  # waiting for the pool
    why: str | None = None  # why nothing was recorded or built


@dataclasses.dataclass(frozen=True)
class Built:
    """One build the pool finished, as the main process learns of it (`prebuild`'s `on_done`)."""

    build: Build
    worker: int  # the worker's process id
    seconds: float  # the worker's call: the build, or loading what another process stored
    compiles: tuple[tuple[str, float], ...] = ()  # its `cute.compile`s (name, s); none: loaded
    error: str | None = None  # why it is left to the real call


def start(workers: int) -> ProcessPoolExecutor | None:
    """The process's pool of `workers` spawned processes, started on the first call (each worker
    imports the DSL at once); None where `workers` is 0 or there is no disk cache."""
    global _pool, _workers
    if workers <= 0 or disk_cache.root() is None:
        return None
    if _pool is None or _workers != workers:
        shutdown()
        _pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        _workers = workers
        with _no_main():  # each submit spawns one worker, until there are `workers`
            for _ in range(workers):
                _pool.submit(_ready)
    return _pool


@contextlib.contextmanager
def _no_main():
    """A spawned process imports its parent's `__main__` script again, so a user's script
    without an `if __name__ == "__main__"` guard would run again in every worker: while open,
    multiprocessing finds no main script to import (a main module named `__main__`)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    had, spec = hasattr(main, "__spec__"), getattr(main, "__spec__", None)
    main.__spec__ = types.SimpleNamespace(name="__main__")
    try:
        yield
    finally:
        if had:
            main.__spec__ = spec
        else:
            del main.__spec__


def shutdown() -> None:
    """Stop the pool (the next `start` spawns a new one)."""
    global _pool, _workers
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
    _pool, _workers = None, 0


def prebuild(step: Callable, args, *, written: frozenset[int] | None, workers: int,
             on_build: Callable[[int, int], None] | None = None,
             on_done: Callable[[Built], None] | None = None) -> Pooled:
    """Run `step(*args)` once in record mode, with clones of the inputs at `written` (its state:
    the caller's stays as it was), then build the kernels it lacked in the pool (`on_build(n,
    workers)` first, `on_done(built)` as each finishes). The outputs of that run are dropped."""
    if workers <= 0:
        return Pooled(why="K3_BUILD_WORKERS=0")
    if disk_cache.root() is None:
        return _nothing("no on-disk cache (K3_CACHE_DIR=0): kernels build one by one")
    if written is None:
        return _nothing("the inputs the step writes are unknown: kernels build one by one")
    t0 = time.perf_counter()
    try:
        with recording() as rec:
            step(*(_copy(a) if i in written else a for i, a in enumerate(args)))
    except Exception as e:  # noqa: BLE001 - the real call then builds every kernel itself
        log.warning("k3: the record run failed (%s: %s); kernels build one by one",
                    type(e).__name__, e)
        return Pooled(workers, why=f"record run failed: {type(e).__name__}")
    pooled = Pooled(workers, record_seconds=time.perf_counter() - t0)
    builds = list(rec.builds.values())
    if builds:
        if on_build is not None:
            on_build(len(builds), workers)
        t0 = time.perf_counter()
        pooled.kernels, pooled.failed = build(builds, workers, on_done)
        pooled.build_seconds = time.perf_counter() - t0
    return pooled


def build(builds: list[Build], workers: int,
          on_done: Callable[[Built], None] | None = None) -> tuple[int, int]:
    """Build `builds` in the pool, slowest first (each stored in the disk cache; `on_done(built)`
    as each finishes); (built, failed)."""
    pool = start(workers)
    if pool is None:
        return 0, len(builds)
    snapshot = dataclasses.replace(settings.KERNELS)
    done = failed = 0
    try:
        futures = {pool.submit(_build, b, snapshot): b for b in order(builds)}
        for future in as_completed(futures):
            built = _checked(futures[future], future)
            if built.error is None:
                done += 1
            else:
                failed += 1
            if on_done is not None:
                on_done(built)
    except BrokenProcessPool as e:
        log.warning("k3: the build pool died (%s); kernels build one by one", e)
        shutdown()
        return done, len(builds) - done
    return done, failed


def _checked(b: Build, future) -> Built:
    """What the worker did with `b` (BrokenProcessPool raises): its entry must be this process's
    key, else the real call builds it."""
    try:
        entry, compiles, seconds, worker = future.result()
    except BrokenProcessPool:
        raise
    except Exception as e:  # noqa: BLE001 - the real call builds it
        log.warning("k3::%s: a build worker failed (%s: %s); building it here",
                    b.op, type(e).__name__, e)
        return Built(b, 0, 0.0, error=f"{type(e).__name__}: {e}")
    where = disk_cache.entry_of(b.op, b.key, b.arch, b.module)
    if where is None or where[0].name != entry:
        log.warning("k3::%s: a build worker stored another key (its environment differs); "
                    "building it here", b.op)
        return Built(b, worker, seconds, compiles, error="another key")
    return Built(b, worker, seconds, compiles)


def order(builds: list[Build]) -> list[Build]:
    """`builds` slowest first (by `expected_seconds`): a pool's wait is bounded by its last build
    to finish, so the longest start first; equal ones keep the record run's order."""
    expected = expected_seconds(builds)
    ranked = sorted(range(len(builds)), key=lambda i: (-expected[i], i))
    return [builds[i] for i in ranked]


def expected_seconds(builds: list[Build]) -> list[float]:
    """Each build's expected seconds: what the disk cache's entry of the same op and compile key
    took (under an older source or toolchain), else the median of that op's entries, else
    `FAMILY_SECONDS`."""
    history = {op: disk_cache.build_seconds(op) for op in dict.fromkeys(b.op for b in builds)}
    out = []
    for b in builds:
        seen = history[b.op]
        same = seen.get(repr(b.key))
        out.append(same if same is not None else statistics.median(seen.values()) if seen
                   else FAMILY_SECONDS.get(b.op, UNKNOWN_SECONDS))
    return out


def missing(builds: list[Build]) -> list[Build]:
    """The `builds` whose disk-cache entry is absent (a stat each; the entry is not read: a bad
    one is rebuilt by the call that loads it). A kernel the disk cache cannot hold (no cache, no
    DSL, a key without a stable text) is not counted: no process can store it, so no pool could
    help. A module that no longer imports counts as missing."""
    out = []
    for b in builds:
        try:
            importlib.import_module(b.module)  # its sources are in the entry's key
            where = disk_cache.entry_of(b.op, b.key, b.arch, b.module)
            if where is not None and not where[0].exists():
                out.append(b)
        except Exception as e:  # noqa: BLE001 - the record run then finds what is needed
            log.debug("k3::%s: kernel entry not checked (%s: %s)", b.op, type(e).__name__, e)
            out.append(b)
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with t's very strides (the compiled step indexes its inputs by the strides it was
    compiled for; `clone` would compact a strided view)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _nothing(why: str) -> Pooled:
    if why not in _told:
        _told.add(why)
        log.info("k3: K3_BUILD_WORKERS: %s", why)
    return Pooled(why=why)


# ---- in the workers ------------------------------------------------------------------------------

def _ready() -> None:
    from .dsl import have_dsl

    have_dsl()  # the DSL imported while the main process compiles


def _build(b: Build, kernels: settings.KernelSettings
           ) -> tuple[str | None, tuple[tuple[str, float], ...], float, int]:
    """Build (or load) one kernel through its `Kernel`, which stores it: (its entry's name, the
    `cute.compile`s it took (name, seconds), the call's seconds, this worker's process id)."""
    for field in dataclasses.fields(kernels):
        setattr(settings.KERNELS, field.name, getattr(kernels, field.name))
    module = importlib.import_module(b.module)
    kernel = next(k for k in vars(module).values() if isinstance(k, Kernel) and k.op == b.op)
    compiles: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    with watch_builds(lambda name, seconds: compiles.append((name, seconds))):
        kernel.compiled(*b.scalars, arch=b.arch, pdl=b.pdl, **dict(b.options))
    seconds = time.perf_counter() - t0
    where = disk_cache.entry_of(b.op, b.key, b.arch, b.module)
    entry = None if where is None else where[0].name
    return entry, tuple(compiles), seconds, os.getpid()


__all__ = ["FAMILY_SECONDS", "Built", "Pooled", "build", "expected_seconds", "missing", "order",
           "prebuild", "shutdown", "start"]
