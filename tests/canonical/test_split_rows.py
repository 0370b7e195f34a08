"""split_rows: the channels of token rows flattened from [B, T, C] split, each piece viewed back
to [B, T, ...] (spell10's `qkv.view(b * t, 3 * w).split(...)`), become a split of the
[B, T, C] value, bit for bit (also through a reshape's copy at T > 1 and with split sizes);
a piece read as flat rows, another dim and a token-mixing flattening stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import split_rows
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.canonical.spell10_kda import assert_kda_fuses_with_only

H, D = 2, 8
W = H * D


def _y(B, T):  # [B, 3W, T] transposed, as a conv output is
    return torch.randn(B, 3 * W, T, generator=torch.Generator().manual_seed(0))


def spell10_cut(y):  # spell10: [B, T, 3W] flattened to rows, cut, viewed back per head
    B, T = y.shape[0], y.shape[-1]
    rows = y.transpose(1, 2).reshape(B * T, 3 * W)
    return [p.view(B, T, H, D) * 2.0 for p in rows.split(W, dim=-1)]


def sizes_cut(y):  # split([W, W, W]), the pieces viewed [B, T, W]
    B, T = y.shape[0], y.shape[-1]
    rows = y.transpose(1, 2).reshape(B * T, 3 * W)
    return [p.view(B, T, W) + 1.0 for p in rows.split([W, W, W], dim=-1)]


def upcast_cut(y):  # spell10 in bf16: rows upcast, cut (rule cast_split: cast per piece), viewed
    B, T = y.shape[0], y.shape[-1]
    rows = y.transpose(1, 2).reshape(B * T, 3 * W)
    return [p.float().view(B, T, H, D) * 2.0 for p in rows.split([W, W, W], dim=-1)]


@pytest.mark.parametrize("B,T", [(2, 1), (2, 3), (1, 2)])
@pytest.mark.parametrize("fn", [spell10_cut, sizes_cut, upcast_cut])
def test_the_cut_moves_to_the_token_value(fn, B, T):
    y = _y(B, T).to(torch.bfloat16) if fn is upcast_cut else _y(B, T)
    before, after, n = rewrite(split_rows.RULE, fn, y)
    assert n == 1
    cut = next(x for x in after.graph.nodes if "split" in str(x.target))
    assert tuple(cut.args[0].meta["val"].shape) == (B, T, 3 * W)
    assert "aten.clone.default" not in targets(after)
    assert_same(after(y), before(y))


def read_flat(y):  # a piece also read as rows
    B, T = y.shape[0], y.shape[-1]
    q, k, v = y.transpose(1, 2).reshape(B * T, 3 * W).split(W, dim=-1)
    return q.view(B, T, H, D), k.view(B, T, H, D), v.sum(0)


def other_dim(y):  # rows split, not channels
    B, T = y.shape[0], y.shape[-1]
    a, b = y.transpose(1, 2).reshape(B * T, 3 * W).split(B * T // 2, dim=0)
    return a.view(1, B * T // 2, 3 * W), b


def mixed(y):  # [B, T*3W] rows: tokens mixed with channels
    B, T = y.shape[0], y.shape[-1]
    return [p.view(B, T, W) for p in y.transpose(1, 2).reshape(B, T * 3 * W).split(T * W, -1)]


def upcast_read_flat(y):  # an upcast piece also read as rows
    B, T = y.shape[0], y.shape[-1]
    q, k, v = (p.float() for p in y.transpose(1, 2).reshape(B * T, 3 * W).split(W, dim=-1))
    return q.view(B, T, H, D), k.view(B, T, H, D), v.sum(0)


@pytest.mark.parametrize("fn", [read_flat, other_dim, mixed, upcast_read_flat])
def test_lookalikes_stay(fn):
    y = _y(2, 2).to(torch.bfloat16) if fn is upcast_read_flat else _y(2, 2)
    before, after, n = rewrite(split_rows.RULE, fn, y)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(y), before(y))


@pytest.mark.slow
def test_spell10_kda_fuses_with_its_flat_cut():
    """spell10 with its q|k|v cut on flat [N, 3W] rows and its other KDA idioms on the fused
    spellings"""
    assert_kda_fuses_with_only("kda_split_rows")


@pytest.mark.slow
def test_spell10_bf16_kda_fuses_with_its_flat_upcast_cut():
    """bf16: the flat rows upcast before the cut (`qkv.view(b * t, 3w).float().split(...)`; rule
    cast_split moves the cast to each piece, this rule moves it on to the [B, T, w] pieces)"""
    assert_kda_fuses_with_only("kda_split_rows", torch.bfloat16)
