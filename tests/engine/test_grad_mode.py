"""A decode step compiled with grad mode on and parameters that require grad (a user's model not
put under `torch.no_grad()`): the backend compiles it for inference, so its state writes stay in
the graph where the stages see them (`k3compile.pipeline.inference_only`), with a warning; the
values and the state equal eager's. Before: AOTAutograd's training graph moved the writes to a
runtime epilogue, and the blind K3 spelling (tests/spellings) found no K3 layer, no slot input,
and crashed under `mark_batch` (symbolic `_assert_scalar` nodes without a value)."""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

import k3compile.backend as k3be
from k3compile.layers import state_inputs
from tests.conftest import rel_err


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16, bias=False)
        self.register_buffer("state", torch.zeros(5, 2, 4, 4))

    def forward(self, x, slots):
        s = self.state[slots] * 0.5 + self.proj(x).view(-1, 2, 2, 4).repeat(1, 1, 2, 1)
        self.state[slots] = s
        return s.sum((-1, -2)).flatten(1) @ torch.ones(2, 16)


def test_grad_mode_step_is_compiled_for_inference_with_its_state_in_the_graph(caplog):
    torch.manual_seed(0)
    model = Stateful()
    assert model.proj.weight.requires_grad and torch.is_grad_enabled()
    eager = copy.deepcopy(model)
    k3be.ensure_registered()
    torch._dynamo.reset()
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    x, slots = torch.randn(3, 16), torch.tensor([0, 2, 3])
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        for _ in range(2):
            got, want = step(x, slots), eager(x, slots)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert rel_err(got, want) <= 1e-6
    assert rel_err(model.state, eager.state) <= 1e-6
    assert any("compiled for inference" in r.message for r in caplog.records)
    (graph,) = list(k3be.last_compiled().observer.graphs.values())[-1:]
    assert [n.name for n in state_inputs(graph)]  # the state write is in the graph
