"""sort_topk: the first k of a descending unstable sort over the last dim (spell12's router,
`sort(s, -1, descending=True).indices[:, :k]`) becomes `topk(s, k)`, equal where no values tie;
stable, ascending, other-dim, offset and whole-order sorts stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import sort_topk
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.spellings import foreign

_rewrite = functools.partial(rewrite, sort_topk.RULE)
K = 4


def _indices(s):  # spell12's router
    return s.gather(-1, torch.sort(s, -1, descending=True).indices[:, :K])


def _both(s):
    v, i = torch.sort(s, dim=-1, descending=True)
    return v[..., :K] * 2, i[..., :K]


def _s(dtype=torch.float32, rows=6, experts=16):
    """Each row a permutation of distinct values (exact in half precision too): no ties."""
    gen = torch.Generator().manual_seed(0)
    return (torch.rand(rows, experts, generator=gen).argsort(-1) - experts / 2).to(dtype) / 4


@pytest.mark.parametrize("fn", [_indices, _both])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_sorted_prefix_is_the_topk(fn, dtype):
    s = _s(dtype)
    before, after, n = _rewrite(fn, s)
    assert n == 1
    assert "aten.sort.default" not in targets(after) and "aten.topk.default" in targets(after)
    assert_same(after(s), before(s))


def _stable(s):
    return torch.sort(s, stable=True, dim=-1, descending=True).indices[:, :K]


def _ascending(s):
    return torch.sort(s, -1).indices[:, :K]


def _other_dim(s):
    return torch.sort(s, 0, descending=True).indices[:K]


def _offset(s):
    return torch.sort(s, -1, descending=True).indices[:, 1:K]


def _whole_order(s):
    order = torch.sort(s, -1, descending=True).indices
    return order[:, :K], order.argsort(-1)


def _two_ks(s):
    v, i = torch.sort(s, -1, descending=True)
    return v[:, :K], i[:, :K + 1]


@pytest.mark.parametrize("fn", [_stable, _ascending, _other_dim, _offset, _whole_order, _two_ks])
def test_others_stay(fn):
    s = _s()
    before, after, n = _rewrite(fn, s)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(s), before(s))


@pytest.mark.slow
def test_spell12_router_fuses_with_the_rule_and_not_without():
    """spell12's `sort(descending)[:, :k]` router: moe_route fuses in layers 1-3 with the rule,
    and not without it."""
    from tests.models.spell12_k3 import from_builtin

    for rules, want in (((), 1), (("sort_topk",), 0)):
        got = foreign.plan_with_rules_off(from_builtin, rules)
        for layer in (1, 2, 3):
            assert got[layer]["moe_route"] == want, (rules, layer, dict(got[layer]))
