"""Rule `paged_write`: a cache row written through a flat slot mapping (the cache viewed as
[slots * L, R], rows at `slot * L + position`) becomes `index_put(cache, [slot, pos], rows)`; the
rewritten graph computes the same outputs and the same new cache as the unrewritten one (and as
eager). Look-alikes (another multiplier than L, an accumulating write, a flat write into a tensor
that is not written back) are left alone, and a position past the cache is refused by the
compiled step's input check in the flat spelling as in the canonical one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .compiled import assert_same_values, canonicalize, targets

S, L, R = 5, 8, 6  # cache [slots, max_len, row]
aten = torch.ops.aten


class Cache(nn.Module):
    """A step that writes T rows per request with `write(cache, rows, slots, pos)` and returns
    the cache rows of its slots (so the write's values reach the output too)."""

    def __init__(self, write):
        super().__init__()
        self.register_buffer("cache", torch.randn(S, L, R, generator=torch.Generator().manual_seed(3)))
        self.write = write

    def forward(self, rows, slots, positions):
        pos = positions.unsqueeze(1) + torch.arange(rows.shape[1])
        self.write(self.cache, rows, slots, pos)
        return self.cache[slots] * 2


def flat_copy(cache, rows, slots, pos):  # vLLM's slot_mapping, index_copy_
    flat = (slots.unsqueeze(1) * L + pos).reshape(-1)
    cache.view(-1, R).index_copy_(0, flat, rows.reshape(-1, R))


def flat_setitem(cache, rows, slots, pos):  # the same mapping, position first, setitem
    flat = (pos + L * slots.view(-1, 1)).flatten()
    cache.view(S * L, R)[flat] = rows.flatten(0, 1)


def flat_rows_1d(cache, rows, slots, pos):  # one token per request: [B] indices, rows [B, R]
    cache.view(-1, R).index_copy_(0, slots * L + pos[:, 0], rows[:, 0])


def _step(write, rows_shape=(2, 1, R), slots=(3, 1), positions=(0, 5)):
    rows = torch.randn(*rows_shape, generator=torch.Generator().manual_seed(0))
    args = {"rows": rows, "slots": torch.tensor(slots), "positions": torch.tensor(positions)}
    compiled, eager = Cache(write), Cache(write)
    c = canonicalize(None, args, module=compiled)
    with torch.no_grad():
        want = eager(*args.values())
    assert torch.equal(c.output, want)
    return c, compiled.cache, eager.cache


def _slot_pos_write(c, indices: int = 2):
    (put,) = [n for n in c.after.graph.nodes if n.target is aten.index_put.default]
    assert put.args[0].op == "placeholder" and len(put.args[1]) == indices
    assert any(u.target is aten.copy_.default for u in put.users)


@pytest.mark.parametrize("write,rows_shape", [(flat_copy, (2, 1, R)), (flat_copy, (2, 3, R)),
                                              (flat_setitem, (2, 3, R)),
                                              (flat_rows_1d, (2, 1, R))])
def test_flat_slot_mapping_becomes_a_slot_position_write(write, rows_shape):
    c, state, eager_state = _step(write, rows_shape)
    assert c.counts["paged_write"] == 1
    _slot_pos_write(c)
    assert_same_values(c, rel=0)
    assert torch.equal(state, eager_state)


def test_batch_1_writes_the_same_rows():
    c, state, eager_state = _step(flat_copy, (1, 1, R), slots=(4,), positions=(7,))
    assert c.counts["paged_write"] == 1
    assert_same_values(c, rel=0)
    assert torch.equal(state, eager_state)


# ---- look-alikes left alone ---------------------------------------------------------------------

def other_stride(cache, rows, slots, pos):  # slot * (L - 2) + pos: not a row of a slot
    cache.view(-1, R).index_copy_(0, (slots.unsqueeze(1) * (L - 2) + pos).reshape(-1),
                                  rows.reshape(-1, R))


def accumulate(cache, rows, slots, pos):  # adds into the rows: another computation
    cache.view(-1, R).index_put_(((slots.unsqueeze(1) * L + pos).reshape(-1),),
                                 rows.reshape(-1, R), accumulate=True)


@pytest.mark.parametrize("write", [other_stride, accumulate])
def test_look_alikes_are_left_alone(write):
    c, state, eager_state = _step(write, (2, 2, R))
    assert c.counts["paged_write"] == 0
    assert targets(c.after).count("aten.index_put.default") == targets(c.before).count(
        "aten.index_put.default")
    assert_same_values(c, rel=0)
    assert torch.equal(state, eager_state)


def test_a_flat_write_into_a_temporary_is_left_alone():
    """index_put into a view of a graph input that is returned, not written back: no state."""

    def fn(cache, rows, slots, positions):
        flat = slots * L + positions
        return cache.view(-1, R).index_put((flat,), rows).view(S, L, R)

    args = {"cache": torch.randn(S, L, R), "rows": torch.randn(2, R),
            "slots": torch.tensor([3, 1]), "positions": torch.tensor([0, 5])}
    c = canonicalize(fn, args)
    assert c.counts["paged_write"] == 0
    assert torch.equal(c.output, fn(*args.values()))


@pytest.mark.parametrize("write", [flat_copy, flat_rows_1d])
def test_a_position_past_the_cache_is_refused_before_any_write(write):
    """The flat write would land in the next slot's rows; the compiled step refuses the call."""
    model = Cache(write)
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "keep_graphs": False})
    rows = torch.randn(2, 1, R)
    with torch.no_grad():
        step(rows, torch.tensor([3, 1]), torch.tensor([0, 5]))
        before = model.cache.clone()
        with pytest.raises(ValueError, match="positions"):
            step(rows, torch.tensor([3, 1]), torch.tensor([0, L]))
    assert torch.equal(model.cache, before)
