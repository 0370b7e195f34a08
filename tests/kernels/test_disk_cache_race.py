"""Processes sharing one kernel cache entry (kernels/common/disk_cache.py): TP ranks compiling the
same kernel at once.

Without the DSL (forked processes, the DSL's export and load stood in by the payload bytes
themselves, so what is checked is the cache's own file handling): writers racing on one entry
while readers read it: every read is a whole entry of one writer's bytes or a clean miss, never a
bad entry, and the entry left is one writer's, whole, with no temporary file. Processes missing
one entry at once build it once: the others wait on its lock and load the builder's bytes; a bad
entry found by all of them at once is rebuilt once. A lock held past the timeout is built around.
With the DSL (`slow`): processes compiling rms_norm through `launch.Kernel` at once compile it
once; the others load the entry, which the parent then loads too.
"""

import itertools
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from k3compile.kernels.common import disk_cache

from k3compile import settings

ROOT = Path(__file__).resolve().parents[2]
TEXT = json.dumps({"format": disk_cache.FORMAT, "op": "race", "key": "(1, 2)"})
FORK = multiprocessing.get_context("fork")


@pytest.fixture
def entry(tmp_path, monkeypatch):
    """An entry path in a fresh cache; fetch keyed by TEXT, its payload the compiled 'kernel'."""
    monkeypatch.setattr(settings.KERNELS, "cache_dir", str(tmp_path / "k3cache"))
    monkeypatch.setattr(disk_cache, "STATS", Counter())
    monkeypatch.setattr(disk_cache, "have_dsl", lambda: True)
    monkeypatch.setattr(disk_cache, "key_text", lambda op, key, arch, module: TEXT)
    monkeypatch.setattr(disk_cache, "export", lambda compiled, name: compiled)
    monkeypatch.setattr(disk_cache, "load", lambda payload, name: payload)
    return disk_cache.entry_path(disk_cache.root(), "race", TEXT)


def payload(writer: int) -> bytes:
    """A payload of its own per writer, 256 KiB: a torn write would mix or cut two of them."""
    return bytes([writer]) * 1024 + os.urandom(16) * (255 * 64) + bytes([writer]) * 1024


