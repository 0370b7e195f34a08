"""Each foreign spelling plans on a GPU graph as on the CPU one, as far as the device its factory
ops name goes: the canonical rules run with every `device=` keyword of the graph renamed to cuda
(this CPU build cannot make a CUDA tensor, so a rule that ran one would raise and be undone), and
the plan must lose exactly what the spelling's test records for the CPU, with the same values.
Session 26 found rule expert_rows losing spell6's experts on an H100 only (its proof ran on the
graph's CUDA constants): tests/canonical/test_gpu_devices.py has the rule-level tests."""

from __future__ import annotations

import importlib

import pytest
import torch

from k3compile.stages import canonicalize as stage
from tests.conftest import TOL
from tests.spellings import foreign

from ..canonical.test_gpu_devices import name_device

SPELLINGS = ("spell5", "spell6", "spell7", "spell8", "spell9", "redteam")


@pytest.fixture(scope="module")
def reference_plan():
    return foreign.reference_plan()


@pytest.mark.slow
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_rules_plan_a_graph_naming_cuda_as_the_cpu_one(spelling, reference_plan, monkeypatch):
    model = importlib.import_module(f"tests.models.{spelling}_k3")
    test = importlib.import_module(f"tests.e2e.test_{spelling}_spelling")
    apply = stage._apply

    def on_gpu(gm, ctx, skipped, verify):
        name_device(gm.graph, torch.device("cuda"))
        try:
            return apply(gm, ctx, skipped, verify)
        finally:
            name_device(gm.graph, torch.device("cpu"))

    monkeypatch.setattr(stage, "_apply", on_gpu)
    err, _, compiled = foreign.run(torch.float32, model.from_builtin, model.state_of)
    assert err <= TOL["aten_cpu"], err
    (report,) = compiled.observer.reports.values()
    assert not [r for r in report.reverted if r.pattern.startswith("canonical.")], report.reverted
    assert foreign.lost(reference_plan, foreign.per_layer(compiled)) == test.LOST[torch.float32]
