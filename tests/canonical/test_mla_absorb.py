"""Rule mla_absorb: non-absorbed MLA (tests/canonical/mla_spellings.py) becomes our model's absorbed
form. Each spelling, compiled with the rule (fuse off), equals its eager self, and is our model's
graph: the same ops and bit-identical outputs and cache to our GatedMLA compiled the same way.
Look-alikes (a sliding window, a scale on part of q, multi-head attention over a K/V cache, our
own absorbed model) are left alone."""

from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch
from k3compile.patterns import ORDER as PATTERNS

import k3compile.backend as k3be

from ..conftest import TOL, rel_err
from ..fusions.attention_checks import CFG, MAX_LEN, SLOTS, Attention, attention, one_thread  # noqa: F401
from .mla_spellings import LOOKALIKES, SPELLINGS, CachedMHA, non_absorbed

CASES = [(torch.float32, 2, 1), (torch.bfloat16, 1, 3)]  # (dtype, batch, tokens per request)
# the algebraic rewrite against the non-absorbed eager code (measured: fp32 <= 6e-7)
REWRITE_TOL = {torch.float32: 1e-6, torch.bfloat16: TOL["bfloat16"]}
MLA_OPS = ("mla_q_absorb", "mla_decode", "mla_uv_gate")


def run(module, dtype, batch, tokens, steps=2, **options):
    """`steps` decode steps of module compiled with backend="k3" (aten executor): outputs, the
    module's cache, the observer's graph, the canonicalize counts and the fused ops."""
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="k3", fullgraph=True,
                             options={"executor": "aten", "buckets": (batch,), **options})
    outs = [compiled(*args) for args in inputs(dtype, batch, tokens, steps)]
    obs = k3be.last_compiled().observer
    graph, notes, report = (next(iter(d.values())) for d in (obs.graphs, obs.notes, obs.reports))
    return outs, cache_of(module), graph, notes.get("canonicalize", {}), report


def inputs(dtype, batch, tokens, steps):
    gen = torch.Generator().manual_seed(1)
    slots = torch.arange(batch) * 2  # not 0..B-1: the rewrite must keep following `slots`
    for step in range(steps):
        x = torch.randn(batch, tokens, CFG.hidden_size, generator=gen).to(dtype)
        yield x, torch.full((batch,), step * tokens) + torch.arange(batch), slots


def eager(module, dtype, batch, tokens, steps=2):
    return [module(*args) for args in inputs(dtype, batch, tokens, steps)], cache_of(module)


def cache_of(module):
    return {n: b.clone() for n, b in module.named_buffers()}


def ops(graph) -> collections.Counter:
    return collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")


@functools.cache
def ours(dtype, batch, tokens):
    """Our GatedMLA compiled without fuse: the canonical graph and what it computes."""
    outs, cache, graph, _, _ = run(attention("mla", dtype), dtype, batch, tokens,
                                   disabled_stages=["fuse"])
    return outs, cache["attn.kv_cache"], ops(graph)


def assert_becomes_ours(module, rule, dtype, batch, tokens):
    """Compiled with the rules (fuse off), `module` fires `rule` once, equals its eager self
    (outputs to the rewrite's tolerance, cache exactly) and is our model's graph: the same ops,
    bit-identical outputs and cache."""
    want, want_cache = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, cache, graph, counts, _ = run(module, dtype, batch, tokens, disabled_stages=["fuse"])
    assert counts[rule] == 1
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert rel_err(g, w) <= REWRITE_TOL[dtype]
    torch.testing.assert_close(cache["attn.kv_cache"], want_cache["attn.kv_cache"], rtol=0, atol=0)
    canonical_outs, canonical_cache, canonical_ops = ours(dtype, batch, tokens)
    assert ops(graph) == canonical_ops
    for g, c in zip(got, canonical_outs):
        torch.testing.assert_close(g, c, rtol=0, atol=0)
    torch.testing.assert_close(cache["attn.kv_cache"], canonical_cache, rtol=0, atol=0)


def foreign(spelling, dtype):
    return Attention(non_absorbed(attention("mla", dtype).attn, CFG, spelling))


@pytest.mark.parametrize("dtype,batch,tokens", CASES)
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_becomes_our_absorbed_graph(name, dtype, batch, tokens):
    # (other rules may take other sites: einsum projections)
    assert_becomes_ours(foreign(SPELLINGS[name], dtype), "mla_absorb", dtype, batch, tokens)


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalike_is_left_alone(name):
    dtype, batch, tokens = torch.float32, 2, 3
    module = foreign(LOOKALIKES[name], dtype)
    want, _ = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, _, graph, counts, _ = run(module, dtype, batch, tokens, disabled_stages=["fuse"])
    assert counts["mla_absorb"] == 0
    assert "aten.index_put.default" in ops(graph)  # the site was there to be taken
    for g, w in zip(got, want):
        assert rel_err(g, w) <= REWRITE_TOL[dtype]


def test_multi_head_attention_over_a_kv_cache_is_left_alone():
    dtype, batch, tokens = torch.float32, 2, 3
    gen = torch.Generator().manual_seed(0)
    module = CachedMHA(CFG.hidden_size, 4, 16, SLOTS, MAX_LEN)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    want, _ = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, _, graph, counts, _ = run(module, dtype, batch, tokens, disabled_stages=["fuse"])
    assert counts["mla_absorb"] == 0
    assert ops(graph)["aten.index.Tensor"] == 2  # two 3-D cache reads the rule looked at
    for g, w in zip(got, want):
        assert rel_err(g, w) <= REWRITE_TOL[dtype]


def test_our_absorbed_model_is_left_alone():
    dtype, batch, tokens = torch.float32, 2, 1
    _, _, _, counts, _ = run(attention("mla", dtype), dtype, batch, tokens,
                             disabled_stages=["fuse"])
    assert counts["mla_absorb"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf", "two_terms_weight_views"])
def test_compiled_spelling_gets_our_mla_ops_and_equals_eager(name):
    dtype, batch, tokens = torch.float32, 2, 3
    only_mla = {"disabled_patterns": [p for p in PATTERNS if not p.startswith("mla_")]}
    module = foreign(SPELLINGS[name], dtype)
    want, want_cache = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, cache, _, _, report = run(module, dtype, batch, tokens, **only_mla)
    _, _, _, _, canonical = run(attention("mla", dtype), dtype, batch, tokens, **only_mla)
    fused = sorted(h.op for h in report.hits)
    assert fused == sorted(h.op for h in canonical.hits)
    assert {f"k3.{op}" for op in MLA_OPS} <= set(fused)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= TOL["aten_cpu"]
    torch.testing.assert_close(cache["attn.kv_cache"], want_cache["attn.kv_cache"], rtol=0, atol=0)
