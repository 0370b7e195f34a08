"""where_scatter: one entry of a bank written by a one-hot `where` over an `arange` (spell13's
AttnRes block bank) becomes the `select_scatter` of slice assignment, bit for bit, so that rule
depth_mix reads the bank's written blocks; look-alikes stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import depth_mix, where_scatter
from tests.conftest import rel_err
from tests.models.spell13_k3 import PROBES, from_builtin
from tests.spellings import foreign

from .rule_checks import assert_same, rewrite, rewritten, targets

aten = torch.ops.aten
_rewrite = functools.partial(rewrite, where_scatter)
NB, T, B, D, EPS = 3, 1, 2, 16, 1e-5


def spell13_bank(x0, x1):
    """tests/models/spell13_k3.py: a zero [NB, T, B, D] bank, slot j written by a depth one-hot."""
    bank = x0.new_zeros(NB, *x0.shape)
    depth = torch.arange(NB)[:, None, None, None]
    bank = torch.where(depth == 0, x0[None], bank)
    return torch.where(depth == 2, x1[None], bank)


def batch_major_bank(x0, x1):
    """A second spelling: a [T, B, NB, D] bank, the slot dim third, the mask an arange viewed."""
    bank = torch.ones(*x0.shape[:-1], NB, D, dtype=x0.dtype)
    hot = torch.arange(0, NB).view(1, 1, NB, 1)
    bank = torch.where(hot == 1, x0.unsqueeze(2), bank)
    return torch.where(hot == 0, x1.unsqueeze(-2), bank) * 2


def broadcast_row(x0, x1):
    """The row left 3-D, broadcast over the slots by the where itself (k = 0)."""
    bank = torch.where(torch.arange(NB)[:, None, None, None] == 1, x0, x1.expand(NB, T, B, D))
    return bank.sum(0)


@pytest.mark.parametrize("fn,sites", [(spell13_bank, 2), (batch_major_bank, 2),
                                      (broadcast_row, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_hot_writes_become_select_scatters(fn, sites, dtype):
    x0, x1 = (torch.randn(T, B, D).to(dtype) for _ in range(2))
    before, after, n = _rewrite(fn, x0, x1)
    assert n == sites
    assert "aten.where.self" not in targets(after)
    assert targets(after).count("aten.select_scatter.default") == sites
    assert_same(after(x0, x1), before(x0, x1))


def swapped(x0, x1):  # the entry keeps the bank, the rest is x0
    return torch.where(torch.arange(NB)[:, None, None, None] == 1, x1.expand(NB, T, B, D),
                       x0[None])


def other_comparison(x0, x1):  # slots 0..1 written: no one-hot
    return torch.where(torch.arange(NB)[:, None, None, None] <= 1, x0[None],
                       x1.expand(NB, T, B, D) + 0)


def out_of_range(x0, x1):  # no slot is hot: the where is the bank
    return torch.where(torch.arange(NB)[:, None, None, None] == NB, x0[None],
                       x1.expand(NB, T, B, D) + 0)


def two_dims(x0, x1):  # the one-hot over slots x tokens
    hot = torch.arange(NB * B).view(NB, 1, B, 1) == 1
    return torch.where(hot, x0[None], x1.expand(NB, T, B, D) + 0)


def row_broadcast_elsewhere(x0, x1):  # the row [1, T, 1, D] spread over B too
    return torch.where(torch.arange(NB)[:, None, None, None] == 1, x0[None, :, :1],
                       x1.expand(NB, T, B, D) + 0)


def promoted(x0, x1):  # an fp32 row into a bf16 bank: the where is fp32
    return torch.where(torch.arange(NB)[:, None, None, None] == 1, x0[None].float(),
                       x1.to(torch.bfloat16).expand(NB, T, B, D))


@pytest.mark.parametrize("fn", [swapped, other_comparison, out_of_range, two_dims,
                                row_broadcast_elsewhere, promoted])
def test_look_alikes_stay(fn):
    x0, x1 = torch.randn(T, B, D), torch.randn(T, B, D)
    before, after, n = _rewrite(fn, x0, x1)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(x0, x1), before(x0, x1))


def _mix(prefix, bank, n, wn, wp):
    """spell13's mix with probe `mix` on: the n written slots and the prefix, torch.softmax."""
    src = torch.cat([bank[:n], prefix[None]], 0).float()
    inv = torch.rsqrt(src.pow(2).mean(-1) + EPS)
    s = (src * inv[..., None] * (wn.float() * wp.float())).sum(-1)
    return (torch.softmax(s, 0)[..., None] * src).sum(0).to(prefix.dtype)


def _banked_mixes(x0, x1, prefix, wn, wp):
    bank = spell13_bank(x0, torch.zeros_like(x0))  # slot 0 written, slot 2 a written zero
    depth = torch.arange(NB)[:, None, None, None]
    first = _mix(prefix, bank, 1, wn, wp)
    bank = torch.where(depth == 1, x1[None], bank)
    return first, _mix(prefix, bank, 2, wn, wp)


def test_depth_mix_reads_the_written_bank():
    """With where_scatter first, depth_mix takes both mixes over the one-hot-written bank (its
    written slots are the sources); without it, neither (the where hides what was written)."""
    args = [torch.randn(T, B, D) for _ in range(3)] + [torch.randn(D), torch.randn(D)]
    want = _banked_mixes(*args)
    _, (mixes,) = rewritten(_banked_mixes, args, depth_mix.RULE)
    assert mixes == 0
    gm, (writes, mixes) = rewritten(_banked_mixes, args, where_scatter.RULE, depth_mix.RULE)
    assert (writes, mixes) == (3, 2)
    for got, ref in zip(gm(*args), want, strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-6


# ---- on the spelling the rule was written for (slow: compiles tests/models/spell13_k3.py) ----


@pytest.mark.slow
def test_where_scatter_takes_the_one_hot_block_bank():
    """All probes on but `bank` (the bank written by slice assignment): both AttnRes mixes of
    every layer (attn_res_mix_norm 1-3 and the output's, oproj_attn_res_mix_norm 0-3) fuse with
    rule where_scatter and are lost without it (fp32)."""
    probes = tuple(p for p in PROBES if p != "bank")
    for rules, want in (((), 1), (("where_scatter",), 0)):
        got = foreign.plan_with_rules_off(from_builtin, rules, probes)
        mixes = [got[i]["attn_res_mix_norm"] for i in (1, 2, 3, -1)]
        mixes += [got[i]["oproj_attn_res_mix_norm"] for i in range(4)]
        assert mixes == [want] * 8, (rules, got)