def _run(workers: list[tuple], timeout: float = 60) -> list:
    """Start `workers` [(function, *args)] in forked processes at once; their results in order."""
    results, start = FORK.Queue(), FORK.Barrier(len(workers))
    procs = [FORK.Process(target=_worker, args=(i, start, results, fn, *args))
             for i, (fn, *args) in enumerate(workers)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(timeout)
            assert p.exitcode == 0, p.exitcode
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [got[i] for i in range(len(procs))]


def _worker(i, start, results, fn, *args):
    start.wait()
    try:
        results.put((i, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((i, f"raised {type(e).__name__}: {e}"))


# ---- writers and readers -------------------------------------------------------------------------

def _write(path: Path, data: bytes, times: int) -> int:
    for _ in range(times):
        disk_cache.write_entry(path, TEXT, data)
    return times


def _read(path: Path, seconds: float) -> dict:
    seen, deadline = Counter(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = disk_cache.read_entry(path, TEXT)
            whole = data == payload_of.get(data[0])
            seen[data[0] if whole else "wrong"] += 1
        except FileNotFoundError:
            seen["miss"] += 1
        except disk_cache.BadEntry as e:
            seen[f"bad: {e}"] += 1
    return dict(seen)


payload_of: dict[int, bytes] = {}  # writer -> its payload (made before the fork)


def test_readers_see_a_whole_entry_or_none_while_writers_race(entry, monkeypatch):
    writers = (1, 2, 3)
    monkeypatch.setattr(sys.modules[__name__], "payload_of", {w: payload(w) for w in writers})
    got = _run([(_write, entry, payload_of[w], 40) for w in writers]
               + [(_read, entry, 1.5) for _ in range(2)])
    assert got[:3] == [40, 40, 40], got
    for seen in got[3:]:
        assert isinstance(seen, dict), seen
        assert not [k for k in seen if str(k).startswith("bad") or k == "wrong"], seen
        assert sum(v for k, v in seen.items() if k in writers) > 0, f"no whole entry read: {seen}"
    assert disk_cache.read_entry(entry, TEXT) in payload_of.values()
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name], "temporary file left"


# ---- one build per entry -------------------------------------------------------------------------

def _fetch(mine: bytes, build_seconds: float) -> dict:
    """fetch in this process: what it got, and whether it built, loaded or rebuilt."""
    def build():
        time.sleep(build_seconds)
        return mine

    got = disk_cache.fetch("race", (1, 2), build, arch=None, module=__name__)
    return {"got": got, "stats": dict(disk_cache.STATS)}


def _assert_one_build(got: list, mine: list[bytes], **others) -> None:
    assert all(isinstance(g, dict) for g in got), got
    builders = [i for i, g in enumerate(got) if g["stats"].get("built")]
    assert len(builders) == 1, [g["stats"] for g in got]
    [b] = builders
    assert got[b]["stats"] == {"built": 1, "stored": 1, **others}
    for i, g in enumerate(got):
        assert g["got"] == mine[b], f"process {i} did not get the builder's kernel"
        if i != b:
            assert g["stats"] == {"loaded": 1}, g["stats"]


def test_processes_missing_one_entry_at_once_build_it_once(entry):
    mine = [payload(p) for p in range(4)]  # what each process's own build would make
    got = _run([(_fetch, m, 0.5) for m in mine])
    _assert_one_build(got, mine)
    assert disk_cache.read_entry(entry, TEXT) in mine


def test_a_bad_entry_found_by_processes_at_once_is_rebuilt_once(entry):
    disk_cache.write_entry(entry, TEXT, b"old")
    entry.write_bytes(entry.read_bytes()[:-1])  # truncated: fails its checksum
    mine = [payload(p) for p in range(3)]
    got = _run([(_fetch, m, 0.5) for m in mine])
    _assert_one_build(got, mine, rebuilt=1)
    assert disk_cache.read_entry(entry, TEXT) in mine


def test_a_lock_held_past_the_timeout_is_built_around(entry, monkeypatch, caplog):
    monkeypatch.setattr(disk_cache, "LOCK_SECONDS", 0.2)
    with disk_cache.entry_lock(entry), caplog.at_level(logging.WARNING, "k3compile.kernels"):
        got = _fetch(b"built", 0)
    assert got == {"got": b"built", "stats": {"built": 1, "stored": 1}}
    assert "waited" in caplog.text
    assert disk_cache.read_entry(entry, TEXT) == b"built"


def test_the_lock_serialises_processes(entry):
    """Two processes in the lock at once would overlap their [start, end) intervals."""
    def hold():
        with disk_cache.entry_lock(entry):
            t0 = time.monotonic()
            time.sleep(0.2)
            return t0, time.monotonic()

    spans = sorted(_run([(hold,) for _ in range(3)]))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans


# ---- with the DSL: rms_norm compiled by processes at once ----------------------------------------

WORKER = """
import json, os, sys, time
from pathlib import Path
from k3compile.kernels import rms_norm
from k3compile.kernels.common import disk_cache
from k3compile.kernels.common.launch import Kernel

ready = Path(sys.argv[1])  # every process imported the DSL: all compile at once
(ready / str(os.getpid())).touch()
while len(list(ready.iterdir())) < int(sys.argv[2]):
    time.sleep(0.01)
Kernel("rms_norm", rms_norm.build).compiled(256, rms_norm.config(256, 1), arch="sm_90a",
                                            pdl=False)
print(json.dumps(disk_cache.stats()))
"""


@pytest.mark.slow
@pytest.mark.dsl
def test_processes_compiling_one_kernel_at_once_compile_it_once(tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    from k3compile.kernels import rms_norm
    from k3compile.kernels.common.launch import Kernel

    cache = tmp_path / "k3cache"
    env = {**os.environ, "K3_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(ready), "3"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    stats = sorted((json.loads(out.strip().splitlines()[-1]) for out, _ in outs), key=len)
    assert stats == [{"loaded": 1}, {"loaded": 1}, {"built": 1, "stored": 1}], stats

    monkeypatch.setattr(settings.KERNELS, "cache_dir", str(cache))
    monkeypatch.setattr(disk_cache, "STATS", Counter())
    [path] = cache.rglob("*.k3kernel")
    text = disk_cache.key_text("rms_norm", (256, rms_norm.config(256, 1), "sm_90a",
                                            ("pdl", False)), "sm_90a", rms_norm.__name__)
    assert disk_cache.read_entry(path, text)  # whole, of this key
    Kernel("rms_norm", rms_norm.build).compiled(256, rms_norm.config(256, 1), arch="sm_90a",
                                                pdl=False)
    assert disk_cache.stats() == {"loaded": 1}
