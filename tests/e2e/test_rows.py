"""Tokens per request T (issue 20 item 6): the KDA step fuses for every T from 1 to 8 (its
recurrence is unrolled, one pattern variant per T, traced only for the T a graph has), and a T
without a variant leaves a near miss, named in the contract's warning, that says why."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from k3compile import backend
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err

KDA_ONLY = dataclasses.replace(get_config("tiny"), num_hidden_layers=1, full_attn_layers=())


def _compile_rows(rows: int):
    torch._dynamo.reset()
    model, eager = (build_model(KDA_ONLY, dtype=torch.float32, max_batch=4, max_seq_len=32)
                    for _ in range(2))
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "buckets": (2,)})
    args = (torch.tensor([[5] * rows, [7] * rows]), torch.tensor([0, 3]), torch.tensor([0, 1]))
    assert rel_err(step(*args), eager(*args)) <= TOL["aten_cpu"]
    (report,) = backend.last_compiled().contracts.values()
    return report, backend.last_compiled()


def _fused_kda(report) -> int:
    return sum(lr.actual.get("fb_kda_decode", 0) for lr in report.layers)


@pytest.mark.parametrize("rows", [2, pytest.param(5, marks=pytest.mark.slow),
                                  pytest.param(7, marks=pytest.mark.slow)])
def test_kda_step_fuses_at_every_row_count(rows):
    report, _ = _compile_rows(rows)
    assert report.met and _fused_kda(report) == 1


def test_row_count_without_variant_names_the_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        report, compiled = _compile_rows(9)
    assert not report.met and _fused_kda(report) == 0
    warning = next(r.message for r in caplog.records if "contract not met" in r.message)
    assert "fb_kda_decode" in warning and "T = [9]" in warning and "1..8" in warning
