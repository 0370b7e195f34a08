"""Compile progress (k3compile/progress.py): one line per bucket on stderr naming the bucket, the
stages with their times, the rewrites, verify's count and the kernels built; a tqdm bar on a
terminal; nothing under K3_QUIET=1. Kernel builds are counted through the kernels' hook
(`kernels.common.dsl.watch_builds`), here with `cute.compile` replaced by a stand-in."""

from __future__ import annotations

import io
import re
import sys
import types

import pytest
import torch
from k3compile.kernels.common import dsl
from torch import fx

import k3compile.backend as k3be
from k3compile import progress
from k3compile.observe import Observer
from k3compile.pipeline import stages
from k3compile.settings import Options
from k3compile.stages import Context
from tests.tools.norm_step import compile_and_check

LINE = re.compile(r"^k3: bucket 2 compiled in \d+\.\d s: (.*)$", re.MULTILINE)


@pytest.fixture
def every_stage(monkeypatch):
    monkeypatch.setattr(progress, "SHOWN_SECONDS", 0.0)  # name every stage, however fast
    monkeypatch.delenv("K3_QUIET", raising=False)


def test_one_line_per_bucket_names_the_stages_and_counts(every_stage, capsys):
    compile_and_check(verify=True)
    err = capsys.readouterr().err
    (line,) = LINE.findall(err)
    names = [name for name, _ in stages(Options.make({"verify": True}))]
    assert re.findall(r"(\w+) \d+\.\d s", line)[:len(names)] == names
    assert "torch " in line  # lowering and Inductor, outside the stages
    assert "1 rewrites, verify: 1 rewrites verified, 0 reverted; 0 kernels built" in line
    assert k3be.last_compiled().observer.reports[2].counts == {"rms_norm[float32]": 1}


def test_quiet_shows_nothing(every_stage, monkeypatch, capsys):
    monkeypatch.setenv("K3_QUIET", "1")
    compile_and_check()
    assert "k3: bucket" not in capsys.readouterr().err


def test_verify_count_is_in_the_summary(every_stage, monkeypatch):
    monkeypatch.setenv("K3_QUIET", "1")  # the summary says it even when nothing is shown
    compile_and_check(verify=True)
    assert "verify, by bucket compiled: 2: 1 rewrites verified, 0 reverted" in \
        k3be.last_compiled().summary()


# ---- the display alone, on a hand-built stage list --------------------------------------------

class _Tty(io.StringIO):
    def isatty(self):
        return True


def _fake_cute(monkeypatch):
    """`cutlass.cute.compile` replaced: returns its host's name, as if compiled."""
    cute = types.SimpleNamespace(compile=lambda host, *args, options="": f"built {host.__name__}")
    monkeypatch.setitem(sys.modules, "cutlass", types.SimpleNamespace(cute=cute))


def _stage_run(observer, ctx, names):
    gm = fx.symbolic_trace(torch.nn.Tanh())
    for name in names:
        gm = observer.run(name, lambda g, c: g, gm, ctx)


def test_kernel_builds_of_the_first_run_are_counted(every_stage, monkeypatch):
    observer, ctx, stream = Observer(), Context(Options.make({}), 2), io.StringIO()
    p = progress.BucketProgress(observer, ctx, ["normalize", "fuse"], stream=stream)
    with p.compiling():
        _stage_run(observer, ctx, ["normalize", "fuse"])

    def kernel(name):
        return types.SimpleNamespace(__name__=name)

    def step(x):  # what a GPU step does on its first call: compile the kernels it launches
        return [dsl.compile_kernel(kernel("rms_norm")), dsl.compile_kernel(kernel("gemv")), x]

    run = p.first_run(step)
    _fake_cute(monkeypatch)
    assert run(7) == ["built rms_norm", "built gemv", 7]
    assert run(8) == ["built rms_norm", "built gemv", 8]  # later calls: not watched, not shown
    assert [name for name, _ in p.kernels] == ["rms_norm", "gemv"]
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("k3: bucket 2 compiled in ")
    assert re.search(r": normalize \d\.\d s, fuse \d\.\d s, torch", line)
    assert re.search(r"; 2 kernels built in \d+\.\d s; first run \d+\.\d s$", line)


def test_builds_outside_a_watched_compile_are_not_counted(monkeypatch):
    observer, ctx = Observer(), Context(Options.make({}), 4)
    p = progress.BucketProgress(observer, ctx, [], stream=io.StringIO())
    _fake_cute(monkeypatch)
    assert dsl.compile_kernel(types.SimpleNamespace(__name__="rms_norm")) == "built rms_norm"
    assert p.kernels == []


def test_a_failing_stage_closes_with_a_failed_line(every_stage):
    observer, ctx, stream = Observer(), Context(Options.make({}), 2), io.StringIO()
    p = progress.BucketProgress(observer, ctx, ["normalize", "fuse"], stream=stream)

    def broken(gm, ctx):
        raise RuntimeError("stage bug")

    with pytest.raises(RuntimeError, match="stage bug"), p.compiling():
        gm = observer.run("normalize", lambda g, c: g, fx.symbolic_trace(torch.nn.Tanh()), ctx)
        observer.run("fuse", broken, gm, ctx)
    (line,) = stream.getvalue().splitlines()
    assert re.match(r"k3: bucket 2 failed after \d+\.\d s: normalize \d\.\d s, torch", line)


def test_a_terminal_gets_a_bar_naming_the_stage(every_stage):
    pytest.importorskip("tqdm")
    observer, ctx, tty = Observer(), Context(Options.make({}), 2), _Tty()
    p = progress.BucketProgress(observer, ctx, ["normalize", "canonicalize", "fuse"], stream=tty)
    with p.compiling():
        _stage_run(observer, ctx, ["normalize", "canonicalize", "fuse"])
    p.first_run(lambda: None)()
    shown = tty.getvalue()
    assert "k3 bucket 2: canonicalize" in shown and "k3 bucket 2: first run" in shown
    assert re.search(r"3/4 stages .*0 kernels built", shown)
    assert shown.rstrip().splitlines()[-1].split("\r")[-1].startswith("k3: bucket 2 compiled in")


def test_no_terminal_no_bar(every_stage):
    observer, ctx, stream = Observer(), Context(Options.make({}), 2), io.StringIO()
    p = progress.BucketProgress(observer, ctx, ["fuse"], stream=stream)
    assert p.bar is None
    with p.compiling():
        _stage_run(observer, ctx, ["fuse"])
    p.first_run(lambda: None)()
    assert len(stream.getvalue().splitlines()) == 1 and "\r" not in stream.getvalue()


def test_a_terminal_without_tqdm_gets_the_line(every_stage, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails
    observer, ctx, tty = Observer(), Context(Options.make({}), 2), _Tty()
    p = progress.BucketProgress(observer, ctx, ["fuse"], stream=tty)
    assert p.bar is None
    with p.compiling():
        _stage_run(observer, ctx, ["fuse"])
    p.first_run(lambda: None)()
    (line,) = tty.getvalue().splitlines()
    assert re.match(r"k3: bucket 2 compiled in \d+\.\d s: fuse \d\.\d s, torch", line)
