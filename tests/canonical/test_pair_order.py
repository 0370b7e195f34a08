"""Rule `pair_order`: routed experts dispatched over their (token, slot) pairs sorted by expert
(spell7's and vLLM's `argsort` dispatch, token `order // k`, an fp32 `index_add_`) become the
pairs in token order (the sort's indices replaced by arange), equal to the spelling to fp32
summation order; with rule `expert_rows` after it, the canonical experts. Look-alikes (an order
that is no permutation, the sorted order read elsewhere, weights not permuted with the pairs)
stay; a mask dropping pairs is still a permutation of rows (taken, equal), which `expert_rows`
then leaves alone."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import expert_rows, pair_order

from .pair_spellings import SORTED_ODD, sorted_pairs
from .rule_checks import targets, trace
from .test_expert_rows import EXPERT_OPS, canonical
from .test_expert_slots import _inputs


def _close(got, want):
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want),
                    strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), rtol=0,
                                   atol=1e-6 * float(w.float().abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_sorted_pairs_become_token_order_then_the_k_slots(rows, dtype):
    fn, args = (lambda *a: sorted_pairs(*a)), _inputs(rows, dtype)
    gm = trace(fn, args)
    assert "aten.sort.stable" in targets(gm)
    assert pair_order.RULE.apply(gm.graph) == 1
    gm.recompile()
    assert "aten.sort.stable" not in targets(gm)
    _close(gm(*args), fn(*args))
    assert expert_rows.RULE.apply(gm.graph) == 1
    gm.recompile()
    assert ([t for t in targets(gm) if t in EXPERT_OPS]
            == [t for t in targets(trace(canonical, args)) if t in EXPERT_OPS])
    _close(gm(*args), fn(*args))


def test_pairs_already_in_token_order_have_no_sort_to_drop():
    gm = trace(lambda *a: sorted_pairs(*a, sort=False), _inputs(3))
    before = targets(gm)
    assert pair_order.RULE.apply(gm.graph) == 0 and targets(gm) == before


@pytest.mark.parametrize("case", [c for c in SORTED_ODD if c != "mask_drops_pairs"])
def test_look_alikes_are_left_alone(case):
    gm = trace(lambda *a: sorted_pairs(*a, odd=case), _inputs(3))
    before = targets(gm)
    assert pair_order.RULE.apply(gm.graph) == 0 and targets(gm) == before
    assert expert_rows.RULE.apply(gm.graph) == 0 and targets(gm) == before


def test_a_mask_dropping_pairs_keeps_its_values_and_is_no_experts_site():
    """Row-wise math on sorted pairs, however odd, is the same math on pairs in token order:
    taken, equal; the masked experts are then no canonical experts (left by `expert_rows`)."""
    fn, args = (lambda *a: sorted_pairs(*a, odd="mask_drops_pairs")), _inputs(3)
    gm = trace(fn, args)
    assert pair_order.RULE.apply(gm.graph) == 1
    gm.recompile()
    _close(gm(*args), fn(*args))
    before = targets(gm)
    assert expert_rows.RULE.apply(gm.graph) == 0 and targets(gm) == before
    assert not torch.allclose(fn(*args), canonical(*args), rtol=1e-3, atol=1e-3)
