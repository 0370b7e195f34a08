"""Rule sdpa_math: non-absorbed MLA through `F.scaled_dot_product_attention` (spell6; a boolean
mask or an additive 0 / -inf one) has SDPA's split scale and fully-masked-row guard rewritten to
the explicit attention, which rule mla_absorb then takes: the compiled graph equals its eager self
and is our model's absorbed graph (fp32). A scale of SDPA's own is carried, not assumed.
Look-alikes are left to eager's values and not taken as MLA: a top-left causal mask over T > 1
(prefill's, not decode's), a sliding window, dropout, a mask read from an input (no written
position proves a visible column). bf16 (the math path upcasts q, k, v): rule mla_upcast's
tests (tests/canonical/test_mla_upcast.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ..conftest import rel_err
from .compiled import assert_same_values, canonicalize
from .mla_spellings import SDPA_LOOKALIKES, SDPA_SPELLINGS, Spelling
from .test_mla_absorb import REWRITE_TOL, assert_becomes_ours, eager, foreign, run

aten = torch.ops.aten


def _guards(graph) -> int:
    return sum(n.target is aten.any.dim for n in graph.nodes)


@pytest.mark.parametrize("batch,tokens", [(2, 1), (1, 3)])
@pytest.mark.parametrize("name", sorted(SDPA_SPELLINGS))
def test_sdpa_mla_becomes_our_absorbed_graph(name, batch, tokens):
    module = foreign(SDPA_SPELLINGS[name], torch.float32)
    assert_becomes_ours(module, "mla_absorb", torch.float32, batch, tokens)
    _, _, graph, counts, _ = run(foreign(SDPA_SPELLINGS[name], torch.float32), torch.float32, batch,
                                 tokens, disabled_stages=["fuse"])
    assert counts["sdpa_math"] == 1 and _guards(graph) == 0
    _, _, _, counts, _ = run(foreign(SDPA_SPELLINGS[name], torch.float32), torch.float32, batch,
                             tokens, disabled_stages=["fuse"], disabled_rules=["sdpa_math"])
    assert counts["mla_absorb"] == 0  # the rule is what lets mla_absorb read SDPA


def test_sdpa_scale_of_its_own_is_carried():
    dtype, batch, tokens = torch.float32, 2, 3
    module = foreign(Spelling(sdpa="bool", sdpa_scale=0.3), dtype)
    want, want_cache = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, cache, _, counts, _ = run(module, dtype, batch, tokens, disabled_stages=["fuse"])
    assert counts["sdpa_math"] == 1 and counts["mla_absorb"] == 1
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert rel_err(g, w) <= REWRITE_TOL[dtype]
    torch.testing.assert_close(cache["attn.kv_cache"], want_cache["attn.kv_cache"], rtol=0, atol=0)


@pytest.mark.parametrize("name,dtype", [("sdpa_top_left_causal", torch.float32),
                                        ("sdpa_sliding_window", torch.float32),
                                        ("sdpa_dropout", torch.float32)])
def test_lookalike_is_not_taken_as_mla(name, dtype):
    spelling = {**SDPA_LOOKALIKES, **SDPA_SPELLINGS}[name]
    batch, tokens = 2, 3
    module = foreign(spelling, dtype)
    want, _ = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, _, graph, counts, _ = run(module, dtype, batch, tokens, disabled_stages=["fuse"])
    assert counts.get("mla_absorb", 0) == 0
    if name in ("sdpa_top_left_causal", "sdpa_sliding_window"):
        assert counts.get("sdpa_math", 0) == 0 and _guards(graph) == 1  # no proof: guard kept
    if name != "sdpa_dropout":  # (dropout draws its own mask: no values to compare)
        for g, w in zip(got, want):
            assert rel_err(g, w) <= REWRITE_TOL[dtype]


# v's head dim differs from q's and k's (as MLA's does) in every SDPA below: with equal dims SDPA
# traces on CPU to the fused `_scaled_dot_product_flash_attention_for_cpu`, not its math path
def _attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_mask_from_an_input_keeps_the_guard():
    """A fully masked row (row 1) is 0 under SDPA: the guard stays, the values are eager's."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, d, generator=gen) for n, d in ((3, 8), (5, 8), (5, 4)))
    mask = torch.rand(2, 1, 3, 5, generator=gen) > 0.3
    mask[:, :, 1] = False
    c = canonicalize(_attend, {"q": q, "k": k, "v": v, "mask": mask})
    assert c.counts.get("sdpa_math", 0) == 0 and _guards(c.after.graph) == 1
    assert_same_values(c, rel=0)
    torch.testing.assert_close(c.output, _attend(q, k, v, mask), rtol=1e-6, atol=1e-6)
    assert c.output[:, :, 1].abs().max() == 0


class CachedSDPA(torch.nn.Module):
    """Multi-head attention over a K/V cache through SDPA, decode's mask (no MLA): the rule's
    own rewrite, with no later rule taking the site."""

    def __init__(self, slots=4, length=16, heads=2, dim=8, future=False):
        super().__init__()
        self.future = future  # a look-alike: columns at or after the position (l >= P)
        gen = torch.Generator().manual_seed(5)
        for name, d in (("k_cache", dim), ("v_cache", dim // 2)):
            self.register_buffer(name, torch.randn(slots, length, heads, d, generator=gen))

    def forward(self, q, k, v, positions, slots):
        B, T, L = q.shape[0], q.shape[1], self.k_cache.shape[1]
        pos = positions.view(B, 1) + torch.arange(T)
        self.k_cache[slots.view(B, 1), pos] = k
        self.v_cache[slots.view(B, 1), pos] = v
        visible = torch.arange(L).view(1, 1, L) <= pos.view(B, T, 1)
        if self.future:
            visible = pos.view(B, T, 1) <= torch.arange(L).view(1, 1, L)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), self.k_cache[slots].transpose(1, 2),
            self.v_cache[slots].transpose(1, 2), attn_mask=visible.unsqueeze(1))
        return o.transpose(1, 2)


def test_decode_sdpa_over_a_written_cache_keeps_its_values():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 2, d, generator=gen) for d in (8, 8, 4))
    args = {"q": q, "k": k, "v": v, "positions": torch.tensor([0, 7]), "slots": torch.tensor([3, 1])}
    module, reference = CachedSDPA(), CachedSDPA()
    c = canonicalize(None, args, module=module)
    assert c.counts["sdpa_math"] == 1 and _guards(c.after.graph) == 0
    assert not any(n.target is aten.mul.Scalar for n in c.after.graph.nodes)
    assert_same_values(c, rel=0)
    with torch.no_grad():
        want = reference(*args.values())
    torch.testing.assert_close(c.output, want, rtol=1e-6, atol=1e-6)


def test_a_mask_of_later_columns_keeps_the_guard():
    """l >= P: column 0 is masked wherever P > 0 (no proof of a visible column), and P past the
    last column would mask a whole row; the guard stays."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 2, d, generator=gen) for d in (8, 8, 4))
    args = {"q": q, "k": k, "v": v, "positions": torch.tensor([0, 7]), "slots": torch.tensor([3, 1])}
    module, reference = CachedSDPA(future=True), CachedSDPA(future=True)
    c = canonicalize(None, args, module=module)
    assert c.counts.get("sdpa_math", 0) == 0 and _guards(c.after.graph) == 1
    assert_same_values(c, rel=0)
    with torch.no_grad():
        want = reference(*args.values())
    torch.testing.assert_close(c.output, want, rtol=1e-6, atol=1e-6)
