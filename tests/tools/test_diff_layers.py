"""`k3compile diff` reads layers by structure (`k3compile.layers`), as the contract does: layers
under any container name, their templates from what they compute, and a layer whose structure
calls for a big fusion (kda_decode, mla_decode, moe_route, moe_experts) that it did not get is
never left with "near misses: none recorded", even where the engine tried nothing (stage fuse
off): the structural probe names a node and the condition. The toy layers are
`tests/stages/test_layers.py`'s; each compiled toy equals its eager run."""

from __future__ import annotations

import re

import pytest

from k3compile.tools import diff
from k3compile.tools.diff.layers import OUTSIDE, layer_index, split_layers, suffix
from tests.conftest import TOL, rel_err
from tests.stages.test_layers import (
    Block,
    CacheAttention,
    Recurrent,
    Routed,
    Stack,
    _compile,
    _toy_args,
)


@pytest.mark.parametrize("path, index, below", [
    ("transformer.h.3.attn.q_proj", 3, "attn.q_proj"), ("blocks.0", 0, "(layer)"),
    ("model.layers.2.block_sparse_moe.experts.5", 2, "block_sparse_moe.experts.5"),
    ("transformer.ln_f", OUTSIDE, "transformer.ln_f"), ("", OUTSIDE, "(top)")])
def test_paths(path, index, below):
    assert layer_index(path) == index and suffix(path) == below


@pytest.mark.slow
def test_toy_layers_report_their_templates_and_near_misses():
    model = Stack([Block(Recurrent()), Block(Recurrent(), Routed()),
                   Block(CacheAttention(), Routed())])
    got, want, graph, compiled = _compile(model, *_toy_args())
    assert rel_err(got, want) <= TOL["aten_cpu"]
    assert sorted(split_layers(graph)) == [OUTSIDE, 0, 1, 2]
    report = diff.analyze(compiled)
    (bucket,) = report.buckets
    assert {i: L.contract_template for i, L in bucket.layers.items()} == {
        0: "dense", 1: "kda_moe", 2: "last"}
    big = {0: {"kda_decode"}, 1: {"kda_decode", "moe_route", "moe_experts"},
           2: {"mla_decode", "moe_route", "moe_experts"}}
    nodes = {n.name for n in graph.nodes}
    for i, families in big.items():
        misses = [m for m in bucket.layers[i].near_misses if m.family in families]
        assert {m.family for m in misses} == families, (i, misses)
        for m in misses:  # tried at a node of this layer; the reason names nodes with their type
            assert m.node in nodes and layer_index(m.module) == i
            assert re.search(r"\w+ \([\w.]+ \(?\w+\[", m.reason), m.reason
    text = diff.format_text(report, color=False)
    assert "none recorded" not in text and "fusion contract: NOT met" in text
