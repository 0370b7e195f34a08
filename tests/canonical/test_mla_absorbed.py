"""Rule mla_absorbed: Gated MLA already absorbed but spelled otherwise
(tests/canonical/absorbed_mla_spellings.py: sliced parts, weight slices, scale before the cast,
a `where` mask on [B, T, 1, L], unsqueezed cache rows; SDPA over one latent head, by enable_gqa
or broadcast, as spell11 writes it; the scores one baddbmm of an additive 0 / -inf bias over
[B, T·H, C + R] queries, the cache written by `Tensor.put`, as spell12 writes it: rules
baddbmm_mask, put_rows) becomes our model's absorbed form: compiled
with the rules (fuse off) it equals its eager self, and is our model's graph: the same ops and
bit-identical outputs and cache to our GatedMLA compiled the same way. Look-alikes (a sliding
window, the rope term scaled twice; SDPA with V the cache's last C columns, a mask one key ahead or
a sliding window; the baddbmm with a finite mask value or a mask one key ahead) and our own model
are left alone. In bf16 with the products
of fp32 upcasts (`q_lat.float()`, `latents.float()`, p·c in fp32: rule mla_upcast, which keeps
the site because mla_absorbed then takes it) the same; its look-alikes (also a mask one key
ahead, p·c of the cache read at other slots) stay exactly as without mla_upcast."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from k3compile.patterns import ORDER as PATTERNS

from ..conftest import TOL, rel_err
from ..fusions.attention_checks import CFG, Attention, attention, one_thread  # noqa: F401
from .absorbed_mla_spellings import (
    KVB_3D,
    LOOKALIKES,
    SPELLINGS,
    UPCAST_LOOKALIKES,
    UPCAST_SPELLINGS,
    absorbed,
)
from .test_mla_absorb import MLA_OPS, REWRITE_TOL, assert_becomes_ours, eager, ops, ours, run
from .test_mla_upcast import as_without_the_rule

BF16 = torch.bfloat16

# (dtype, batch, tokens per request). bf16 at batch 2 since session 38: rule mla_upcast replayed
# the view merging batch and heads on sdpa_broadcast's expanded bf16 keys (spell14's
# `kv.expand(B, H, L, C + R)`), which only the fp32 upcast's copy made viewable at batch > 1: it
# raised, and its rewrites were undone
CASES = [(torch.float32, 2, 1), (torch.bfloat16, 1, 3), (torch.bfloat16, 2, 1)]


def foreign(spelling, dtype):
    return Attention(absorbed(attention("mla", dtype).attn, CFG, spelling))


@pytest.mark.parametrize("dtype,batch,tokens", CASES)
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_becomes_our_absorbed_graph(name, dtype, batch, tokens):
    assert_becomes_ours(foreign(SPELLINGS[name], dtype), "mla_absorbed", dtype, batch, tokens)


@pytest.mark.parametrize("dtype,batch,tokens", CASES)
def test_kvb_kept_3d_becomes_our_absorbed_graph(dtype, batch, tokens):
    """kv_b a 3-D Parameter [H, N + V, C] (spell13's): the rule takes the site, its head count
    the weight's first dim; the result equals eager and our graph's outputs and cache bit for
    bit, its ops ours but for the 2-D weight's view to [H, N + V, C]."""
    module = foreign(KVB_3D, dtype)
    want, want_cache = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, cache, graph, counts, _ = run(module, dtype, batch, tokens, disabled_stages=["fuse"])
    assert counts["mla_absorbed"] == 1
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert rel_err(g, w) <= REWRITE_TOL[dtype]
    torch.testing.assert_close(cache["attn.kv_cache"], want_cache["attn.kv_cache"], rtol=0, atol=0)
    canonical_outs, canonical_cache, canonical_ops = ours(dtype, batch, tokens)
    assert ops(graph) + collections.Counter({"aten.view.default": 1}) == canonical_ops
    for g, c in zip(got, canonical_outs):
        torch.testing.assert_close(g, c, rtol=0, atol=0)
    torch.testing.assert_close(cache["attn.kv_cache"], canonical_cache, rtol=0, atol=0)


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


@pytest.mark.parametrize("batch,tokens", [(2, 1), (1, 3)])
@pytest.mark.parametrize("name", sorted(UPCAST_SPELLINGS))
def test_upcast_spelling_becomes_our_absorbed_graph(name, batch, tokens):
    assert_becomes_ours(foreign(UPCAST_SPELLINGS[name], BF16), "mla_upcast", BF16, batch, tokens)


@pytest.mark.parametrize("name", sorted(UPCAST_SPELLINGS))
def test_upcast_spelling_without_mla_upcast_is_lost(name):
    _, _, _, counts, _ = run(foreign(UPCAST_SPELLINGS[name], BF16), BF16, 2, 1,
                             disabled_stages=["fuse"], disabled_rules=["mla_upcast"])
    assert counts.get("mla_absorbed", 0) == 0 and counts.get("mla_absorb", 0) == 0


@pytest.mark.parametrize("name", sorted(UPCAST_LOOKALIKES))
def test_upcast_lookalike_stays_as_it_was(name):
    counts = as_without_the_rule(foreign(UPCAST_LOOKALIKES[name], BF16), BF16)
    assert counts.get("mla_absorbed", 0) == 0


def test_upcast_spelling_in_fp32_is_taken_as_before():
    """fp32: the .float() calls are no ops; mla_absorbed takes the site, mla_upcast has none."""
    counts = as_without_the_rule(foreign(UPCAST_SPELLINGS["upcast_products"], torch.float32),
                                 torch.float32)
    assert counts["mla_absorbed"] == 1


def test_our_absorbed_model_is_left_alone():
    dtype, batch, tokens = torch.float32, 2, 1
    _, _, _, counts, _ = run(attention("mla", dtype), dtype, batch, tokens,
                             disabled_stages=["fuse"])
    assert counts["mla_absorbed"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype,name", [(torch.float32, "deepseek_inference"),
                                        (BF16, "deepseek_inference"), (BF16, "upcast_products"),
                                        (torch.float32, "sdpa_gqa"), (BF16, "sdpa_gqa"),
                                        (torch.float32, "baddbmm_bias_put"),
                                        (BF16, "baddbmm_bias_put"),
                                        (torch.float32, "kvb_3d"), (BF16, "kvb_3d")])
def test_compiled_spelling_gets_our_mla_ops_and_equals_eager(dtype, name):
    batch, tokens = 2, 3
    only_mla = {"disabled_patterns": [p for p in PATTERNS if not p.startswith("mla_")]}
    module = foreign({**SPELLINGS, **UPCAST_SPELLINGS, "kvb_3d": KVB_3D}[name], dtype)
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
