"""head_split: a pointwise chain on a projection's [.., H*K] channels split into heads at its end
(spell6's KDA decay and output gate) becomes the chain on the heads, exactly; chains that are
read in their middle, that start from no projection or broadcast otherwise stay."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import head_split
from tests.canonical.rule_checks import assert_same, rewrite, targets

B, T, D, H, K = 2, 1, 16, 4, 8

_rewrite = functools.partial(rewrite, head_split)


def _decay(x, w, a_log, dt_bias):
    """spell6: exp(A_log) repeated per channel, the bias and the bound on [B, T, H*K]"""
    gate = torch.exp(a_log).repeat_interleave(K) * (F.linear(x, w) + dt_bias)
    return torch.exp(-5.0 * torch.sigmoid(gate)).unflatten(-1, (H, K))


def _gate(x, w, a_log, dt_bias):
    return torch.sigmoid(F.linear(x, w)).view(B, T, H, K) * dt_bias.view(H, K)


def _args():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in ((B, T, D), (H * K, D), (H,), (H * K,))]


@pytest.mark.parametrize("fn", [_decay, _gate])
def test_chain_runs_on_the_heads(fn):
    args = _args()
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    split = [node for node in after.graph.nodes if str(node.target) == "aten.view.default"
             and list(node.meta["val"].shape) == [B, T, H, K]]
    assert split and split[0].args[0].target is torch.ops.aten.view.default  # the projection's
    assert_same(after(*args), before(*args))


def test_per_head_repeat_becomes_a_broadcast_column():
    args = _args()
    _, after, _ = _rewrite(_decay, *args)
    assert "aten.expand.default" not in targets(after)
    assert any(list(node.meta["val"].shape) == [H, 1] for node in after.graph.nodes
               if str(node.target) == "aten.view.default")


def _read_inside(x, w, a_log, dt_bias):
    y = torch.sigmoid(F.linear(x, w))
    return y.view(B, T, H, K), y * 2


def _no_projection(x, w, a_log, dt_bias):
    return torch.sigmoid(x.repeat(1, 1, 2)).view(B, T, H, K)


def _merges_rows(x, w, a_log, dt_bias):
    return torch.sigmoid(F.linear(x, w)).view(B * T, H, K)


def _per_token_operand(x, w, a_log, dt_bias):
    return (F.linear(x, w) * x.sum(-1, keepdim=True)).view(B, T, H, K)


@pytest.mark.parametrize("fn", [_read_inside, _no_projection, _merges_rows, _per_token_operand])
def test_look_alikes_stay(fn):
    args = _args()
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), before(*args))
