"""A runtime check on values in the step (`_assert_async`, which `F.one_hot` emits for its index
range) compiles under backend="k3": stage `normalize` gives it the None it returns as its
`meta["val"]` (AOTAutograd leaves it without one, and stage `check` refused the graph: the
eighth spelling's one-hot routing matrix, tests/models/spell8_k3.py). The check stays: an index
out of range fails the compiled step as it fails eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import k3compile.backend as k3be
from tests.conftest import rel_err


class OneHotRouting(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 8, bias=False)

    def forward(self, x, extra_ids):
        scores = torch.sigmoid(self.router(x))
        top = torch.topk(scores, 2, dim=-1)
        dense = (F.one_hot(top.indices, 8).float() * top.values.unsqueeze(-1)).sum(-2)
        return dense + F.one_hot(extra_ids, 8).float()


def compiled(model):
    k3be.ensure_registered()
    torch._dynamo.reset()
    return torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})


def test_one_hot_routing_compiles_and_equals_eager():
    torch.manual_seed(0)
    model = OneHotRouting()
    x, ids = torch.randn(3, 16), torch.tensor([0, 7, 3])
    with torch.no_grad():
        want, got = model(x, ids), compiled(model)(x, ids)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) == 0.0


def test_an_index_out_of_range_fails_as_in_eager():
    torch.manual_seed(0)
    model = OneHotRouting()
    x = torch.randn(3, 16)
    step = compiled(model)
    with torch.no_grad():
        step(x, torch.tensor([0, 1, 2]))
        with pytest.raises(RuntimeError):
            model(x, torch.tensor([0, 8, 2]))
        with pytest.raises(RuntimeError):
            step(x, torch.tensor([0, 8, 2]))
