"""A bucket's kernels built by a pool of processes (kernels/common/build_pool.py, K3_BUILD_WORKERS).

CPU (needs the DSL; kernels compiled for sm_90a): record mode (`launch.recording`) records a
missing kernel instead of building it and the call returns its reference's values, also for a
launch of two kernels (both recorded, neither built nor launched) and for a `compiled(...)`
outside `Kernel.run` (`Deferred`); a valid disk entry is loaded, not recorded. `prebuild` runs a
step once in record mode on clones of the inputs it writes (the caller's stay as they were),
two worker processes build what it lacked into a fresh K3_CACHE_DIR, and the main process then
loads both kernels and builds none. Without a disk cache it does nothing.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("cutlass")

from k3compile.kernels import rms_norm
from k3compile.kernels.common import build_pool, disk_cache, dsl, launch
from k3compile.kernels.common.dsl import CompileCache, bucket
from k3compile.kernels.common.launch import Deferred, Kernel, recording

from k3compile import settings

pytestmark = pytest.mark.dsl

DIMS = (256, 512)
EPS = 1e-5


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache folder, fresh counters, an empty rms_norm cache, and calls that take the
    kernel path on this CPU (no kernel launches here: record mode runs the references)."""
    monkeypatch.setattr(settings.KERNELS, "cache_dir", str(tmp_path / "k3cache"))
    monkeypatch.setattr(disk_cache, "STATS", Counter())
    monkeypatch.setattr(launch, "runtime_refusal", lambda: None)
    monkeypatch.setattr(rms_norm.KERNEL, "cache", CompileCache("rms_norm"))
    return tmp_path / "k3cache"


def rows(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_record_mode_records_the_key_and_returns_the_reference(cache_dir):
    x, w = rows(3, DIMS[0]), rows(1, DIMS[0], 1)[0]
    with recording() as rec:
        y = rms_norm.rms_norm_cuda(x, w, EPS)
    torch.testing.assert_close(y, rms_norm.rms_norm_ref(x, w, EPS), rtol=0, atol=0)
    (build,) = rec.builds.values()
    b = bucket(3)
    assert (build.op, build.module, build.scalars) == (
        "rms_norm", rms_norm.__name__, (DIMS[0], rms_norm.config(DIMS[0], b)))
    assert build.key == (DIMS[0], rms_norm.config(DIMS[0], b), None,
                         ("pdl", dsl.pdl_enabled(b)))
    assert len(rms_norm.KERNEL.cache) == 0 and disk_cache.stats() == {}, "nothing built"
    with recording(), pytest.raises(Deferred):  # outside Kernel.run
        rms_norm.prepare(DIMS[0], buckets=(b,))


def test_a_launch_of_two_kernels_records_both_and_launches_neither(cache_dir):
    built, launched = [], []
    first = Kernel("first", lambda *a, **k: built.append(a))
    second = Kernel("second", lambda *a, **k: built.append(a))
    first.cache.get((1, None, ("pdl", dsl.pdl_enabled(1))), lambda: launched.append)  # one is compiled already
    x = torch.arange(4.0)

    def launch_both():
        first.compiled(1)(x)
        second.compiled(2)(x)
        return x + 100

    with recording() as rec:
        y = first.run(lambda: None, lambda: x * 2, launch_both)
    assert torch.equal(y, x * 2), "the reference's values"
    assert [b.op for b in rec.builds.values()] == ["second"]
    assert built == [] and launched == [], "nothing built, nothing launched"
    with recording() as rec:  # with both compiled the launch runs
        second.cache.get((2, None, ("pdl", dsl.pdl_enabled(1))), lambda: launched.append)
        assert torch.equal(first.run(lambda: None, lambda: x * 2, launch_both), x + 100)
    assert rec.builds == {} and len(launched) == 2


def test_prebuild_builds_in_workers_then_the_main_process_loads(cache_dir):
    state = torch.zeros(4)
    xs = [rows(1, d, d) for d in DIMS]
    ws = [rows(1, d, d + 1)[0] for d in DIMS]

    def step(state, *args):
        state.add_(1)  # the step's state write: on a clone in the record run
        return [rms_norm.rms_norm_cuda(x, w, EPS) for x, w in zip(xs, ws)]

    shown = []
    try:
        pooled = build_pool.prebuild(step, (state, *xs), written=frozenset({0}), workers=2,
                                     on_build=lambda n, w: shown.append((n, w)))
    finally:
        build_pool.shutdown()
    assert torch.equal(state, torch.zeros(4)), "the caller's state stays as it was"
    assert (pooled.kernels, pooled.failed, pooled.workers, shown) == (2, 0, 2, [(2, 2)])
    assert disk_cache.stats() == {}, "the main process built nothing"
    assert len(list(cache_dir.rglob("*.k3kernel"))) == 2
    for d in DIMS:  # the real first call's kernels: loaded
        rms_norm.KERNEL.compiled(d, rms_norm.config(d, 1), rows=1)
    assert disk_cache.stats() == {"loaded": 2}


def test_without_a_disk_cache_prebuild_runs_nothing(cache_dir, monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "cache_dir", None)
    calls = []
    pooled = build_pool.prebuild(lambda *a: calls.append(a), (torch.zeros(1),),
                                 written=frozenset(), workers=2)
    assert calls == [] and pooled.kernels == 0 and "K3_CACHE_DIR" in pooled.why
    assert build_pool.start(2) is None
