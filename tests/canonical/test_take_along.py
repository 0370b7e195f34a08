"""take_along: `take_along_dim(scores, topk ids, dim)` (a JAX port's routing, spell9) becomes
`gather(scores, dim, ids)`, bit for bit; ids not from a top-k over that dim, and broadcasting
reads, stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import take_along
from tests.canonical.rule_checks import assert_same, rewrite, targets

GATHER, REM, EXPAND = "aten.gather.default", "aten.remainder.Scalar", "aten.expand.default"


def _scores(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _route(dim):
    def fn(logits, bias):
        s = torch.sigmoid(logits)
        idx = torch.topk(s + bias, 4, dim).indices
        w = torch.take_along_dim(s, idx, dim)
        return w / (w.sum(dim, keepdim=True) + 1e-20), idx
    return fn


SPELLED = {  # (fn, logits shape)
    "tokens": (_route(-1), (3, 16)),
    "tokens_unit_t": (_route(-1), (2, 1, 16)),
    "positive_dim": (_route(2), (2, 3, 16)),
    "sorted_false": (lambda s, b: torch.take_along_dim(
        s, torch.topk(s + b, 4, -1, sorted=False).indices, -1), (3, 16)),
}


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_take_along_topk_ids_is_a_gather(name):
    fn, shape = SPELLED[name]
    logits, bias = _scores(*shape), _scores(shape[-1], seed=1)
    before, after, n = rewrite(take_along.RULE, fn, logits, bias, joint=True)
    assert n == 1
    assert GATHER in targets(after) and REM not in targets(after) and EXPAND not in targets(after)
    assert_same(after(logits, bias), before(logits, bias))


def _other_ids(s, ids):
    return torch.take_along_dim(s, ids, -1)


def _broadcast(s, b):
    idx = torch.topk(s + b, 4, -1).indices  # [3, 4]
    return torch.take_along_dim(s[:1], idx, -1)  # one row read by every row of ids


def _other_dim(s, b):
    idx = torch.topk(s + b, 2, 0).indices  # [2, 16]: ids over dim 0, read along dim 1
    return torch.take_along_dim(s[:2], idx, 1)


LOOKALIKES = {
    "ids_from_input": (_other_ids, lambda: (_scores(3, 16), torch.tensor([[0, -1]] * 3))),
    "broadcast": (_broadcast, lambda: (_scores(3, 16), _scores(16, seed=1))),
    "topk_other_dim": (_other_dim, lambda: (_scores(3, 16), _scores(16, seed=1))),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_stay(name):
    fn, args = LOOKALIKES[name]
    args = args()
    before, after, n = rewrite(take_along.RULE, fn, *args, joint=True)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(*args), before(*args))
