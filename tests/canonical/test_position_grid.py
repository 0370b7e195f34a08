"""position_grid: token positions built token-major [T, B] and transposed (spell13's
sequence-first grid) become `positions.view(B, 1) + arange(T)`, a grid for each reader, bit for
bit; look-alikes stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import position_grid
from tests.models.spell13_k3 import PROBES, from_builtin
from tests.spellings import foreign

from .rule_checks import assert_same, rewrite, targets

aten = torch.ops.aten
_rewrite = functools.partial(rewrite, position_grid)


def spell13_grid(positions, x):
    """tests/models/spell13_k3.py: [T, B] positions, transposed for the write and the mask."""
    T = x.shape[1]
    pos = positions[None, :] + torch.arange(T)[:, None]
    return pos.t() * 3, (torch.arange(8) <= pos.t()[..., None]).float() + x[..., None]


def column_first(positions, x):
    """A second spelling: the arange's column first, both views, `permute`."""
    T, B = x.shape[1], positions.shape[0]
    return (torch.arange(T).view(T, 1) + positions.view(1, B)).permute(1, 0) + x.long()


def canonical(positions, x):
    return positions.view(positions.shape[0], 1) + torch.arange(x.shape[1])


@pytest.mark.parametrize("fn,readers", [(spell13_grid, 2), (column_first, 1)])
@pytest.mark.parametrize("T", [1, 3])
def test_the_grid_is_built_request_major(fn, readers, T):
    positions, x = torch.tensor([4, 0]), torch.randn(2, T)
    before, after, n = _rewrite(fn, positions, x)
    assert n == 1
    assert "aten.permute.default" not in targets(after)
    grids = [g for g in after.graph.nodes if g.target is aten.add.Tensor
             and [a.target for a in g.args] == [aten.view.default, torch.ops.prims.iota.default]]
    assert len(grids) == readers and all(len(g.users) == 1 for g in grids)  # one per reader
    assert_same(after(positions, x), before(positions, x))
    assert grids[0].meta["val"].shape == canonical(positions, x).shape


def from_one(positions, x):  # arange(1, T + 1): the next positions, not these
    T = x.shape[1]
    return (positions[None, :] + torch.arange(1, T + 1)[:, None]).t() + x.long()


def scaled_steps(positions, x):
    T = x.shape[1]
    return (positions[None, :] + 2 * torch.arange(T)[:, None]).t() + x.long()


def two_vectors(positions, x):
    return (positions[None, :] + positions.flip(0)[:, None]).t() + x.long()[:1]


def float_grid(positions, x):
    T = x.shape[1]
    return (positions.float()[None, :] + torch.arange(T).float()[:, None]).t() + x


def kept_token_major(positions, x):  # read [T, B], never transposed
    T = x.shape[1]
    return (positions[None, :] + torch.arange(T)[:, None]) + x.long().t()


@pytest.mark.parametrize("fn", [from_one, scaled_steps, two_vectors, float_grid,
                                kept_token_major])
def test_look_alikes_stay(fn):
    positions, x = torch.tensor([4, 0]), torch.randn(2, 2)
    before, after, n = _rewrite(fn, positions, x)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(positions, x), before(positions, x))


# ---- on the spelling the rule was written for (slow: compiles tests/models/spell13_k3.py) ----


@pytest.mark.slow
def test_position_grid_takes_the_transposed_positions():
    """All probes on (kv_b stored 2-D, probe `kvb`: rule mla_absorbed reads the attention):
    mla_decode (2, 3) fuses with rule position_grid and is lost without it (its write and mask
    read the transposed sequence-first positions) (fp32)."""
    for rules, want in (((), 1), (("position_grid",), 0)):
        got = foreign.plan_with_rules_off(from_builtin, rules, tuple(PROBES))
        assert got[2]["mla_decode"] == got[3]["mla_decode"] == want, (rules, got[2])
