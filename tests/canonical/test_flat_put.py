"""flat_put: whole state rows written out of place by `Tensor.put` at flat indices `slot * per +
arange(per)` (spell12's put_rows) become `index_put(buf, [slots], rows)`, bit for bit; partial
rows, accumulating puts and other strides stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import flat_put

from .rule_checks import assert_same, rewrite, targets

aten = torch.ops.aten
_rewrite = functools.partial(rewrite, flat_put)
SLOTS = torch.tensor([3, 0])


def put_rows(buf, slots, rows):
    """tests/models/spell12_k3.py's put_rows"""
    per = buf[0].numel()
    flat = slots[:, None] * per + torch.arange(per, device=buf.device)
    return buf.put(flat, rows.reshape(len(slots), per).to(buf.dtype))


def conv_state(buf, slots, x):
    """a conv state's new tail, a non-contiguous slice of the window (reshaped by a copy)"""
    window = torch.cat([buf[slots], x], -1)
    return put_rows(buf, slots, window[..., -buf.shape[-1]:])


def recurrent(buf, slots, x):
    """a 4-D fp32 state, the rows computed"""
    return put_rows(buf, slots, buf[slots] * 0.5 + x)


CASES = {conv_state: lambda dt: (torch.randn(5, 6, 3).to(dt), SLOTS, torch.randn(2, 6, 1).to(dt)),
         recurrent: lambda dt: (torch.randn(5, 2, 4, 4), SLOTS, torch.randn(2, 2, 4, 4))}


@pytest.mark.parametrize("fn", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_puts_become_index_put(fn, dtype):
    args = CASES[fn](dtype)
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    (put,) = [node for node in after.graph.nodes if node.target is aten.index_put.default]
    assert put.args[0].op == "placeholder" and put.args[1][0].op == "placeholder"
    assert put.meta["val"].shape == args[0].shape
    assert_same(after(*args), before(*args))


def partial_rows(buf, slots, x):
    """MLA's cache form: half a row at (slot * 2 + 1) * per"""
    per = buf.shape[-1] // 2
    flat = (slots[:, None] * 2 + 1) * per + torch.arange(per)
    return buf.put(flat, x.reshape(len(slots), per))


def half_row(buf, slots, x):
    """the index of a row of buf, but only its first half written"""
    per = buf[0].numel()
    flat = slots[:, None] * per + torch.arange(per // 2)
    return buf.put(flat, x.reshape(len(slots), per // 2))


def accumulate(buf, slots, x):
    per = buf[0].numel()
    return buf.put(slots[:, None] * per + torch.arange(per), x.reshape(len(slots), per),
                   accumulate=True)


@pytest.mark.parametrize("fn", [partial_rows, half_row, accumulate])
def test_look_alikes_stay(fn):
    args = (torch.randn(5, 8), SLOTS, torch.randn(2, 8 if fn is accumulate else 4))
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), before(*args))
