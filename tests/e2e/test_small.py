"""The `small` K3 config (13 layers: dense layer 0, KDA and MLA layers with MoE, the last layer
MLA) under backend="k3" on CPU, as test_backend does for `tiny`: decode steps of one token and
of 8 verify tokens equal to eager (logits and every state), the fusion contract met, and at most
13 fused ops in every layer."""

from __future__ import annotations

import pytest
import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err

pytestmark = pytest.mark.slow  # the 13-layer config compiles longest; test_backend checks tiny


def _states(model):
    return {n: b.clone() for n, b in model.named_buffers() if b.dim() >= 3 and b.dtype != torch.uint8}


@pytest.fixture(scope="module")
def run():
    torch._dynamo.reset()
    cfg = get_config("small")
    kw = {"dtype": torch.float32, "max_batch": 4, "max_seq_len": 32}
    eager, model = build_model(cfg, **kw), build_model(cfg, **kw)
    first = len(k3be._compiled)
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "buckets": (2,), "strict": True})
    errors = []
    for i, T in enumerate((1, 8, 1)):  # one token, a verify step of 8, one token again
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, cfg.vocab_size, (2,) if T == 1 else (2, T), generator=gen)
        pos, slots = torch.full((2,), 8 * i), torch.arange(2)
        for t in (ids, pos, slots):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        errors.append(rel_err(step(ids, pos, slots), eager(ids, pos, slots)))
    return eager, model, errors, [c for c in k3be._compiled[first:] if c.guards]


def test_small_decode_equals_eager(run):
    eager, model, errors, _ = run
    assert max(errors) <= TOL["aten_cpu"], errors
    want, got = _states(eager), _states(model)
    for name in want:
        assert rel_err(got[name][:2], want[name][:2]) <= TOL["aten_cpu"], name


def test_small_contract_met_with_at_most_13_fused_ops_a_layer(run):
    *_, compiled = run
    assert len(compiled) == 2  # one graph for T = 1, one for T = 8
    for c in compiled:
        for report in c.contracts.values():
            assert report.met, c.summary()
            assert {lr.template for lr in report.layers} == {"dense", "kda_moe", "mla_moe", "last",
                                                            "final"}
            assert len([lr for lr in report.layers if lr.template != "final"]) == 13
            assert max(lr.fused_ops for lr in report.layers) <= 13, c.summary()
