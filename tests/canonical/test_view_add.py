"""view_add: two mm outputs viewed the same way and added (Moonshot's routed + shared experts)
become added, then viewed, exactly; other adds of views stay."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import view_add
from tests.canonical.rule_checks import rewrite
from tests.fusions.pattern_checks import targets

B, T, D, L = 3, 1, 16, 8


_rewrite = functools.partial(rewrite, view_add)


def _moonshot(h, z, w_up, w_shared):
    """Moonshot's KimiSparseMoeBlock: the routed output viewed back, then the shared experts
    (a linear on the [B, T, D] input) added."""
    y = F.linear(z, w_up).view(B, T, D)
    return y + F.linear(h, w_shared)


def _args(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype) for s in ((B, T, D), (B * T, L), (D, L), (D, D))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_sink_below_the_add(dtype):
    args = _args(dtype)
    before, after, n = _rewrite(_moonshot, *args)
    assert n == 1
    (add,) = [node for node in after.graph.nodes if str(node.target) == "aten.add.Tensor"]
    assert [str(a.target) for a in add.args] == ["aten.mm.default"] * 2
    assert [str(u.target) for u in add.users] == ["aten.view.default"]
    got, want = after(*args), before(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _activation(h, z, w_up, w_shared):
    return F.linear(z, w_up).view(B, T, D) + h  # a residual add: not two GEMMs


def _other_shapes(h, z, w_up, w_shared):
    return F.linear(z, w_up).view(B, T, D) + F.linear(h, w_shared).view(B, T, 1, D)


def _alpha(h, z, w_up, w_shared):
    return torch.add(F.linear(z, w_up).view(B, T, D), F.linear(h, w_shared), alpha=2)


@pytest.mark.parametrize("fn", [_activation, _other_shapes, _alpha])
def test_look_alikes_stay(fn):
    args = _args()
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)


def _sublayers(h, z, w_up, w_shared):
    """A residual sum of two sublayers: the second GEMM reads the first one's output."""
    a = F.linear(z, w_up).view(B, T, D)
    return a + F.linear(torch.relu(a + h), w_shared)


def test_a_residual_sum_of_sublayers_stays():
    args = _args()
    before, after, n = _rewrite(_sublayers, *args)
    assert n == 0
    assert targets(after) == targets(before)
