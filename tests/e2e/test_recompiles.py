"""No recompile in steady state (issue 20 item 6): with the batch marked by `mark_batch`, one Dynamo
graph per verify-row count T serves every batch size in any order, whatever the first one was,
and the backend compiles each (bucket, T) once.

Counted with torch's own counter (`unique_graphs`: every Dynamo compile of a new graph) and the
backend's compiled steps; every few steps the logits are compared with an eager twin.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch
from torch._dynamo.utils import counters

from k3compile import backend
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err

TINY = dataclasses.replace(get_config("tiny"), num_hidden_layers=2)  # KDA (its conv) + MLA


def _run(cfg, buckets, batches, rows, mark_every_call=False, check_every=10):
    torch._dynamo.reset()
    counters.clear()
    earlier = len(backend._compiled)
    max_batch, max_len = max(batches), 2 * len(batches) + max(rows) + 1
    model, eager = (build_model(cfg, dtype=torch.float32, max_batch=max_batch, max_seq_len=max_len)
                    for _ in range(2))
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "buckets": buckets})
    for i, (batch, t) in enumerate(zip(batches, rows)):
        ids = torch.randint(0, cfg.vocab_size, (batch,) if t == 1 else (batch, t))
        args = (ids, torch.full((batch,), i), torch.randperm(max_batch)[:batch])
        if i == 0 or mark_every_call:
            backend.mark_batch(*args)
        got = step(*args)
        want = eager(*args)
        if i % check_every == 0 or i == len(batches) - 1:
            assert rel_err(got, want) <= TOL["aten_cpu"], (i, batch, t)
    return counters["stats"]["unique_graphs"], sum(len(c.buckets) for c in backend._compiled[earlier:])


@pytest.mark.parametrize("first", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_one_graph_for_every_batch_size(first):
    """Lean: batch 1 first (Dynamo specialises a backed 1), or 3 (padded to bucket 4)."""
    cfg = dataclasses.replace(TINY, num_hidden_layers=1)
    rng = random.Random(first)
    batches = [first] + [rng.randint(1, 4) for _ in range(19)]
    graphs, steps = _run(cfg, (2, 4), batches, [1] * len(batches))
    assert graphs == 1, "Dynamo recompiled"
    assert steps == len({2 if b <= 2 else 4 for b in batches}), "a bucket compiled twice"


@pytest.mark.slow
@pytest.mark.parametrize("first", [1, 17])
def test_200_steps_any_batch_and_rows_compile_each_bucket_once(first):
    """Buckets across conv's `16 <= B` guard (CPU fp32), T in {1, 8}: one graph per T."""
    rng = random.Random(first)
    batches = [first] + [rng.randint(1, 32) for _ in range(199)]
    rows = [1] + [rng.choice((1, 8)) for _ in range(199)]
    buckets = (1, 4, 16, 32)
    graphs, steps = _run(TINY, buckets, batches, rows, mark_every_call=True, check_every=25)
    assert graphs == 2, "Dynamo recompiled (one graph per T expected)"
    bucket_of = {b: next(k for k in buckets if b <= k) for b in range(1, 33)}
    assert steps == len({(bucket_of[b], t) for b, t in zip(batches, rows)}), "a bucket recompiled"


def test_mark_batch_on_a_torch_without_a_lower_bound_marks_and_warns(monkeypatch, caplog):
    """torch 2.11's `mark_unbacked` has no `min=`: the batch is still marked (unbacked, so one
    graph where the code traces), and the user is told once why a step may split per frame."""
    real = torch._dynamo.decorators.mark_unbacked

    def no_min(t, index, **kw):
        if "min" in kw:
            raise TypeError("mark_unbacked() got an unexpected keyword argument 'min'")
        return real(t, index, **kw)

    monkeypatch.setattr(torch._dynamo.decorators, "mark_unbacked", no_min)
    backend._warn_no_batch_min.cache_clear()
    ids, slots = torch.zeros(3, dtype=torch.long), torch.arange(3)
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        backend.mark_batch(ids, slots)
        backend.mark_batch(ids, slots)
    assert 0 in ids._dynamo_unbacked_indices and 0 in slots._dynamo_unbacked_indices
    warned = [r for r in caplog.records if "mark_unbacked(min=)" in r.getMessage()]
    assert len(warned) == 1
    backend._warn_no_batch_min.cache_clear()
