"""Rule `pair_restore`: rows computed in a sort's order and put back by its inverse permutation
(spell11's grouped experts: the pairs sorted by expert, the outputs gathered back through
`argsort(order)`; or written back at `order` by a scatter / index_put) become the rows in their own
order, equal to the spelling bit for bit (fp32 and bf16); with rule `expert_rows` after it (its
`bmm` combine of the rows read as [N, k, L]), the canonical experts. Look-alikes (a restore by
another permutation: the order itself, the inverse of another sort of the same keys where ties
matter, a descending argsort; rows kept in the sort's order; rows mixed) stay; so does the
argsort dispatch summed back by `index_add_` (rule `pair_order`'s)."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import expert_rows, pair_restore

from .pair_spellings import GROUPED_ODD, RESTORES, grouped_pairs, sorted_pairs
from .rule_checks import assert_same, targets, trace
from .test_expert_rows import EXPERT_OPS, K3_SIZES, canonical
from .test_expert_slots import TP16, _inputs

SORTS = {"aten.sort.stable", "aten.sort.default"}


def _apply(fn, args):
    gm = trace(fn, args)
    before = targets(gm)
    n = pair_restore.RULE.apply(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, before, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("restore", RESTORES)
@pytest.mark.parametrize("rows", [1, 3])
def test_restored_rows_are_computed_in_their_own_order(rows, restore, dtype):
    fn, args = (lambda *a: grouped_pairs(*a, restore=restore)), _inputs(rows, dtype)
    gm, before, n = _apply(fn, args)
    assert SORTS & set(before) and n == 1
    assert not SORTS & set(targets(gm))
    assert_same(gm(*args), fn(*args))  # a permutation and its inverse: exact
    assert expert_rows.RULE.apply(gm.graph) == 1
    gm.recompile()
    assert ([t for t in targets(gm) if t in EXPERT_OPS]
            == [t for t in targets(trace(canonical, args)) if t in EXPERT_OPS])
    got, want = gm(*args), fn(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the k-term fp32 sum in another order (bf16: the same bf16-rounded GEMM outputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))


def test_pairs_already_in_token_order_have_no_sort_to_drop():
    args = _inputs(3)
    gm, before, n = _apply(lambda *a: grouped_pairs(*a, sort=False), args)
    assert n == 0 and targets(gm) == before
    assert expert_rows.RULE.apply(gm.graph) == 1  # the combine form, taken as it is


@pytest.mark.parametrize("case", GROUPED_ODD)
def test_look_alikes_are_left_alone(case):
    args = _inputs(3)
    fn = lambda *a: grouped_pairs(*a, odd=case)
    gm, before, n = _apply(fn, args)
    if case in ("rows_tiled", "weights_twice"):  # restored: the odd part is expert_rows'
        assert n == 1
        assert_same(gm(*args), fn(*args))
    else:
        assert n == 0 and targets(gm) == before
    before = targets(gm)
    assert expert_rows.RULE.apply(gm.graph) == 0 and targets(gm) == before
    if case != "rows_kept":  # each is another computation than the canonical experts
        assert not torch.allclose(fn(*args), canonical(*args), rtol=1e-3, atol=1e-3)


def test_the_index_add_dispatch_is_left_to_pair_order():
    gm, before, n = _apply(lambda *a: sorted_pairs(*a), _inputs(3))
    assert n == 0 and targets(gm) == before


def test_an_unstable_sort_is_restored_whatever_its_ties():
    """The order of equal keys is any permutation's: the inverse undoes it (many ties here)."""
    def fn(y, keys):
        order = torch.sort(keys).indices  # unstable
        rows = torch.tanh(y[order]) * keys[order, None]
        return rows[torch.argsort(order)]

    args = (torch.randn(12, 5), torch.tensor([2, 0, 1, 2, 0, 0, 1, 2, 2, 1, 0, 1]))
    gm, _, n = _apply(fn, args)
    assert n == 1 and not SORTS & set(targets(gm))
    assert_same(gm(*args), torch.tanh(args[0]) * args[1][:, None])


def test_k3_sizes(monkeypatch):
    """One token at K3's TP16 sizes (16 slots, 896 experts, I 192, L 3584): restored without any
    evaluation of the experts (position codes only), then `expert_rows` takes the combine,
    proven at its smaller sizes (the same as its token-major spelling's)."""
    seen, evaluate = [], expert_rows._values_of

    def recording(region, inputs, out, sizes):
        seen.append(sizes)
        return evaluate(region, inputs, out, sizes)

    monkeypatch.setattr(expert_rows, "_values_of", recording)
    args = _inputs(1, cheap=True, **TP16)
    gm, _, n = _apply(lambda *a: grouped_pairs(*a), args)
    assert n == 1 and not seen
    assert expert_rows.RULE.apply(gm.graph) == 1 and seen == [K3_SIZES]
    gm.recompile()
    assert ([t for t in targets(gm) if t in EXPERT_OPS]
            == [t for t in targets(trace(canonical, args)) if t in EXPERT_OPS])
