"""stack_cat: pieces stacked on a new dim that a reshape merges into the next dim become their
concatenation on that dim (`torch.cat([q, k, v], -1)` of [B, T, W] pieces, the canonical form),
bit for bit; interleaves and stacks kept as a dim stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import stack_cat
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite
from tests.fusions.pattern_checks import graph

N, W = 2, 8


def _pieces(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(N, W, generator=g) for _ in range(3))


def canonical(q, k, v):  # k3compile/models/k3.py: the projections' [B, T, W] outputs
    return torch.cat([q.view(N, 1, W), k.view(N, 1, W), v.view(N, 1, W)], dim=-1)


SPELLINGS = {  # name: (fn(q, k, v [N, W]), the canonical form, cat's dim)
    "stacked_qkv": (lambda q, k, v: torch.stack([q, k, v]).permute(1, 0, 2).reshape(N, 1, 3 * W),
                    canonical, -1),
    "stack_dim1": (lambda q, k, v: torch.stack([q, k, v], 1).reshape(N, 3 * W),
                   lambda q, k, v: torch.cat([q, k, v], -1), -1),
    "flattened": (lambda q, k, v: torch.stack([q, k, v]).permute(1, 0, 2).reshape(-1),
                  lambda q, k, v: torch.cat([q, k, v], 1).view(-1), 1),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_becomes_the_concat(name):
    fn, want_fn, dim = SPELLINGS[name]
    args = _pieces()
    before, after, n = rewrite(stack_cat, fn, *args)
    assert n == 1 and "stack" not in ops(after)
    cat = next(node for node in after.graph.nodes if str(node.target) == "aten.cat.default")
    assert cat.args[1] == dim
    assert ops(after) == ops(graph(want_fn, *args))
    assert_same(before, after, args)
    torch.testing.assert_close(after(*args), want_fn(*args), rtol=0, atol=0)


def _read_twice(stacked):
    return stacked.permute(1, 0, 2).reshape(N, 3 * W), stacked.sum(0)


LOOK_ALIKES = {
    # the stacked dim merged with the dim before it: an interleave q0 k0 v0 q1 ..., not a concat
    "interleave": lambda q, k, v: torch.stack([q, k, v], -1).reshape(N, 3 * W),
    # the stacked dim stays a dim of its own
    "kept": lambda q, k, v: torch.stack([q, k, v]).permute(1, 0, 2) * 2,
    # the stack read by something else too
    "read_twice": lambda q, k, v: _read_twice(torch.stack([q, k, v])),
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alike_stays(name):
    args = _pieces(1)
    before, after, n = rewrite(stack_cat, LOOK_ALIKES[name], *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)
