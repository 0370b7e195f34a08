"""equal_split: a split of the last dim into equal pieces written with sizes (spell10's
`qkv.split([w, w, w], -1)`) becomes `split(w, -1)`, the same views; unequal sizes, another dim and
pieces of width one stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import equal_split
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.canonical.spell10_kda import assert_kda_fuses_with_only

SPLIT, SIZES = "aten.split.Tensor", "aten.split_with_sizes.default"


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def qkv_sizes(x):  # spell10's KDA
    q, k, v = x.split([8, 8, 8], dim=-1)
    return q * 2, k + 1, v.exp()


def pair_sizes(x):  # a gate|up pair
    g, u = torch.split(x, [12, 12], dim=2)
    return g * u


def unequal(x):  # MLA's [C, R]
    c, r = x.split([16, 8], dim=-1)
    return c.sum(-1), r * 2


def other_dim(x):  # the three conv states' split([W] * 3, dim=1)
    a, b, c = x.split([1, 1, 1], dim=0)[0].split([2, 2, 2], dim=1)
    return a + b + c


def width_one(x):  # expert_dense's [1] * E
    return [p * 2 for p in x.split([1] * 24, dim=-1)]


@pytest.mark.parametrize("fn", [qkv_sizes, pair_sizes])
def test_equal_sizes_become_split(fn):
    x = _x(3, 2, 24)
    before, after, n = rewrite(equal_split.RULE, fn, x)
    assert n == 1 and SPLIT in targets(after) and SIZES not in targets(after)
    assert_same(after(x), before(x))


@pytest.mark.parametrize("fn", [unequal, other_dim, width_one])
def test_lookalikes_stay(fn):
    x = _x(3, 6, 24)
    before, after, n = rewrite(equal_split.RULE, fn, x)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(x), before(x))


@pytest.mark.slow
def test_spell10_kda_fuses_with_its_split_sizes():
    """spell10 with `split([W, W, W])` and its other KDA idioms on the fused spellings"""
    assert_kda_fuses_with_only("kda_split_int")
