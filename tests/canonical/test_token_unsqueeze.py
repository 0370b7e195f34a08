"""token_unsqueeze: a token's row of a [B, T, H] tensor taken after a unit dim was appended
(spell12's β: `sigmoid(b)[..., None]`, then `beta[:, t]`) becomes the row unsqueezed after its
select, the canonical `beta[:, t].unsqueeze(-1)`, bit for bit; look-alikes stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import token_unsqueeze

from .rule_checks import assert_same, rewrite, targets

aten = torch.ops.aten
_rewrite = functools.partial(rewrite, token_unsqueeze)


def spell12(b, v):
    """tests/models/spell12_k3.py's β, read per token"""
    beta = torch.sigmoid(b.float())[..., None]
    return [beta[:, t] * v[:, t] for t in range(b.shape[1])]


def unsqueezed(b, v):
    beta = torch.sigmoid(b).unsqueeze(-1)
    return [v[:, t] * beta[:, t] for t in range(b.shape[1])]


@pytest.mark.parametrize("fn", [spell12, unsqueezed])
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_row_is_taken_first(fn, tokens):
    args = torch.randn(2, tokens, 4), torch.randn(2, tokens, 4, 8)
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    for node in after.graph.nodes:
        if node.target is aten.unsqueeze.default:
            assert node.args[0].target is aten.select.int and node.args[1] == -1
    assert sum(node.target is aten.unsqueeze.default for node in after.graph.nodes) == tokens
    assert_same(after(*args), before(*args))


def read_whole(b, v):
    beta = torch.sigmoid(b)[..., None]
    return beta[:, 0] * v[:, 0], beta


def other_dim(b, v):
    beta = torch.sigmoid(b)[:, :, None]
    return beta[:, 0] * 2


def batch_row(b, v):
    beta = torch.sigmoid(b)[..., None]
    return beta[0] * v[0]


@pytest.mark.parametrize("fn", [read_whole, other_dim, batch_row])
def test_look_alikes_stay(fn):
    args = torch.randn(2, 1, 4), torch.randn(2, 1, 4, 8)
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
