"""put_rows: whole rows of a state written by `Tensor.put` at flat element indices (spell12's
`(slot * L + pos) * (C + R) + arange(C + R)` MLA cache write and `slot * numel + arange` state
writes) become index_put of those rows: bit-equal, a negative row included (put wraps the flat
index where index_put wraps the row), the rows written as the tensor the put's values are a
reshape or contiguous copy of (what rule `state_write` and the KDA rules read). An int32 row
index is taken where eager takes it (the flat index int64); an int32 flat index, which eager
refuses, is left as it is. An accumulating put, an offset, a partial row, another stride and an
arange not from 0 stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import put_rows
from k3compile.graph import RESHAPES
from tests.canonical.rule_checks import assert_same, rewrite, targets

aten = torch.ops.aten
_rewrite = functools.partial(rewrite, put_rows.RULE)
S, L, W = 5, 6, 12  # slots, cache length, row width (MLA: C + R)
B, T = 2, 3


def _index_puts(gm):
    return [nd for nd in gm.graph.nodes if nd.target is aten.index_put.default]


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


def _state_inputs(slots=(3, 1), dtype=torch.int64):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(S, 2, 4, 4, generator=gen), torch.tensor(slots, dtype=dtype),
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
    (put,) = _index_puts(after)
    assert list(put.args[0].meta["val"].shape) == [S * L, W]
    assert_same(after(*args), before(*args))


@pytest.mark.parametrize("slots", [(3, 1), (-1, 2)])
def test_whole_slot_put_becomes_index_put_of_the_slots(slots):
    args = _state_inputs(slots)
    before, after, n = _rewrite(_state, *args)
    assert n == 1
    (put,) = _index_puts(after)
    assert put.args[0].op == "placeholder" and put.args[1][0].op == "placeholder"
    assert put.args[2].op == "placeholder"  # the new state itself, not a view of its flat rows
    assert_same(after(*args), before(*args))


def _put_slots(buf, slots, rows):
    """tests/models/spell12_k3.py's put_rows"""
    per = buf[0].numel()
    flat = slots[:, None] * per + torch.arange(per, device=buf.device)
    return buf.put(flat, rows.reshape(len(slots), per).to(buf.dtype))


def _conv_state(buf, slots, x):
    """a conv state's new tail, a non-contiguous slice of the window (reshaped by a copy)"""
    window = torch.cat([buf[slots], x], -1)
    return _put_slots(buf, slots, window[..., -buf.shape[-1]:])


def _recurrent(buf, slots, x):
    """a 4-D state, the rows computed"""
    return _put_slots(buf, slots, buf[slots] * 0.5 + x)


SLOTS = torch.tensor([3, 0])
KDA_CASES = {_conv_state: lambda dt: (torch.randn(5, 6, 3).to(dt), SLOTS,
                                      torch.randn(2, 6, 1).to(dt)),
             _recurrent: lambda dt: (torch.randn(5, 2, 4, 4).to(dt), SLOTS,
                                     torch.randn(2, 2, 4, 4).to(dt))}


@pytest.mark.parametrize("fn", list(KDA_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_rows_are_written_as_the_rows_computed(fn, dtype):
    """The values' reshapes and copies are climbed: the conv state's new rows are written as the
    window's slice itself, the recurrent state's as the sum, which the KDA rules read."""
    args = KDA_CASES[fn](dtype)
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    (put,) = _index_puts(after)
    assert put.args[0].op == "placeholder" and put.args[1][0].op == "placeholder"
    rows = put.args[2]
    assert rows.target in (aten.slice.Tensor, aten.add.Tensor), rows.target
    assert rows.target not in RESHAPES | {aten.clone.default}
    assert put.meta["val"].shape == args[0].shape
    assert_same(after(*args), before(*args))


def _int32_index(state, slots, new):  # the flat index int32 too: eager's put refuses it
    per = state[0].numel()
    return state.put(slots[:, None] * per + torch.arange(per, dtype=slots.dtype),
                     new.reshape(len(slots), per))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_row_index_eager_takes_is_taken_in_either_dtype(dtype):
    """int32 rows with the int64 arange: the flat index is int64 and eager's put takes it; so
    does the rewrite, equal to eager."""
    args = _state_inputs((3, -2), dtype)
    before, after, n = _rewrite(_state, *args)
    assert n == 1
    (put,) = _index_puts(after)
    assert put.args[1][0].meta["val"].dtype == dtype
    assert_same(after(*args), _state(*args))
    assert_same(after(*args), before(*args))


def test_an_int32_flat_index_eager_refuses_stays():
    """(Decomposed, the put is an index_put, which takes int32: torch's decomposition table, which
    Inductor and k3 both use, runs this graph where eager raises. The rule adds nothing to that.)"""
    args = _state_inputs((3, 1), torch.int32)
    with pytest.raises(RuntimeError, match="Expected a long tensor for index"):
        _int32_index(*args)
    before, after, n = _rewrite(_int32_index, *args)
    assert n == 0
    assert targets(after) == targets(before)


def test_an_int32_row_index_whose_product_may_wrap_is_not_read():
    """X·per is int32 for an int32 X: rows in range of a buffer of more than 2³¹ - 1 elements
    can wrap it, so row_index reads the index only for a buffer that fits int32."""
    args = _state_inputs((3, 1), torch.int32)
    gm = rewrite(put_rows.RULE, _state, *args)[0]
    (put,) = _index_puts(gm)
    index, per = put.args[1][0], args[0][0].numel()
    assert put_rows.row_index(index, per, args[0].numel()) is not None
    assert put_rows.row_index(index, per, 2**31) is None
    assert put_rows.row_index(index, per, 2**31 - 1) is not None


def _expanded_rows(cache, slots, pos, rows):
    """each request's slot row written T times over (X an expand: not viewable flat)"""
    flat = (slots * L)[:, None].expand(B, T)[..., None] * W + torch.arange(W)
    return cache.put(flat, rows)


def test_rows_that_cannot_be_viewed_flat_stay():
    args = _cache_inputs()
    before, after, n = _rewrite(_expanded_rows, *args)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), _expanded_rows(*args))


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


def _int16_rows(state, slots, new):  # eager takes it; index_put refuses an int16 index
    per = state[0].numel()
    return state.put(slots[:, None].short() * per + torch.arange(per), new.reshape(B, per))


@pytest.mark.parametrize("fn", [_accumulate, _offset, _partial_row, _other_stride,
                                _arange_from_one, _int16_rows])
def test_other_flat_writes_stay(fn):
    args = _state_inputs((1, 3))
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), before(*args))
    assert_same(after(*args), fn(*args))


def _half_cache_row(buf, slots, x):
    """MLA's cache form on a [S, 2·per] buffer: half a row at (slot * 2 + 1) * per"""
    per = buf.shape[-1] // 2
    flat = (slots[:, None] * 2 + 1) * per + torch.arange(per)
    return buf.put(flat, x.reshape(len(slots), per))


def _half_row(buf, slots, x):
    """the index of a row of buf, but only its first half written"""
    per = buf[0].numel()
    flat = slots[:, None] * per + torch.arange(per // 2)
    return buf.put(flat, x.reshape(len(slots), per // 2))


@pytest.mark.parametrize("fn", [_half_cache_row, _half_row])
def test_partial_rows_of_a_2d_buffer_stay(fn):
    args = (torch.randn(5, 8), SLOTS, torch.randn(2, 4))
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), before(*args))
    assert_same(after(*args), fn(*args))
