"""Verify mode on the tiny model: stage `verify` checks every rewrite `fuse` made against its
unfused pattern on fresh random inputs of the bucket's shapes (values, dtype and shape) at compile
time; none is reverted and the result equals eager. A wrong rewrite is reverted (the unfused
computation spliced back) and the compiled step still equals eager. (The small config gives 151
verified / 0 reverted the same way; too slow for CI.)"""

from __future__ import annotations

import dataclasses

import k3compile.patterns
import pytest
import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err


def _compile_tiny():
    torch._dynamo.reset()
    cfg = get_config("tiny")
    eager = build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=16)
    model = build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=16)
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    ids, pos, slots = torch.tensor([3, 7]), torch.tensor([0, 0]), torch.tensor([1, 0])
    assert rel_err(step(ids, pos, slots), eager(ids, pos, slots)) <= TOL["aten_cpu"]
    return k3be.last_compiled()


@pytest.mark.slow
def test_verify_mode_on_tiny(monkeypatch):
    monkeypatch.setenv("K3_VERIFY", "1")
    compiled = _compile_tiny()
    report = next(iter(compiled.observer.reports.values()))
    assert report.verified == len(report.hits) == len(report.rewrites) > 50
    assert not report.reverted, report.reverted
    names = [r.name for r in next(iter(compiled.observer.records.values()))]
    assert names.index("verify") == names.index("fuse") + 1


@pytest.mark.slow
def test_verify_reverts_a_wrong_pattern_in_the_pipeline(monkeypatch):
    """A buggy replacement for every plain RMSNorm (x 1.5): fused by `fuse`, reverted by
    `verify`, the step equal to eager (checked in _compile_tiny), the other rewrites kept."""
    monkeypatch.setenv("K3_VERIFY", "1")
    real = k3compile.patterns.all_patterns()

    def broken(p):
        if not p.name.startswith("rms_norm"):
            return p
        return dataclasses.replace(p, replace=lambda *a, _r=p.replace: _r(*a) * 1.5)

    monkeypatch.setattr(k3compile.patterns, "all_patterns", lambda: tuple(broken(p) for p in real))
    compiled = _compile_tiny()
    report = next(iter(compiled.observer.reports.values()))
    assert report.reverted and all(r.pattern.startswith("rms_norm") for r in report.reverted)
    assert all("relative error" in r.error for r in report.reverted)
    assert not any(h.pattern.startswith("rms_norm") for h in report.hits)
    assert report.verified == len(report.hits) > 50
    graph = next(iter(compiled.observer.graphs.values()))
    assert not any(str(n.target).startswith("k3.rms_norm") for n in graph.nodes)
