"""A bucket's kernels built by a pool of processes (kernels/common/build_pool.py, K3_BUILD_WORKERS).

CPU (needs the DSL; kernels compiled for sm_90a): record mode (`launch.recording`) records a
missing kernel instead of building it and the call returns its reference's values, also for a
launch of two kernels (both recorded, neither built nor launched) and for a `compiled(...)`
outside `Kernel.run` (`Deferred`); a valid disk entry is loaded, not recorded. `launch.using`
lists the kernels asked for and `missing` those without a disk entry. `prebuild` runs a
step once in record mode on clones of the inputs it writes (the caller's stay as they were),
two worker processes build what it lacked into a fresh K3_CACHE_DIR, and the main process then
loads both kernels and builds none (`slow`); the workers do not run the parent's script again
(`slow`). Without a disk cache it does nothing. Builds go to the pool slowest first (the seconds
the disk cache's entries of the op recorded, else the op's family weight); each finished build
reaches the main process's k3_kernels log and progress bar ("kernels 1/2"), here through a
stand-in pool that spawns nothing. GPU: a tiny bf16 step's first kernels, built by the pool,
loaded by the main process; outputs bitwise those of serial builds.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import Future

import pytest
import torch

pytest.importorskip("cutlass")

from k3compile.kernels import rms_norm
from k3compile.kernels.common import build_pool, disk_cache, dsl, launch
from k3compile.kernels.common.dsl import CompileCache, bucket
from k3compile.kernels.common.launch import Build, Deferred, Kernel, recording

from k3compile import settings
from k3compile.observe import Observer
from k3compile.progress import BucketProgress
from k3compile.settings import Options
from k3compile.stages import Context
from tests.tools import test_logging as logging_tests

pytestmark = pytest.mark.dsl

DIMS = (256, 512)
EPS = 1e-5
k3_logs = logging_tests.k3_logs  # torch's logging set for a test, reset after (fixture)


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


def test_using_lists_the_kernels_asked_for_and_missing_stats_their_entries(cache_dir,
                                                                          monkeypatch):
    """`launch.using` lists each kernel asked for once, missing or not; `build_pool.missing` is
    those without a disk entry (a stat: an empty file counts), a module that does not import
    among them, and none where the disk cache is off (no process could store one)."""
    x, w = rows(3, DIMS[0]), rows(1, DIMS[0], 1)[0]
    with launch.using() as builds, recording() as rec:
        for _ in range(2):
            rms_norm.rms_norm_cuda(x, w, EPS)
    assert builds == list(rec.builds.values()) and len(builds) == 1
    assert build_pool.missing(builds) == builds
    (b,) = builds
    path, _ = disk_cache.entry_of(b.op, b.key, b.arch, b.module)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    gone = dataclasses.replace(b, module="k3compile.kernels.no_such_kernel")
    assert build_pool.missing([b, gone]) == [gone]
    monkeypatch.setattr(settings.KERNELS, "cache_dir", None)
    assert build_pool.missing([dataclasses.replace(b, scalars=(1,))]) == []


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


@pytest.mark.slow  # 23-41 s on 2 shared cores: two spawned workers import torch and the DSL
def test_prebuild_builds_in_workers_then_the_main_process_loads(cache_dir):
    state = torch.zeros(4, 3)[:, 1]  # a strided view: its copy must keep the strides
    xs = [rows(1, d, d) for d in DIMS]
    ws = [rows(1, d, d + 1)[0] for d in DIMS]

    def step(state, *args):
        assert state.stride() == (3,)
        state.add_(1)  # the step's state write: on a copy in the record run
        return [rms_norm.rms_norm_cuda(x, w, EPS) for x, w in zip(xs, ws)]

    shown, done = [], []
    try:
        pooled = build_pool.prebuild(step, (state, *xs), written=frozenset({0}), workers=2,
                                     on_build=lambda n, w: shown.append((n, w)),
                                     on_done=done.append)
    finally:
        build_pool.shutdown()
    assert torch.equal(state, torch.zeros(4)), "the caller's state stays as it was"
    assert (pooled.kernels, pooled.failed, pooled.workers, shown) == (2, 0, 2, [(2, 2)])
    assert all(d.error is None and d.worker not in (0, os.getpid()) and len(d.compiles) == 1
               for d in done), done
    assert set(disk_cache.build_seconds(rms_norm.OP)) == {repr(d.build.key) for d in done}, \
        "each entry's header has its build seconds, under the key the main process records"
    assert disk_cache.stats() == {}, "the main process built nothing"
    assert len(list(cache_dir.rglob("*.k3kernel"))) == 2
    for d in DIMS:  # the real first call's kernels: loaded
        rms_norm.KERNEL.compiled(d, rms_norm.config(d, 1), rows=1)
    assert disk_cache.stats() == {"loaded": 2}


SCRIPT = """
import sys
from k3compile import settings
from k3compile.kernels.common import build_pool

