"""unbind_split: q|k|v cut from one tensor by `unflatten(-1, (3, H, K)).unbind(-3)` (spell6)
becomes `split(H*K, -1)` and a view per piece, exactly; other unbinds stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import unbind_split
from tests.canonical.rule_checks import assert_same, rewrite, targets

B, T, H, K = 2, 1, 4, 8

_rewrite = functools.partial(rewrite, unbind_split)


def _unbind(x):
    q, k, v = x.unflatten(-1, (3, H, K)).unbind(2)
    return q * 2, k.sigmoid(), v


def _canonical(x):
    q, k, v = (y.view(B, T, H, K) for y in x.split(H * K, -1))
    return q * 2, k.sigmoid(), v


def _x():
    return torch.randn(B, T, 3 * H * K, generator=torch.Generator().manual_seed(0))


def test_unbind_becomes_the_split():
    x = _x()
    before, after, n = _rewrite(_unbind, x)
    assert n == 1
    assert "aten.unbind.int" not in targets(after)
    assert sorted(targets(after)) == sorted(targets(rewrite(unbind_split, _canonical, x)[0]))
    assert_same(after(x), before(x))


def _heads(x):
    return x.unflatten(-1, (3, H, K)).unbind(-2)  # over the heads


def _tokens(x):
    return x.view(B, T, 3 * H * K).unbind(0)


def _flat_tokens(x):
    return x.view(B * T, 3, H, K).unbind(1)  # spell7: the leading dims merged too


@pytest.mark.parametrize("fn", [_heads, _tokens, _flat_tokens, _canonical])
def test_other_cuts_stay(fn):
    x = _x()
    before, after, n = _rewrite(fn, x)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(x), before(x))
