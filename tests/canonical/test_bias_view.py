"""bias_view: (x + b[H*K]).view(..., H, K) becomes x.view(..., H, K) + b.view(H, K), exactly;
other adds and views stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import bias_view
from tests.canonical.rule_checks import rewrite
from tests.fusions.pattern_checks import targets

B, T, H, K = 2, 1, 2, 8


_rewrite = functools.partial(rewrite, bias_view)


def _decay(x, b):
    return torch.sigmoid((x + b).view(B, T, H, K))


def _decay_fp32(x, b):
    return torch.sigmoid((x.float() + b.float()).view(B, T, H, K))


@pytest.mark.parametrize(("fn", "dtype"), [(_decay, torch.float32), (_decay_fp32, torch.bfloat16)])
def test_bias_added_after_the_head_split(fn, dtype):
    x, b = torch.randn(B, T, H * K).to(dtype), torch.randn(H * K).to(dtype)
    before, after, n = _rewrite(fn, x, b)
    assert n == 1
    add = next(node for node in after.graph.nodes if str(node.target) == "aten.add.Tensor")
    assert [list(a.meta["val"].shape) for a in add.args] == [[B, T, H, K], [H, K]]
    got, want = after(x, b), before(x, b)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _read_twice(x, b):
    y = x + b
    return y.view(B, T, H, K), y


def _merges_rows(x, b):
    return (x + b).view(B * T, H, K)


def _bias_2d(x, b):
    return (x + b.view(1, H * K)).view(B, T, H, K)


def _tensor_sum(x, b):
    return (x + x.flip(0)).view(B, T, H, K) * b.sum()


@pytest.mark.parametrize("fn", [_read_twice, _merges_rows, _bias_2d, _tensor_sum])
def test_look_alikes_stay(fn):
    x, b = torch.randn(B, T, H * K), torch.randn(H * K)
    before, after, n = _rewrite(fn, x, b)
    assert n == 0
    assert targets(after) == targets(before)
