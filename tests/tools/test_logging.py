"""The backend's logs through torch's logging (k3compile/logs.py): `set_logs` (in process) and
TORCH_LOGS (at `import torch`, through the `torch.backends` entry point) turn "k3" and the
k3_fusion / k3_kernels / k3_graphs artifacts on and off; TORCH_TRACE's structured log gets the
graph before and after the stages; plain `logging` (caplog) keeps working where torch's logging
was not asked for."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import tomllib
import types
from pathlib import Path

import pytest
import torch
from k3compile.kernels.common import dsl
from torch._logging import _internal

from k3compile import logs
from k3compile.observe import Observer
from k3compile.pipeline import stages
from k3compile.progress import BucketProgress
from k3compile.settings import Options
from k3compile.stages import Context
from tests.tools.norm_step import OPTIONS, compile_and_check

pytestmark = pytest.mark.skipif("TORCH_LOGS" in os.environ,
                                reason="TORCH_LOGS set: torch ignores set_logs")
ROOT = Path(__file__).resolve().parents[2]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def texts(self, logger: str | None = None) -> list[str]:
        return [r.getMessage() for r in self.records if logger is None or r.name == logger]


@pytest.fixture
def k3_logs(monkeypatch):
    """`set(**modules)` calls torch's set_logs; afterwards torch's logging is reset and the
    `k3compile` logger is a plain propagating logger again (torch's setup detaches the loggers
    it manages from the root). Yields (set, records seen by the `k3compile` logger)."""
    monkeypatch.delenv("K3_QUIET", raising=False)
    k3 = logging.getLogger(logs.LOGGER)
    handler = _Records()

    def set_logs(**modules):
        torch._logging.set_logs(modules=modules)
        k3.addHandler(handler)

    yield set_logs, handler
    k3.removeHandler(handler)
    torch._logging.set_logs()
    _internal._clear_handlers(k3)
    k3.setLevel(logging.NOTSET)
    k3.propagate = True


FUSION = "k3.rms_norm <- pattern rms_norm[float32] at norm (node "


def test_plus_k3_turns_on_debug_logs_and_the_fusion_artifact(k3_logs):
    set_logs, seen = k3_logs
    set_logs(k3=logging.DEBUG)
    compile_and_check(verify=True)
    assert any(t.startswith("stage fuse (batch 2)") for t in seen.texts("k3compile"))
    fusion = seen.texts("k3compile.__k3_fusion")
    assert any(t.startswith("bucket 2: " + FUSION) for t in fusion)
    assert "bucket 2: 1 rewrites verified, 0 reverted" in fusion
    assert seen.texts("k3compile.__k3_graphs") == []  # off by default: only when named


def test_the_artifact_alone_and_nothing_unasked(k3_logs):
    set_logs, seen = k3_logs
    set_logs(k3_fusion=True)
    compile_and_check()
    assert [t for t in seen.texts() if FUSION in t]
    assert [r for r in seen.records if r.name == "k3compile" and r.levelno < logging.WARNING] == []
    seen.records.clear()
    set_logs()
    compile_and_check()
    assert [r for r in seen.records if r.levelno < logging.WARNING] == []


def test_the_graphs_artifact_shows_the_graph_before_and_after_each_stage(k3_logs):
    set_logs, seen = k3_logs
    set_logs(k3_graphs=True)
    compile_and_check()
    graphs = seen.texts("k3compile.__k3_graphs")
    before, after_fuse = graphs[0], next(g for g in graphs if "after stage fuse" in g)
    assert before.startswith("bucket 2: graph before stage normalize:")
    assert "k3.rms_norm" not in before and "aten.rsqrt" in before
    assert "torch.ops.k3.rms_norm.default" in after_fuse and "aten.rsqrt" not in after_fuse
    after = [g.split("after stage ", 1)[1].split(" ", 1)[0] for g in graphs[1:]]
    assert after == [name for name, _ in stages(Options.make(OPTIONS))]


def test_kernel_builds_reach_the_kernels_artifact(k3_logs, monkeypatch):
    set_logs, seen = k3_logs
    set_logs(k3_kernels=True)
    cute = types.SimpleNamespace(compile=lambda host, *a, options="": host.__name__)
    monkeypatch.setitem(sys.modules, "cutlass", types.SimpleNamespace(cute=cute))
    p = BucketProgress(Observer(), Context(Options.make({}), 4), [], stream=io.StringIO())
    built = p.first_run(lambda: dsl.compile_kernel(types.SimpleNamespace(__name__="moe_route")))()
    assert built == "moe_route"
    (line,) = seen.texts("k3compile.__k3_kernels")
    assert line.startswith("bucket 4: built kernel moe_route in ")


def test_structured_trace_gets_the_stage_graphs(k3_logs):
    trace = _Records()
    _internal.trace_log.addHandler(trace)
    try:
        compile_and_check()
    finally:
        _internal.trace_log.removeHandler(trace)
    ours = {r.metadata["artifact"]["name"]: r.payload for r in trace.records
            if r.metadata.get("artifact", {}).get("name", "").startswith("k3_")}
    assert "aten.rsqrt" in ours["k3_bucket2_before_normalize"]
    assert "torch.ops.k3.rms_norm.default" in ours["k3_bucket2_after_fuse"]
    assert "k3_bucket2_after_pack" in ours
    report = json.loads(ours["k3_bucket2_fuse_report"])
    assert len(report) == 1 and report[0].startswith(FUSION)
    # the frame's compile: tlparse files the artifacts under it
    assert all("frame_id" in r.metadata for r in trace.records if "artifact" in r.metadata)


def test_plain_logging_still_sees_the_backend(k3_logs, caplog):
    logs.register()  # registered, torch's logging not asked: the logger still propagates
    with caplog.at_level(logging.INFO, logger="k3compile"):
        compile_and_check(verify=True)
    assert "k3 verify (batch 2): 1 rewrites verified, 0 reverted" in caplog.messages


@pytest.mark.parametrize("settings,named", [("+k3", True), ("k3_fusion,dynamo", True),
                                            ("-k3_graphs", True), ("+dynamo", False),
                                            ("k3compile", False), ("", False)])
def test_which_torch_logs_settings_name_k3(settings, named):
    assert logs.names_k3(settings) is named


@pytest.mark.slow
def test_torch_logs_env_works_through_the_entry_point(tmp_path):
    """What `pip install` registers (pyproject's torch.backends entry point), as a dist-info on
    the path: TORCH_LOGS="+k3,k3_graphs" is taken at `import torch` and the logs print."""
    info = tmp_path / "k3logs-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: k3logs\nVersion: 0\n")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    entries = project["entry-points"]["torch.backends"]
    (info / "entry_points.txt").write_text(
        "[torch.backends]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    code = textwrap.dedent("""
        import logging, torch
        from torch._logging import _internal
        print(_internal.log_state.log_qname_to_level, sorted(_internal.log_state.artifact_names))
        logging.getLogger("k3compile.rewrite").debug("rewrite debug")
        from k3compile import logs
        logs.artifact("k3_graphs").debug("a graph")
        logs.artifact("k3_kernels").debug("a kernel")
    """)
    env = {**os.environ, "TORCH_LOGS": "+k3,k3_graphs",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=False, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "{'k3compile': 10} ['k3_graphs']"
    for text in ("rewrite debug", "[__k3_graphs] a graph", "[__k3_kernels] a kernel"):
        assert text in out.stderr
