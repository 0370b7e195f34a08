"""Rule mla_upcast: bf16 non-absorbed MLA whose attention products read fp32 upcasts (spell8's
`q.float()`, `key.float()`, `v.float()` with an fp32 softmax, p·v and output gate; spell6's SDPA,
whose math path upcasts q, k, v) is read as the bf16 products rule mla_absorb takes. Each
spelling, compiled with the rules (fuse off), equals its eager self to bf16's tolerance and is
our model's absorbed bf16 graph, bit for bit; without the rule mla_absorb leaves it alone.
Look-alikes stay as they were, graph and values: upcast MLA that mla_absorb does not take (a
sliding window, a scale on part of q: the rule's trial is undone), fp32 sites (no upcasts), and
bmms of upcasts that are no MLA (attention over a K/V cache, a router's logits)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from k3compile.canonical import mla_upcast

from ..conftest import rel_err
from .mla_spellings import UPCAST_LOOKALIKES, UPCAST_SPELLINGS
from .rule_checks import assert_same, rewrite, targets
from .test_mla_absorb import REWRITE_TOL, assert_becomes_ours, eager, foreign, ops, run

BF16 = torch.bfloat16


@pytest.mark.parametrize("batch,tokens", [(2, 1), (1, 3)])
@pytest.mark.parametrize("name", sorted(UPCAST_SPELLINGS))
def test_upcast_spelling_becomes_our_absorbed_graph(name, batch, tokens):
    assert_becomes_ours(foreign(UPCAST_SPELLINGS[name], BF16), "mla_upcast", BF16, batch, tokens)


@pytest.mark.parametrize("name", sorted(UPCAST_SPELLINGS))
def test_without_the_rule_mla_absorb_leaves_it_alone(name):
    _, _, _, counts, _ = run(foreign(UPCAST_SPELLINGS[name], BF16), BF16, 2, 1,
                             disabled_stages=["fuse"], disabled_rules=["mla_upcast"])
    assert counts.get("mla_absorb", 0) == 0


def as_without_the_rule(module, dtype, batch=2, tokens=3):
    """Compiled with the rules (fuse off): the rule took nothing, the graph and values are those
    of the same compile without it, and eager's to the tolerance."""
    want, _ = eager(copy.deepcopy(module), dtype, batch, tokens)
    without = run(copy.deepcopy(module), dtype, batch, tokens, disabled_stages=["fuse"],
                  disabled_rules=["mla_upcast"])
    got, _, graph, counts, _ = run(module, dtype, batch, tokens, disabled_stages=["fuse"])
    assert counts.get("mla_upcast", 0) == 0
    assert ops(graph) == ops(without[2])
    assert_same(got, without[0])
    for g, w in zip(got, want):
        assert rel_err(g, w) <= REWRITE_TOL[dtype]
    return counts


@pytest.mark.parametrize("name", sorted(UPCAST_LOOKALIKES))
def test_upcast_lookalike_stays_as_it_was(name):
    counts = as_without_the_rule(foreign(UPCAST_LOOKALIKES[name], BF16), BF16)
    assert counts.get("mla_absorb", 0) == 0


@pytest.mark.parametrize("name", ["fp32_attention", "sdpa_bool_mask"])
def test_fp32_site_is_untouched(name):
    """fp32: no upcasts, nothing for the rule; mla_absorb takes the site as before."""
    counts = as_without_the_rule(foreign(UPCAST_SPELLINGS[name], torch.float32), torch.float32)
    assert counts["mla_absorb"] == 1


def _kv_attention(cache, x, w_qkv, w_router, slots, positions):
    """Attention over a K|V cache (no latents, no kv_b) with fp32 products of upcasts, and a
    router's fp32 logits of upcasts: bmms of upcasts that are no MLA."""
    B, T, D = x.shape
    H, Dh = 2, D // 4
    q, kv = (x @ w_qkv.t()).split([D // 2, D], dim=-1)
    pos = positions.view(B, 1) + torch.arange(T)
    cache = cache.index_put((slots.view(B, 1), pos), kv)
    keys, values = cache[slots].split([D // 2, D // 2], dim=-1)  # [B, L, H·Dh]
    L = keys.shape[1]
    q, k, v = q.view(B, T, H, Dh), keys.view(B, L, H, Dh), values.view(B, L, H, Dh)
    scores = torch.einsum("bthd,blhd->bhtl", q.float(), k.float()) * Dh ** -0.5
    visible = torch.arange(L).view(1, 1, L) <= pos.view(B, T, 1)
    p = torch.softmax(scores.masked_fill(~visible.unsqueeze(1), float("-inf")), dim=-1)
    o = torch.einsum("bhtl,blhd->bthd", p, v.float()).reshape(B, T, D // 2)
    logits = x.float() @ w_router.float().t()
    return cache, o.to(x.dtype), logits


def test_non_mla_bmms_of_upcasts_stay_as_they_are(caplog):
    caplog.set_level(logging.DEBUG, logger="k3compile")
    gen = torch.Generator().manual_seed(0)
    B, T, D, L = 2, 2, 32, 8
    args = (torch.zeros(4, L, D, dtype=BF16), torch.randn(B, T, D, generator=gen).to(BF16),
            torch.randn(3 * D // 2, D, generator=gen).to(BF16),
            torch.randn(6, D, generator=gen).to(BF16), torch.tensor([3, 1]), torch.tensor([2, 5]))
    before, after, n = rewrite(mla_upcast.RULE, _kv_attention, *args, joint=True)
    assert n == 0 and any("mla_upcast" in r.getMessage() and "left alone" in r.getMessage()
                          for r in caplog.records)  # the rule tried the site and undid it
    assert targets(after) == targets(before)
    assert "aten.bmm.default" in targets(before) and "prims.convert_element_type.default" in \
        targets(before)
    assert_same(after(*args), before(*args))
