"""An empty batch (issue 20 item 5): the compiled step returns what eager returns and touches no
state, whether Dynamo first sees the empty batch (a static graph of batch 0: nothing is compiled
for it) or a bucketed graph later gets one (Dynamo's graph runs it, as eager would)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3compile.models import build_model, get_config

CFG = dataclasses.replace(get_config("tiny"), num_hidden_layers=2)


def _pair():
    return [build_model(CFG, dtype=torch.float32, max_batch=4, max_seq_len=32) for _ in range(2)]


def _states(model):
    return {n: b.clone() for n, b in model.named_buffers()}


def _empty():
    return tuple(torch.zeros(0, dtype=torch.long) for _ in range(3))


@pytest.mark.parametrize("first", ["empty", "batch 2"])
def test_empty_batch_returns_eagers_result_and_touches_no_state(first):
    torch._dynamo.reset()
    model, eager = _pair()
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "buckets": (2, 4)})
    if first == "batch 2":
        args = (torch.tensor([3, 5]), torch.tensor([0, 0]), torch.tensor([0, 1]))
        for t in args:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch.testing.assert_close(step(*args), eager(*args))
    before = _states(model)
    got, want = step(*_empty()), eager(*_empty())
    assert got.shape == want.shape and got.dtype == want.dtype and got.numel() == 0
    after = _states(model)
    assert all(torch.equal(after[n], b) for n, b in before.items())
