"""Rule `expert_rows`: routed MXFP4 experts on token-major (token, slot) pair rows (z repeated k
times, the flat ids and weights, an fp32 `index_add_` finalize; spell6's form, and spell7's once
rule `pair_order` has put its pairs in token order; or the unweighted rows combined by a `bmm` of
the [N, k] weights, spell11's once rule `pair_restore` has) become the k slots at once, op for op
the form `math.mxfp4_experts` has, equal to the spelling to fp32 summation order; look-alikes (a
token index that is not arange(P) // k, z tiled instead of repeated, each token's first id for
every slot, a mask dropping pairs, rows mixed, a non-zero accumulator, rows combined slot-major,
the weights applied twice) stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import expert_rows as rule
from k3compile.math import mxfp4_experts

from .pair_spellings import (
    BETAS,
    TOKEN_MAJOR_ODD,
    grouped_pairs,
    routed,
    sorted_pairs,
    token_major,
)
from .rule_checks import targets, trace
from .test_expert_slots import TP16, _inputs

EXPERT_OPS = {"aten.bmm.default", "aten.tanh.default", "aten.index.Tensor"}


def canonical(z, scores, ids, lut, *stacks):
    out_dtype = None if z.dtype == torch.float32 else torch.float32
    return mxfp4_experts(z, ids, routed(scores, ids), lut.to(z.dtype), *stacks, *BETAS, out_dtype)


def _apply(fn, args):
    gm = trace(fn, args)
    before = targets(gm)
    n = rule.apply(gm.graph)
    gm.recompile()
    return gm, before, n


SPELLINGS = {"token_major": lambda *a: token_major(*a),
             "pairs_in_token_order": lambda *a: sorted_pairs(*a, sort=False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_pair_rows_become_the_k_slots_at_once(spelling, rows, dtype):
    fn, args = SPELLINGS[spelling], _inputs(rows, dtype)
    gm, before, n = _apply(fn, args)
    assert "aten.index_put.default" in before and n == 1
    assert "aten.index_put.default" not in targets(gm)
    # the experts as the canonical trace has them: gathered by the [N, k] ids, no pair rows
    assert ([t for t in targets(gm) if t in EXPERT_OPS]
            == [t for t in targets(trace(canonical, args)) if t in EXPERT_OPS])
    got, want = (torch.utils._pytree.tree_leaves(t)[0] for t in (gm(*args), fn(*args)))
    assert got.dtype == want.dtype and got.shape == want.shape
    # fp32: the sum over the k slots in another order; bf16: the canonical GEMMs in bf16 against
    # the spelling's fp32 GEMMs of the same bf16-exact weights, rounded to bf16 (measured: equal
    # for token_major, 6e-8 of the largest value for the bmm spelling)
    torch.testing.assert_close(got.float(), want.float(), rtol=0,
                               atol=1e-6 * float(want.float().abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_pair_rows_combined_by_the_weights_become_the_k_slots_at_once(rows, dtype):
    """spell11's finalize (its pairs in token order, as rule `pair_restore` leaves them): the
    unweighted rows read as [N, k, L] and combined by `bmm(w.unsqueeze(1), y.float())`."""
    fn, args = (lambda *a: grouped_pairs(*a, sort=False)), _inputs(rows, dtype)
    gm, before, n = _apply(fn, args)
    assert n == 1 and before.count("aten.bmm.default") == 4
    assert ([t for t in targets(gm) if t in EXPERT_OPS]
            == [t for t in targets(trace(canonical, args)) if t in EXPERT_OPS])
    got, want = gm(*args), fn(*args)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("case", ["rows_tiled", "weights_twice", "rows_mixed"])
def test_combine_look_alikes_are_left_alone(case):
    """Rows read as [k, N, L] (slot-major), the weights applied per row and again by the
    combine, each row given the next one's output: other computations, left as they are."""
    args = _inputs(3)
    fn = lambda *a: grouped_pairs(*a, sort=False, odd=case)
    gm, before, n = _apply(fn, args)
    assert n == 0 and targets(gm) == before
    assert not torch.allclose(fn(*args), canonical(*args), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case", TOKEN_MAJOR_ODD)
def test_look_alikes_are_left_alone(case):
    args = _inputs(3)
    fn = lambda *a: token_major(*a, odd=case)
    gm, before, n = _apply(fn, args)
    assert n == 0 and targets(gm) == before
    # and each is another computation, or another form of it, than the canonical one
    if case != "acc_residual":
        want = canonical(*args)
        assert not torch.allclose(fn(*args).float(), want.float(), rtol=1e-3, atol=1e-3)


def test_the_sorted_pairs_are_left_to_pair_order():
    """The token index `argsort(...) // k` is no constant arange(P) // k: this rule alone leaves
    spell7's sorted dispatch (tests/canonical/test_pair_order.py takes it)."""
    gm, before, n = _apply(lambda *a: sorted_pairs(*a), _inputs(3))
    assert n == 0 and targets(gm) == before


def _record_sizes(monkeypatch) -> list:
    seen, evaluate = [], rule._values_of

    def recording(region, inputs, out, sizes):
        seen.append(sizes)
        return evaluate(region, inputs, out, sizes)

    monkeypatch.setattr(rule, "_values_of", recording)
    return seen


def test_fewer_rows_proven_equal_the_spelling(monkeypatch):
    """The proof at fewer tokens (the budget exceeded): N = 9, P = 27 replaced by 7 and 21, ints
    the region does not hold (nor a format constant); the rewrite equals the spelling at the
    real sizes."""
    monkeypatch.setattr(rule, "BUDGET", 0)
    seen = _record_sizes(monkeypatch)
    args = _inputs(9)
    gm, _, n = _apply(lambda *a: token_major(*a), args)
    assert n == 1 and seen == [{9: 7, 27: 21}]
    got, want = gm(*args), token_major(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))


K3_SIZES = {192: 160, 96: 80, 6: 5, 3584: 352, 1792: 176, 112: 11, 896: 17}


@pytest.mark.parametrize(("rows", "fewer"), [(1, {}), (64, {64: 6, 1024: 96})])
def test_k3_sizes(rows, fewer, monkeypatch):
    """At K3's TP16 sizes (16 slots, 896 experts, I 192, L 3584): the region is evaluated at
    I 160, L 352, E 17 (the first smaller sizes none of whose ints the region holds) and, for 64
    tokens, 6 (P = 96); one token's P = 16 is kept (16 is also a format constant). The rewritten
    graph has the canonical trace's expert ops (its values: the positives above). (N = 16 and 32
    are format constants too and their P too large: left alone, docs/decisions.md.)"""
    seen = _record_sizes(monkeypatch)
    args = _inputs(rows, cheap=True, **TP16)
    gm, _, n = _apply(lambda *a: token_major(*a), args)
    assert n == 1 and seen == [{**K3_SIZES, **fewer}]
    assert "aten.index_put.default" not in targets(gm)
    assert ([t for t in targets(gm) if t in EXPERT_OPS]
            == [t for t in targets(trace(canonical, args)) if t in EXPERT_OPS])