print("script ran", flush=True)  # no main guard: a worker importing this script would print it
settings.KERNELS.cache_dir = sys.argv[1]
build_pool.start(1).submit(build_pool._ready).result()
build_pool.shutdown()
"""


@pytest.mark.slow  # 27-34 s on 2 shared cores: a process and its worker import torch and the DSL
def test_workers_do_not_run_the_parents_script(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "k3cache")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("script ran") == 1, done.stdout


def test_without_a_disk_cache_prebuild_runs_nothing(cache_dir, monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "cache_dir", None)
    calls = []
    pooled = build_pool.prebuild(lambda *a: calls.append(a), (torch.zeros(1),),
                                 written=frozenset(), workers=2)
    assert calls == [] and pooled.kernels == 0 and "K3_CACHE_DIR" in pooled.why
    assert build_pool.start(2) is None


# ---- GPU: a real step's first call, its kernels built by the pool -----------------------------

def _fresh_kernels(monkeypatch) -> None:
    """Empty in-process caches of every loaded kernel (as in a new process)."""
    import sys

    for name, module in list(sys.modules.items()):
        if name.startswith("k3compile.kernels"):
            for k in vars(module).values():
                if isinstance(k, Kernel):
                    monkeypatch.setattr(k, "cache", CompileCache(k.op))


def _tiny_steps(folder, workers: int, monkeypatch) -> tuple[list, dict]:
    """Three B1 decode steps of the tiny model (bf16, CUDA) compiled with `workers` build
    processes into a fresh cache `folder`: logits and state buffers, and what the main process
    did with kernels (disk_cache stats)."""
    from k3compile.models import build_model, get_config

    torch._dynamo.reset()
    _fresh_kernels(monkeypatch)
    monkeypatch.setattr(settings.KERNELS, "cache_dir", str(folder))
    monkeypatch.setattr(settings.KERNELS, "build_workers", workers)
    monkeypatch.setattr(disk_cache, "STATS", Counter())
    cfg = get_config("tiny")
    torch.manual_seed(0)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, max_batch=8, max_seq_len=64)
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"buckets": (1,), "cuda_graphs": False, "executor": "aten"})
    out = []
    with torch.no_grad():
        for i in range(3):
            ids = torch.tensor([7 + i], device="cuda")
            pos, slots = torch.tensor([i], device="cuda"), torch.tensor([0], device="cuda")
            out.append(step(ids, pos, slots).clone())
    out += [b.clone() for b in model.buffers()]
    return out, dict(disk_cache.STATS)


@pytest.mark.gpu
def test_a_cuda_step_builds_its_first_kernels_in_the_pool(tmp_path, monkeypatch):
    """The tiny model in bf16 at bucket 1, compiled from a fresh kernel cache one by one and
    then from another fresh one with 2 build workers: with the pool the main process builds no
    kernel and loads every one the serial run built, and logits and states are bitwise equal."""
    try:
        serial, s_stats = _tiny_steps(tmp_path / "serial", 0, monkeypatch)
        pooled, p_stats = _tiny_steps(tmp_path / "pooled", 2, monkeypatch)
    finally:
        build_pool.shutdown()
    assert s_stats.get("built", 0) > 0, s_stats
    assert p_stats.get("built", 0) == 0 and p_stats.get("loaded") == s_stats["built"], p_stats
    assert all(torch.equal(a, b) for a, b in zip(serial, pooled, strict=True))


def test_a_refused_call_in_record_mode_is_not_counted_as_a_fallback(cache_dir):
    """The record run's calls are made again by the real first call: a refusal counts once (in
    `fallback_counts`, which `summary()` shows), not twice."""
    x, w = rows(3, DIMS[0])[:, 1:], rows(1, DIMS[0] - 1, 1)[0]  # odd width: the kernel refuses
    dsl.reset_fallback_counts()
    with recording() as rec:
        y = rms_norm.rms_norm_cuda(x, w, EPS)
    assert dsl.fallback_counts() == {} and rec.builds == {}
    torch.testing.assert_close(y, rms_norm.rms_norm_ref(x, w, EPS), rtol=0, atol=0)
    rms_norm.rms_norm_cuda(x, w, EPS)  # the real call
    assert sum(dsl.fallback_counts().values()) == 1
    dsl.reset_fallback_counts()


@pytest.mark.parametrize(("value", "local", "want"), [
    (None, None, "cores - 1"), ("", None, "cores - 1"), ("0", None, 0), ("6", None, 6),
    ("auto", None, "cores - 1"), ("auto", "2", "cores // 2 - 1"), ("auto", "8", 1),
    ("auto", "16", 0), ("auto", "999", 0), ("auto", "x", "cores - 1")])
def test_build_workers_setting(monkeypatch, value, local, want):
    """K3_BUILD_WORKERS: a count, or `auto` (also unset): this process's 16 cores shared by the host's ranks
    (torchrun's LOCAL_WORLD_SIZE), less one: at least one, none (one by one) where a rank's
    share is a single core (16 ranks) or less."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    expected = {"cores - 1": 15, "cores // 2 - 1": 7}.get(want, want)
    assert settings.parse_workers(value) == expected
    with pytest.raises(ValueError, match="K3_BUILD_WORKERS"):
        settings.parse_workers("many")


# ---- the order of the pool's builds, and what the main process hears of each ---------------------

def fake(op: str, n: int) -> Build:
    return Build(op, "k3compile.kernels.fake", (n,), "sm_90a", None, ())


class _Pool:
    """A stand-in for the process pool: spawns nothing; each submitted build is finished at
    once, as if a worker (process 4242) had built it into the entry the main process expects,
    or (scalars in `loaded`) worker 4243 had loaded what another process stored."""

    def __init__(self):
        self.submitted: list[Build] = []
        self.loaded: set[int] = set()

    def submit(self, fn, b: Build, kernels):
        self.submitted.append(b)
        entry, n = f"{b.op}-{b.scalars[0]}.k3kernel", b.scalars[0]
        future = Future()
        future.set_result((entry, (), 0.05, 4243) if n in self.loaded
                          else (entry, ((f"{b.op}_host", 1.25),), 1.5, 4242))
        return future


@pytest.fixture
def pool(cache_dir, monkeypatch):
    """A stand-in pool, every key storable (its entry named by op and scalars)."""
    stand_in = _Pool()
    monkeypatch.setattr(build_pool, "start", lambda workers: stand_in)
    monkeypatch.setattr(disk_cache, "entry_of", lambda op, key, arch, module: (
        disk_cache.root() / f"{op}-{key[0]}.k3kernel", "text"))
    return stand_in


def history(op: str, n: int, seconds: float | None, name: str) -> None:
    """An entry of `op` in the disk cache whose header recorded `seconds` for scalars (n,)."""
    text = json.dumps({"op": op, "key": repr(fake(op, n).key)})
    path = disk_cache.root() / op / f"{name}.k3kernel"
    disk_cache.write_entry(path, text, b"object", seconds)
    assert disk_cache.read_entry(path, text) == b"object"


BUILDS = [fake("rms_norm", 1), fake("gemv", 2), fake("mla_decode", 3), fake("gemv", 4),
          fake("not_a_family", 5)]


def test_without_history_builds_go_slowest_family_first(pool):
    """A cold cache: the family weights (mla_decode > gemv = an unknown op > rms_norm); equal
    ones in the record run's order."""
    assert build_pool.build(BUILDS, 2) == (5, 0)
    assert [(b.op, b.scalars[0]) for b in pool.submitted] == [
        ("mla_decode", 3), ("gemv", 2), ("gemv", 4), ("not_a_family", 5), ("rms_norm", 1)]


def test_recorded_build_seconds_order_the_builds(pool, cache_dir):
    """The seconds of an entry of the same key (here: rms_norm's 9 s), else the median of the
    op's entries (gemv: 0.6 s, below an unknown op's weight); entries without seconds (older
    headers) or unreadable are left out."""
    history("rms_norm", 1, 9.0, "old-source")
    for n, seconds in [(7, 0.5), (8, 0.3), (9, 0.7), (4, 3.0)]:
        history("gemv", n, seconds, f"e{n}")
    history("gemv", 2, None, "no-seconds")
    (cache_dir / "kernels" / "gemv" / "junk.k3kernel").write_bytes(b"not an entry")
    assert build_pool.expected_seconds(BUILDS) == [9.0, 0.6, 6.3, 3.0, 2.0]
    assert build_pool.build(BUILDS, 2) == (5, 0)
    assert [(b.op, b.scalars[0]) for b in pool.submitted] == [
        ("rms_norm", 1), ("mla_decode", 3), ("gemv", 4), ("not_a_family", 5), ("gemv", 2)]


@pytest.mark.skipif("TORCH_LOGS" in os.environ, reason="TORCH_LOGS set: torch ignores set_logs")
def test_pool_builds_reach_the_kernels_log_and_the_bar(pool, k3_logs):
    """A bucket's first run with the pool (a real record run of two rms_norm calls, the stand-in
    pool): the k3_kernels artifact gets one line per build as it arrives (name, op and scalars,
    arch, worker; `loaded` where the worker found another process's entry), and a terminal's
    bar counts them."""
    pytest.importorskip("tqdm")
    set_logs, seen = k3_logs
    set_logs(k3_kernels=True)
    pool.loaded = {DIMS[1]}
    xs, ws = [rows(1, d, d) for d in DIMS], [rows(1, d, d + 1)[0] for d in DIMS]
    calls = []

    def step():  # the record run calls the kernels; the real call (loading them) is not tested
        calls.append(len(calls))
        return [rms_norm.rms_norm_cuda(x, w, EPS) for x, w in zip(xs, ws)] if calls == [0] else []

    def prebuild(fn, args, on_build, on_done):
        return build_pool.prebuild(fn, args, written=frozenset(), workers=2, on_build=on_build,
                                   on_done=on_done)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = BucketProgress(Observer(), Context(Options.make({}), 1), [], stream=tty)
    p.first_run(step, prebuild)()
    assert (p.pooled.kernels, p.pooled.failed, p.pool_done, p.pool_total) == (2, 0, 2, 2)
    cfg = [repr((d, rms_norm.config(d, 1))) for d in DIMS]
    assert sorted(seen.texts("k3compile.__k3_kernels")) == [
        (f"bucket 1: built kernel rms_norm_host in 1.25 s (k3::rms_norm {cfg[0]}, None, "
         f"worker 4242)"),
        f"bucket 1: loaded kernel rms_norm in 0.05 s (k3::rms_norm {cfg[1]}, None, worker 4243)"]
    assert "kernels 1/2" in tty.getvalue() and "kernels 2/2" in tty.getvalue()
