"""Rule mla_absorbed: Gated MLA already absorbed but spelled otherwise
(tests/canonical/absorbed_mla_spellings.py: sliced parts, weight slices, scale before the cast,
a `where` mask on [B, T, 1, L], unsqueezed cache rows) becomes our model's absorbed form: compiled
with the rules (fuse off) it equals its eager self, and is our model's graph: the same ops and
bit-identical outputs and cache to our GatedMLA compiled the same way. Look-alikes (a sliding
window, the rope term scaled twice) and our own model are left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from k3compile.patterns import ORDER as PATTERNS

from ..conftest import TOL, rel_err
from ..fusions.attention_checks import CFG, Attention, attention, one_thread  # noqa: F401
from .absorbed_mla_spellings import LOOKALIKES, SPELLINGS, absorbed
from .test_mla_absorb import MLA_OPS, REWRITE_TOL, assert_becomes_ours, eager, ops, run

CASES = [(torch.float32, 2, 1), (torch.bfloat16, 1, 3)]  # (dtype, batch, tokens per request)


def foreign(spelling, dtype):
    return Attention(absorbed(attention("mla", dtype).attn, CFG, spelling))


@pytest.mark.parametrize("dtype,batch,tokens", CASES)
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_becomes_our_absorbed_graph(name, dtype, batch, tokens):
    assert_becomes_ours(foreign(SPELLINGS[name], dtype), "mla_absorbed", dtype, batch, tokens)


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalike_is_left_alone(name):
    dtype, batch, tokens = torch.float32, 2, 3
    module = foreign(LOOKALIKES[name], dtype)
    want, _ = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, _, graph, counts, _ = run(module, dtype, batch, tokens, disabled_stages=["fuse"])
    assert counts["mla_absorbed"] == 0
    assert "aten.index_put.default" in ops(graph)  # the site was there to be taken
    for g, w in zip(got, want):
        assert rel_err(g, w) <= REWRITE_TOL[dtype]


def test_our_absorbed_model_is_left_alone():
    dtype, batch, tokens = torch.float32, 2, 1
    _, _, _, counts, _ = run(attention("mla", dtype), dtype, batch, tokens,
                             disabled_stages=["fuse"])
    assert counts["mla_absorbed"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_spelling_gets_our_mla_ops_and_equals_eager(dtype):
    batch, tokens = 2, 3
    only_mla = {"disabled_patterns": [p for p in PATTERNS if not p.startswith("mla_")]}
    module = foreign(SPELLINGS["deepseek_inference"], dtype)
    want, want_cache = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, cache, _, _, report = run(module, dtype, batch, tokens, **only_mla)
    _, _, _, _, canonical = run(attention("mla", dtype), dtype, batch, tokens, **only_mla)
    fused = sorted(h.op for h in report.hits)
    assert fused == sorted(h.op for h in canonical.hits)
    assert {f"k3.{op}" for op in MLA_OPS} <= set(fused)
    tol = TOL["aten_cpu"] if dtype == torch.float32 else TOL["bfloat16"]
    for g, w in zip(got, want):
        assert rel_err(g, w) <= tol
    torch.testing.assert_close(cache["attn.kv_cache"], want_cache["attn.kv_cache"], rtol=0, atol=0)
