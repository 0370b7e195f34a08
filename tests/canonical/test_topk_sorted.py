"""Rule `topk_sorted`: an unsorted top-k (or one over the last dim spelled positively) becomes
`topk(x, k)`, the sorted top-k as `torch.topk(x, k)` traces; it routes to the same experts with
the same weights, each row in sorted order (an unsorted top-k's order is unspecified, so that is
one valid result of it). Other top-k's (smallest, another dim) keep what they mean."""

from __future__ import annotations

import pytest
import torch

from .compiled import canonicalize, run
from .router_spellings import FUSED, SPELLINGS, Router, by_expert, fused, only, routed_equal, tokens

aten = torch.ops.aten
UNSORTED = ("hf", "moonshot", "expand_bias", "view_bias")  # sorted=False; view_bias: dim=1


def _topks(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is aten.topk.default]


@pytest.mark.parametrize("name", UNSORTED)
def test_router_topk_becomes_the_sorted_canonical_one(name):
    router, x = Router(SPELLINGS[name]), tokens()
    c = canonicalize(None, {"x": x}, module=router, **only("topk_sorted"))
    assert c.counts["topk_sorted"] == 1
    (topk,) = _topks(c.after)
    assert topk.args[1:] == (4,) and not topk.kwargs  # topk(x, K): dim -1, largest, sorted
    got, want = run(c.after, c.inputs), run(c.before, c.inputs)
    routed_equal(got, want, rel=1e-7)  # the sum over the k weights may add in another order
    with torch.no_grad():
        choice = torch.sigmoid(x @ router.weight.T) + router.e_score_correction_bias
    assert torch.equal(got[0], choice.topk(4).indices)  # by score + bias, largest first


def test_eager_cpu_unsorted_order_is_another_valid_result():
    """What eager CPU does with sorted=False (measured, torch 2.13): the same elements, in
    another order; the rewrite's sorted result holds the same (value, index) pairs."""
    x = torch.randn(4, 384, generator=torch.Generator().manual_seed(0))
    unsorted, ordered = x.topk(8, sorted=False), x.topk(8)
    assert not torch.equal(unsorted.indices, ordered.indices)
    want, got = by_expert(unsorted.indices, unsorted.values), by_expert(*ordered[::-1])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _others(x):
    smallest = torch.topk(x, 2, dim=-1, largest=False, sorted=False)
    along_rows = torch.topk(x, 2, dim=0)
    return smallest.values, smallest.indices, along_rows.values, along_rows.indices


def test_smallest_and_other_dims_keep_their_meaning():
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    c = canonicalize(_others, {"x": x}, **only("topk_sorted"))
    assert c.counts["topk_sorted"] == 1  # only sorted=False -> True
    smallest, along_rows = _topks(c.after)
    assert smallest.args[1:] == (2, -1, False) and along_rows.args[1:] == (2, 0)
    got, want = run(c.after, c.inputs), run(c.before, c.inputs)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert torch.equal(got[0], x.topk(2, largest=False).values)
    assert torch.equal(*(by_expert(o[1], o[0])[1] for o in (got, want)))


def test_canonical_topk_is_left_alone():
    c = canonicalize(None, {"x": tokens()}, module=Router(SPELLINGS["ours"]), **only("topk_sorted"))
    assert c.counts["topk_sorted"] == 0


@pytest.mark.parametrize("name", UNSORTED)
def test_router_fuses_under_the_backend(name):
    ops, got, want = fused(SPELLINGS[name])
    assert all(ops[op] == 1 for op in FUSED), ops
    routed_equal(got, want)
