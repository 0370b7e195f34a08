"""Compile progress on stderr: which bucket, which stage, how many kernels built, how long.

A bucket's compile runs the pipeline's stages inside Inductor's compile (on a CPU the stages are
what takes the time: canonicalize, fuse, verify), then its first run builds the CuTe DSL kernels
it launches (on a GPU they compile lazily: `kernels.common.dsl.watch_builds` counts them). One
`BucketProgress` follows a bucket through both. On a TTY with tqdm installed a bar shows the stage
running, the kernels built so far and the time; then, on any stream, one line per bucket:

    k3: bucket 2 compiled in 31.8 s: canonicalize 2.6 s, fuse 21.3 s, verify 3.1 s (+9 stages
    0.4 s), torch 4.2 s; 66 rewrites, verify: 66 rewrites verified, 0 reverted; 0 kernels built;
    first run 0.2 s

("torch": Dynamo's graph lowered to ATen before the stages and Inductor's code generation after
them). With K3_BUILD_WORKERS the first run's kernels are built by a pool of processes first
(kernels/common/build_pool.py): the bar counts them as they arrive ("kernels 12/21"), the
k3_kernels log names each (with its worker), and the line also says "N built by W workers in S s
after a R s record run" (the kernels the main process built are those the pool could not).
`K3_QUIET=1` shows nothing; the TORCH_LOGS artifacts (`k3compile.logs`) are not affected.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from k3compile import logs, settings
from k3compile.observe import Observer, StageEvent

SHOWN_SECONDS = 0.1  # faster stages are summed into one "+N stages" entry


class BucketProgress:
    """The progress of one bucket's compile: `with p.compiling(): ...` around the pipeline, then
    `p.first_run(fn)` wraps the compiled step so that its first call is counted too and closes
    the display."""

    def __init__(self, observer: Observer, ctx: Any, stages: list[str], stream=None):
        self.observer, self.ctx, self.stages = observer, ctx, stages
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.stage_seconds: dict[str, float] = {}
        self.kernels: list[tuple[str, float]] = []
        self.first_run_seconds: float | None = None
        self.pooled = None  # what the build pool did (build_pool.Pooled), with K3_BUILD_WORKERS
        self.pool_total = self.pool_done = 0  # the pool's builds of this bucket, and those done
        self.bar = None if settings.quiet() else _bar(self.stream, len(stages) + 1,
                                                      f"k3 bucket {ctx.batch}")
        self._stop = threading.Event()
        if self.bar is not None:  # the elapsed time moves on during a long stage
            threading.Thread(target=self._tick, daemon=True).start()

    @contextlib.contextmanager
    def compiling(self) -> Iterator[BucketProgress]:
        with self._watching(), Observer.subscribe(self._on_stage):
            try:
                yield self
            except BaseException:
                self.close(failed=True)
                raise

    def first_run(self, fn: Callable, prebuild: Callable | None = None,
                  around: Callable[[], contextlib.AbstractContextManager] | None = None
                  ) -> Callable:
        """`fn`, its first call counted; `prebuild(fn, args, on_build, on_done)`
        (K3_BUILD_WORKERS: the kernels built by a pool, `build_pool.prebuild`) runs before that
        call; `around()` is open over both (the pipeline notes the kernels they ask for)."""
        done = False

        def run(*args):
            nonlocal done
            if done:
                return fn(*args)
            self._show("first run")
            t0 = time.perf_counter()
            with self._watching(), around() if around is not None else contextlib.nullcontext():
                try:
                    if prebuild is not None:
                        self._show("record run")
                        self.pooled = prebuild(fn, args, self._on_pool, self._on_pooled)
                        self._show("first run")
                    out = fn(*args)
                except BaseException:
                    self.close(failed=True)
                    raise
            self.first_run_seconds = time.perf_counter() - t0
            done = True
            self.close()
            return out

        return run

    # ---- events ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        from k3compile.kernels.common.dsl import watch_builds

        with watch_builds(self._on_kernel):
            yield

    def _on_stage(self, event: StageEvent) -> None:
        if event.observer is not self.observer or event.batch != self.ctx.batch:
            return
        if event.record is None:
            self._show(event.stage)
            return
        self.stage_seconds[event.stage] = event.record.seconds
        if self.bar is not None:
            self.bar.update(1)

    def _on_kernel(self, name: str, seconds: float) -> None:
        self.kernels.append((name, seconds))
        logs.kernel_built(name, seconds, self.ctx.batch)
        self._show(None)

    def _on_pool(self, kernels: int, workers: int) -> None:
        self.pool_total, self.pool_done = kernels, 0
        self._show(f"{kernels} kernels on {workers} workers")

    def _on_pooled(self, built) -> None:
        """One build of the pool finished (`build_pool.Built`; a failed one is logged there)."""
        self.pool_done += 1
        b = built.build
        by = f"k3::{b.op} {b.scalars!r}, {b.arch}, worker {built.worker}"
        for name, seconds in built.compiles:
            logs.kernel_built(name, seconds, self.ctx.batch, by=by)
        if not built.compiles and built.error is None:
            logs.kernel_built(b.op, built.seconds, self.ctx.batch, by=by, loaded=True)
        self._show(None)

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self.bar.refresh()

    def _show(self, stage: str | None) -> None:
        if self.bar is None:
            return
        if stage is not None:
            self.bar.set_description_str(f"k3 bucket {self.ctx.batch}: {stage}", refresh=False)
        built = f"{len(self.kernels)} kernels built"
        if self.pool_total:  # the pool's, then what the main process built after it
            built = f"kernels {self.pool_done}/{self.pool_total}" + (
                f" + {len(self.kernels)} built" if self.kernels else "")
        self.bar.set_postfix_str(built)

    # ---- the line ----------------------------------------------------------------------------

    def close(self, failed: bool = False) -> None:
        self._stop.set()
        if self.bar is not None:
            self.bar.close()
        if settings.quiet():
            return
        print(self.line(failed), file=self.stream, flush=True)

    def line(self, failed: bool = False) -> str:
        took = time.perf_counter() - self.t0
        head = (f"k3: bucket {self.ctx.batch} failed after {took:.1f} s" if failed
                else f"k3: bucket {self.ctx.batch} compiled in {took:.1f} s")
        parts = [self._stages_text(took)]
        report, options = self.ctx.report, self.ctx.options
        rewrites = sum(self.ctx.notes.get("canonicalize", {}).values()) + len(report.hits)
        parts.append(f"{rewrites} rewrites" + (f", verify: {logs.verify_count(self.ctx)}"
                                               if options.verify else ""))
        built = sum(s for _, s in self.kernels)
        parts.append(f"{len(self.kernels)} kernels built"
                     + (f" in {built:.1f} s" if self.kernels else ""))
        if (pooled := self.pooled) is not None and pooled.why is None:
            pool = (f"{pooled.kernels} built by {pooled.workers} workers in "
                    f"{pooled.build_seconds:.1f} s"
                    + (f" ({pooled.failed} failed)" if pooled.failed else "")
                    if pooled.kernels or pooled.failed else f"none for {pooled.workers} workers")
            parts.append(f"{pool} after a {pooled.record_seconds:.1f} s record run")
        if self.first_run_seconds is not None:
            parts.append(f"first run {self.first_run_seconds:.1f} s")
        return f"{head}: " + "; ".join(parts)

    def _stages_text(self, took: float) -> str:
        shown = [f"{name} {s:.1f} s" for name, s in self.stage_seconds.items()
                 if s >= SHOWN_SECONDS]
        rest = [s for s in self.stage_seconds.values() if s < SHOWN_SECONDS]
        text = ", ".join(shown)
        if rest:
            text += f" (+{len(rest)} stages {sum(rest):.1f} s)"
        other = took - sum(self.stage_seconds.values()) - (self.first_run_seconds or 0.0)
        return f"{text}, torch {max(other, 0.0):.1f} s".lstrip(", ")


def _bar(stream, total: int, desc: str):
    """A tqdm bar on a terminal; None elsewhere or without tqdm (the closing line still comes)."""
    if not getattr(stream, "isatty", lambda: False)():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="stage", file=stream, leave=False,
                bar_format="{desc} |{bar:20}| {n_fmt}/{total_fmt} stages [{elapsed}]{postfix}")


__all__ = ["BucketProgress"]
