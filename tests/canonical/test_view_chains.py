"""view_chains: a view chain that forks into further views becomes one chain per read (the form
`k3compile/math.py`'s `delta_rule_step` traces to), with the same values; a view read twice by
computing ops, and unforked chains, stay."""

from __future__ import annotations

import torch

from k3compile.canonical import view_chains
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite
from tests.fusions.pattern_checks import graph

B, T, H, K = 2, 3, 2, 4


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, K, generator=g), torch.randn(B, H, K, K, generator=g)


def delta_shared(k, state):  # k_t read once, used twice (transformers-style loop)
    k_t = k[:, 1]
    kv = torch.einsum("bhkv,bhk->bhv", state, k_t)
    return state + k_t.unsqueeze(-1) * kv.unsqueeze(-2)


def delta_per_read(k, state):  # our math.delta_rule_step: one select per read
    kv = torch.einsum("bhkv,bhk->bhv", state, k[:, 1])
    return state + k[:, 1].unsqueeze(-1) * kv.unsqueeze(-2)


def _forks(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes if view_chains.is_view(n) and len(n.users) > 1
            and any(view_chains.is_whole_view(u) for u in n.users)]


def test_shared_read_becomes_one_select_per_read():
    args = _inputs()
    before, after, n = rewrite(view_chains, delta_shared, *args)
    assert n >= 1 and ops(before)["select.int"] == 1
    assert ops(after) == ops(graph(delta_per_read, *args))  # the canonical form's ops exactly
    assert ops(after)["select.int"] == 2 and not _forks(after)
    assert_same(before, after, args)
    torch.testing.assert_close(after(*args), delta_per_read(*args), rtol=0, atol=0)


def test_fork_deep_in_a_chain_is_split_up_to_the_part_taken():
    def fn(x, _):
        t = x.transpose(1, 2).reshape(B, K * H, T).permute(0, 2, 1)  # read whole twice
        return t.unsqueeze(0) * 2, t.unsqueeze(-1) + 1

    args = _inputs(1)
    before, after, n = rewrite(view_chains, fn, *args)
    assert _forks(before) and not _forks(after)
    assert n >= 2 and sum(ops(after).values()) == sum(ops(before).values()) + n
    assert_same(before, after, args)


def test_parts_of_one_view_stay_shared():
    """v.view(...) read per token (`v[:, t]`, the patterns' own loops): different parts."""
    def fn(k, s):
        v = k.view(B, T, H * K)
        return sum(v[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2) for t in range(T))

    args = _inputs(4)
    before, after, n = rewrite(view_chains, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)


def test_view_read_by_two_computing_ops_stays():
    """x in x * rsqrt(x²) (l2norm of a view) is one value read twice in every spelling."""
    def fn(k, _):
        x = k.view(B, T, H * K)
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    args = _inputs(2)
    before, after, n = rewrite(view_chains, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)


def test_unforked_chain_and_per_read_form_stay():
    for fn in (delta_per_read, lambda k, s: k[:, 0].unsqueeze(-1) * s):
        args = _inputs(3)
        before, after, n = rewrite(view_chains, fn, *args)
        assert n == 0 and ops(after) == ops(before)
