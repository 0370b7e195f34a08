"""The tiny K3 decode under backend="k3" end to end: equal to eager (logits and every state),
no graph breaks, the fusion contract met, batch buckets with safe padding, a fallback above the
largest bucket, and no recompiles at steady state."""

from __future__ import annotations

import logging
import random
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err

BUCKETS = (1, 2, 4)


def _states(model):
    return {n: b.clone() for n, b in model.named_buffers() if b.dim() >= 3 and b.dtype != torch.uint8}


def _mark(*tensors):
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


@pytest.fixture(scope="module")
def pair():
    torch._dynamo.reset()
    counters.clear()
    cfg = get_config("tiny")
    eager = build_model(cfg, dtype=torch.float32, max_batch=8, max_seq_len=64)
    model = build_model(cfg, dtype=torch.float32, max_batch=8, max_seq_len=64)
    compiled = torch.compile(model, backend="k3", fullgraph=True,
                             options={"executor": "aten", "buckets": BUCKETS, "strict": True})
    _first[0] = len(k3be._compiled)  # this module's compiled graphs start here
    return cfg, eager, model, compiled


_first = [0]


def _ours():
    return k3be._compiled[_first[0]:]


def _step(pair, batch, step, T=1, slots=None, check=True):
    cfg, eager, model, compiled = pair
    gen = torch.Generator().manual_seed(1000 + step)
    shape = (batch,) if T == 1 else (batch, T)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=gen)
    pos = torch.full((batch,), (step % 7) * 8)  # within max_seq_len (64) with T <= 8
    slots = torch.arange(batch) if slots is None else slots
    _mark(ids, pos, slots)
    got = compiled(ids, pos, slots)
    want = eager(ids, pos, slots)
    if check:
        assert rel_err(got, want) <= TOL["aten_cpu"], f"batch {batch} step {step}"
    return got


def test_decode_equals_eager_with_states(pair):
    for step, (batch, T) in enumerate([(4, 1), (3, 1), (4, 8), (2, 1), (4, 1)]):
        _step(pair, batch, step, T)
    _, eager, model, _ = pair
    want, got = _states(eager), _states(model)
    for name in want:
        assert rel_err(got[name][:8], want[name][:8]) <= TOL["aten_cpu"], name  # 8: scratch
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_fusion_contract_met(pair):
    compiled = next(c for c in _ours() if c.guards)
    assert compiled.contracts, "no contract report"
    for batch, report in compiled.contracts.items():
        assert report.met, compiled.summary()
        templates = {lr.template for lr in report.layers}
        assert templates == {"dense", "kda_moe", "mla_moe", "last", "final"}
        # the bar: at most 13 fused ops in every layer (the model's final mix + norm,
        # which belongs to no layer, is the `final` row's one op)
        assert all(lr.fused_ops <= 13 for lr in report.layers), compiled.summary()
        assert [lr.fused_ops for lr in report.layers if lr.template == "final"] == [1]


def test_padding_never_touches_other_slots(pair):
    _, eager, model, compiled = pair
    before = _states(model)
    _step(pair, 3, 40, slots=torch.tensor([0, 1, 2]))  # runs in bucket 4, one padding row
    after = _states(model)
    for name in before:
        assert torch.equal(after[name][3:8], before[name][3:8]), f"{name}: padding wrote a real slot"


def test_guards_are_sympy_relations(pair):
    compiled = next(c for c in _ours() if c.guards)
    assert list(compiled.guards) == list(BUCKETS)
    assert compiled.bucket_for(3) == 4 and compiled.bucket_for(2) == 2
    assert compiled.bucket_for(5) is None
    assert "<=" in str(compiled.guards[4])


def test_above_largest_bucket_falls_back(pair, caplog):
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        _step(pair, 6, 50)
    assert any("above the largest bucket" in r.message for r in caplog.records)


@pytest.mark.parametrize("steps", [8, pytest.param(100, marks=pytest.mark.slow)])
def test_no_recompile_at_steady_state(pair, steps):
    for batch in BUCKETS:  # warm every bucket (batch 1 is its own graph: Dynamo specialises 1)
        _step(pair, batch, 60, check=False)
    graphs = counters["stats"]["unique_graphs"]
    buckets = sum(len(c.buckets) for c in _ours())
    rng = random.Random(0)
    for step in range(steps):
        _step(pair, rng.randint(1, 4), 61 + step % 3, check=step % 25 == 0)
    assert counters["stats"]["unique_graphs"] == graphs, "Dynamo recompiled"
    assert sum(len(c.buckets) for c in _ours()) == buckets, "a bucket recompiled"


def test_backend_registered_by_entry_point():
    code = "import torch; import sys; sys.exit(0 if 'k3' in torch._dynamo.list_backends() else 1)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


PUTS = {"Tensor.put": lambda buf, i, v: buf.put(i, v),
        "Tensor.put_": lambda buf, i, v: buf.clone().put_(i, v),
        "torch.put": lambda buf, i, v: torch.put(buf, i, v)}


@pytest.mark.parametrize("spelling", PUTS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int64])
def test_put_index_dtype_as_eager(spelling, dtype):
    """`put` takes int64 indices only in eager; its decomposition takes any integer. Compiled,
    an int32 / int16 index raises eager's error (not a silent run), and int64 equals eager."""
    fn, buf, v = PUTS[spelling], torch.zeros(10), torch.arange(2.0) + 1
    index = torch.tensor([7, 2], dtype=dtype)
    torch._dynamo.reset()
    step = torch.compile(fn, backend="k3")
    if dtype != torch.int64:
        with pytest.raises(RuntimeError, match="put_\\(\\)") as eager:
            fn(buf, index, v)
        with pytest.raises(Exception) as compiled:
            step(buf, index, v)
        assert str(eager.value) in str(compiled.value)
    else:
        assert torch.equal(step(buf, index, v), fn(buf, index, v))
