"""put_rows: whole rows of a state written by `Tensor.put` at flat element indices (spell12's
`(slot * L + pos) * (C + R) + arange(C + R)` MLA cache write and `slot * numel + arange` state
writes) become index_put of those rows: bit-equal, a negative row included (put wraps the flat
index where index_put wraps the row). An accumulating put, an offset, a partial row, another
stride, an arange not from 0 and an int32 index stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import put_rows
from tests.canonical.rule_checks import assert_same, rewrite, targets

_rewrite = functools.partial(rewrite, put_rows.RULE)
S, L, W = 5, 6, 12  # slots, cache length, row width (MLA: C + R)
B, T = 2, 3


def _cache_inputs(slots=(3, 1)):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(S, L, W, generator=gen)
    pos = torch.tensor([[0, 1, 2], [3, 4, 5]])
    return cache, torch.tensor(slots), pos, torch.randn(B, T, W, generator=gen)


def _mla(cache, slots, pos, rows):  # spell12's latent cache write, and the read after it
    flat = (slots[:, None] * L + pos)[..., None] * W + torch.arange(W)
    new = cache.put(flat, rows)
    return new, new[slots]


def _mla_scaled_first(cache, slots, pos, rows):  # unsqueeze(X * W) + arange, arange first
    flat = torch.arange(W) + ((slots[:, None] * L + pos) * W).unsqueeze(-1)
    return cache.put(flat, rows)


def _state_inputs(slots=(3, 1)):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(S, 2, 4, 4, generator=gen), torch.tensor(slots),
            torch.randn(B, 2, 4, 4, generator=gen))


def _state(state, slots, new):  # spell12's put_rows: a whole slot's state
    per = state[0].numel()
    flat = slots[:, None] * per + torch.arange(per)
    return state.put(flat, new.reshape(len(slots), per))


@pytest.mark.parametrize("fn", [_mla, _mla_scaled_first])
@pytest.mark.parametrize("slots", [(3, 1), (-1, 2)])
def test_cache_rows_put_become_a_row_write(fn, slots):
    args = _cache_inputs(slots)
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    puts = [nd for nd in after.graph.nodes if nd.target is torch.ops.aten.index_put.default]
    assert len(puts) == 1 and list(puts[0].args[0].meta["val"].shape) == [S * L, W]
    assert_same(after(*args), before(*args))


@pytest.mark.parametrize("slots", [(3, 1), (-1, 2)])
def test_whole_slot_put_becomes_index_put_of_the_slots(slots):
    args = _state_inputs(slots)
    before, after, n = _rewrite(_state, *args)
    assert n == 1
    (put,) = [nd for nd in after.graph.nodes if nd.target is torch.ops.aten.index_put.default]
    assert put.args[0].op == "placeholder" and put.args[1][0].op == "placeholder"
    assert put.args[2].op == "placeholder"  # the new state itself, not a view of its flat rows
    assert_same(after(*args), before(*args))


def _accumulate(state, slots, new):
    per = state[0].numel()
    return state.put(slots[:, None] * per + torch.arange(per), new.reshape(B, per),
                     accumulate=True)


def _offset(state, slots, new):
    per = state[0].numel()
    return state.put(slots[:, None] * per + torch.arange(per) + 1, new.reshape(B, per))


def _partial_row(state, slots, new):
    per = state[0].numel()
    return state.put(slots[:, None] * per + torch.arange(per - 4), new.reshape(B, per)[:, 4:])


def _other_stride(state, slots, new):
    per = state[0].numel()
    return state.put(slots[:, None] * (per - 8) + torch.arange(per), new.reshape(B, per))


def _arange_from_one(state, slots, new):
    per = state[0].numel()
    return state.put(slots[:, None] * per + torch.arange(1, per + 1) - 1 + 0 * slots[:, None],
                     new.reshape(B, per))


def _int32_rows(state, slots, new):
    per = state[0].numel()
    return state.put(slots[:, None].int() * per + torch.arange(per, dtype=torch.int32),
                     new.reshape(B, per))


@pytest.mark.parametrize("fn", [_accumulate, _offset, _partial_row, _other_stride,
                                _arange_from_one, _int32_rows])
def test_other_flat_writes_stay(fn):
    args = _state_inputs((1, 3))
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), before(*args))
