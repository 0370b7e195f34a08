"""norm_square: the square of an L2 norm (`vector_norm(x).square()`, spell6's l2 norm) becomes
the sum of squares, to an ulp; roots of other values and other powers stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import norm_square
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.conftest import rel_err

_rewrite = functools.partial(rewrite, norm_square)


def _vector_norm(x):
    n2 = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()
    return x * torch.rsqrt(n2 + 1e-6)


def _sqrt_squared(x):
    n = torch.sqrt((x * x).sum(-1, keepdim=True))
    return x * torch.rsqrt(n * n + 1e-6)


def _x(dtype=torch.float32):
    return torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("fn", [_vector_norm, _sqrt_squared])
def test_square_of_the_norm_is_the_sum_of_squares(fn):
    x = _x()
    before, after, n = _rewrite(fn, x)
    assert n == 1
    assert "aten.sqrt.default" not in targets(after)
    assert [t for t in targets(after) if "pow" in t] in ([], ["aten.pow.Tensor_Scalar"])
    assert rel_err(after(x), before(x)) <= 1e-6


def _root_of_a_sum(x):
    return torch.sqrt(x.sum(-1, keepdim=True)) ** 2  # may be negative: NaN stays NaN


def _cube(x):
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True) ** 3


@pytest.mark.parametrize(("fn", "dtype"), [(_root_of_a_sum, torch.float32),
                                           (_cube, torch.float32),
                                           (_vector_norm, torch.bfloat16)])
def test_others_stay(fn, dtype):
    x = _x(dtype)
    before, after, n = _rewrite(fn, x)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(x), before(x))
