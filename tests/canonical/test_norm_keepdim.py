"""norm_keepdim: a sum of squares over the last dim unsqueezed back (spell12's l2 norm through
`vecdot(x, x)[..., None]`) becomes the sum with keepdim, bit for bit; look-alikes stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import norm_keepdim

from .rule_checks import assert_same, rewrite, targets

aten = torch.ops.aten
_rewrite = functools.partial(rewrite, norm_keepdim)


def vecdot_l2(x):
    """tests/models/spell12_k3.py's KDA.l2"""
    return x * torch.rsqrt(torch.linalg.vecdot(x, x)[..., None] + 1e-6)


def pow_unsqueeze(x):
    return x * torch.rsqrt(x.pow(2).sum(-1).unsqueeze(-1) + 1e-6)


@pytest.mark.parametrize("fn", [vecdot_l2, pow_unsqueeze])
def test_the_sum_keeps_its_dim(fn):
    x = torch.randn(2, 1, 4, 16)
    before, after, n = _rewrite(fn, x)
    assert n == 1
    (total,) = [node for node in after.graph.nodes if node.target is aten.sum.dim_IntList]
    assert total.args[2] is True and "aten.unsqueeze.default" not in targets(after)
    assert_same(after(x), before(x))


def other_dim(x):
    return x * torch.rsqrt((x * x).sum(0)[None] + 1e-6)


def other_product(x):
    y = x.flip(-1)
    return x * torch.rsqrt((x * y).sum(-1)[..., None] + 1e-6)


def unsqueezed_elsewhere(x):
    return (x * x).sum(-1).unsqueeze(0)


def read_twice(x):
    s = (x * x).sum(-1)
    return x * torch.rsqrt(s[..., None] + 1e-6), s


@pytest.mark.parametrize("fn", [other_dim, other_product, unsqueezed_elsewhere, read_twice])
def test_look_alikes_stay(fn):
    x = torch.randn(2, 1, 4, 16)
    before, after, n = _rewrite(fn, x)
    assert n == 0
    assert targets(after) == targets(before)


def test_bf16_stays():
    x = torch.randn(2, 1, 4, 16).to(torch.bfloat16)
    before, after, n = _rewrite(vecdot_l2, x)
    assert n == 0
    assert_same(after(x), before(x))
