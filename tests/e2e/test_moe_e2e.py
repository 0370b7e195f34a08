"""The MoE half end to end on the tiny model under backend="k3" (CPU, executor "aten"): decode
(T = 1) and verify rows (T = 8) equal eager in logits and every state, with the MoE ops in place
(per MoE layer: moe_front, moe_route, moe_experts, norm_linear, situ_gate_up, and the shared
branch on the side stream; the dense MLP: situ_gate_up) and the MoE part of the contract met."""

from __future__ import annotations

import collections

import pytest
import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from k3compile.stages.contract import PLANS

MOE_OPS = ("moe_front", "moe_route", "moe_experts", "norm_linear", "situ_gate_up")
LAYERS = 3  # dense layer 0, KDA + MoE layers 1 and 2 (the last): each MoE template once


def _states(model):
    return {n: b.clone() for n, b in model.named_buffers() if b.dim() >= 3 and b.dtype != torch.uint8}


# verify rows `slow`: the default run has them in diffsuite's bf16 T=8 cell
@pytest.fixture(scope="module", params=[1, pytest.param(8, marks=pytest.mark.slow)],
                ids=["decode", "verify8"])
def run(request):
    T = request.param
    torch._dynamo.reset()  # no compiled code shared with another module's model
    cfg = get_config("tiny").with_layers(LAYERS)
    eager = build_model(cfg, dtype=torch.bfloat16, max_batch=4, max_seq_len=64)
    model = build_model(cfg, dtype=torch.bfloat16, max_batch=4, max_seq_len=64)
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    outs = []
    for i in range(3):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, cfg.vocab_size, (3, T) if T > 1 else (3,), generator=gen)
        pos, slots = torch.tensor([0, 9, 17]) + T * i, torch.tensor([2, 0, 1])
        outs.append((step(ids, pos, slots), eager(ids, pos, slots)))
    return outs, _states(model), _states(eager), k3be.last_compiled()


def test_logits_and_states_equal_eager(run):
    outs, got_states, want_states, _ = run
    for got, want in outs:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, want in want_states.items():
        torch.testing.assert_close(got_states[name], want, rtol=0, atol=0, msg=name)


def test_moe_ops_per_layer_and_contract(run):
    compiled = run[3]
    (report,) = compiled.contracts.values()
    # the tiny model cut to 3 layers ends on a KDA layer: it keeps its template (K3's own last
    # layer, MLA, is `last`), and the contract holds
    assert {lr.layer: lr.template for lr in report.layers}[LAYERS - 1] == "kda_moe"
    assert report.met, [(lr.layer, lr.template, lr.actual) for lr in report.layers]
    for layer in report.layers:
        want = {op: n for op, n in PLANS[layer.template].items() if op in MOE_OPS}
        assert {op: layer.actual[op] for op in want} == want, (layer.layer, layer.actual)
        if layer.template not in ("dense", "final"):
            assert layer.actual["stream_fork"] == layer.actual["stream_join"] == 1
    graph = next(iter(compiled.observer.graphs.values()))
    left = collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")
    for unfused in ("aten.topk.default", "aten.exp2.default", "aten.tanh.default"):
        assert left[unfused] == 0, f"{unfused} left in the graph"  # routing, dequant, SiTU fused
