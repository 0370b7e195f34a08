"""K3_BUILD_WORKERS in the pipeline (k3compile/pipeline.py `written_inputs`, `_prebuilder`):
the first call of a bucket runs the step once in record mode on clones of the inputs it writes,
then for real. CPU: stage_cache's stateful block (it writes rows of a state buffer), compiled
with the prebuild forced on (it is for CUDA steps only; on a CPU no kernel is missing, so the
pool builds nothing): the written input found is the state buffer, the record run writes a
clone, and each step's outputs and state equal eager's (the state advanced once per step, not
twice at the first), through AOTAutograd and, in a second compile from the stage cache's link,
without it; steps after the first run no record run. A later compile skips the record run only
where every kernel the bucket's first run asked for (kept beside its link) is on disk: a
stand-in kernel whose entry is missing gets the record run again, and once its entry is there,
none (needs the DSL, for the entries' keys). A kernel list that cannot be used gets the record
run, never a failed compile."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import re

import pytest
import torch
from k3compile.kernels.common import build_pool, disk_cache, launch

from k3compile import files, pipeline, settings, stage_cache
from tests.stages import test_stage_cache as stage_tests

cache_dir = stage_tests.cache_dir  # a fresh stage cache (fixture)


@pytest.fixture
def prebuilds(cache_dir, monkeypatch):
    """Each prebuild's written positions and whether the record run got the caller's tensors
    there (it must get clones)."""
    monkeypatch.setattr(disk_cache, "root", lambda: cache_dir / "kernels")
    monkeypatch.setattr(settings.KERNELS, "build_workers", 1)
    monkeypatch.setattr(build_pool, "start", lambda workers: None)
    real_prebuilder, real_prebuild, seen = pipeline._prebuilder, build_pool.prebuild, []
    monkeypatch.setattr(pipeline, "_prebuilder",  # as on CUDA
                        lambda written, cuda, warm=False: real_prebuilder(written, True, warm))

    def prebuild(step, args, *, written, **kw):
        def recorded(*given):
            seen.append((written, [given[i] is args[i] for i in sorted(written)],
                         [args[i].shape for i in sorted(written)]))
            return step(*given)
        return real_prebuild(recorded, args, written=written, **kw)

    monkeypatch.setattr(build_pool, "prebuild", prebuild)
    return seen


def eager(batches):
    model, out = stage_tests.Stateful(0), []
    with torch.no_grad():
        for b in batches:
            x = torch.randn(b, 32, generator=torch.Generator().manual_seed(b))
            out.append([model(x, torch.arange(b) * 2 % 8), model.state.clone()])
    return out


def test_the_first_call_writes_the_state_once(prebuilds, monkeypatch, capsys):
    monkeypatch.delenv("K3_QUIET", raising=False)
    want = eager([4, 4])
    cold, _, _, s_cold = stage_tests._steps([4, 4])
    warm, _, _, s_warm = stage_tests._steps([4, 4])
    assert s_cold["linked"] == 1 and s_warm["direct"] == 1, "the second skipped AOTAutograd"
    for got in (cold, warm):
        for g, w in zip(got, want, strict=True):
            for a, b in zip(g, w, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the cold compile records; the warm one (a direct link: the bucket compiled whole before,
    # its kernels stored) runs no record run and starts no pool
    assert len(prebuilds) == 1, "one record run, in the cold compile"
    for written, same, shapes in prebuilds:
        assert shapes == [torch.Size([8, 64])], "the state buffer, and only it"
        assert same == [False], "the record run writes a clone"
    lines = re.findall(r"^k3: bucket 4 compiled .*$", capsys.readouterr().err, re.MULTILINE)
    assert len(lines) == 2, lines
    assert re.search(r"; none for 1 workers after a \d+\.\d s record run; first run", lines[0])
    assert "record run" not in lines[1], lines


STANDIN = launch.Kernel("standin", lambda *scalars, arch=None, pdl=None: object())


def test_a_kernel_missing_from_the_disk_cache_gets_the_record_run(prebuilds, monkeypatch):
    pytest.importorskip("cutlass")  # an entry's key holds the DSL's settings
    monkeypatch.setattr(STANDIN, "cache", launch.CompileCache("standin"))
    fixture_prebuild = build_pool.prebuild

    def prebuild(step, args, **kw):  # the step asks for the stand-in kernel, as a CUDA step would
        def with_kernel(*given):
            with pytest.raises(launch.Deferred):  # record mode: missing, not built
                STANDIN.compiled(4, rows=4)
            return step(*given)
        return fixture_prebuild(with_kernel, args, **kw)

    monkeypatch.setattr(build_pool, "prebuild", prebuild)
    want = eager([4])
    runs = []
    for _ in range(3):
        got, _, _, _ = stage_tests._steps([4])
        runs.append(len(prebuilds))
        for a, b in zip(got[0], want[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        (build,) = _kept_kernels()
        assert (build.op, build.scalars) == ("standin", (4,))
        if len(runs) == 2:  # its entry now on disk (a stat is all the check reads)
            path, _ = disk_cache.entry_of(build.op, build.key, build.arch, build.module)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
    assert runs == [1, 2, 2], "recorded cold, again while its entry was missing, then not"


def _kept_kernels() -> list:
    """The kernels kept beside the one link in the stage cache."""
    (link,) = stage_cache.root().glob("links/*.json")
    return stage_cache.stored_kernels(link, json.loads(link.read_text())["key"])


@pytest.mark.parametrize("damage", ["truncated", "key", "not_kernels", "not_pickle", "folder"])
def test_a_bad_kernel_list_gets_the_record_run(prebuilds, damage, caplog):
    """A kernel list that cannot be used (cut short, another key's, a pickle of something else,
    not a pickle, a folder where the file was) never fails a compile: it is removed and the
    record run runs, whose first run keeps a new list (where the folder leaves room)."""
    want = eager([4])
    stage_tests._steps([4])
    (link,) = stage_cache.root().glob("links/*.json")
    text = json.loads(link.read_text())["key"]
    where = stage_cache._kernels_path(link)
    assert _kept_kernels() == [], "a CPU step asks for no kernel"
    if damage == "truncated":
        where.write_bytes(where.read_bytes()[:40])
    elif damage == "folder":
        where.unlink()
        (where / "x").mkdir(parents=True)
    else:
        key, body = {"key": (f"{text} ", pickle.dumps([])),
                     "not_kernels": (text, pickle.dumps({"op": "standin"})),
                     "not_pickle": (text, b"no pickle")}[damage]
        files.write_entry(where, stage_cache.FORMAT, key, base64.b64encode(body).decode())
    with caplog.at_level(logging.DEBUG, logger="k3compile"):
        got, _, _, stats = stage_tests._steps([4])
    assert "kernel list" in caplog.text and "unusable" in caplog.text
    assert stats["direct"] == 1 and len(prebuilds) == 2, "a direct link, yet a record run"
    for a, b in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if damage == "folder":
        assert where.is_dir()
    else:
        assert _kept_kernels() == [] and stage_tests._steps([4])[3]["direct"] == 1
        assert len(prebuilds) == 2, "the list kept again: no record run"
