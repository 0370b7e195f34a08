"""Verify mode on the tiny model: every rewrite is checked against its unfused pattern on fresh
random inputs of the bucket's shapes at compile time; none is reverted and the result equals
eager. (The small config gives 151 verified / 0 reverted the same way; too slow for CI.)"""

from __future__ import annotations

import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err


def test_verify_mode_on_tiny(monkeypatch):
    monkeypatch.setenv("K3_VERIFY", "1")
    torch._dynamo.reset()
    cfg = get_config("tiny")
    eager = build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=16)
    model = build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=16)
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    ids, pos, slots = torch.tensor([3, 7]), torch.tensor([0, 0]), torch.tensor([1, 0])
    assert rel_err(step(ids, pos, slots), eager(ids, pos, slots)) <= TOL["aten_cpu"]
    report = next(iter(k3be.last_compiled().observer.reports.values()))
    assert report.verified == len(report.hits) > 50
    assert not report.reverted, report.reverted
