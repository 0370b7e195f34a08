"""Rule `scatter_rows`: a paged cache-row write spelled as `scatter_` of whole rows (the index one
column broadcast over the row) becomes the `index_put` that `index_copy_` traces to, which rule
`paged_write` then turns into `index_put(cache, [slot, pos], rows)`; the rewritten graph computes
the same outputs and the same new cache as the unrewritten one and as eager, on two spellings.
Look-alikes (an index that differs per column, a scatter along the row, a scatter_add, a scatter
into a flat index that is not `slot * L + pos`) are left alone."""

from __future__ import annotations

import pytest
import torch

from tests.canonical.test_paged_write import Cache, L, R, S, _slot_pos_write, _step

from .compiled import assert_same_values, canonicalize

aten = torch.ops.aten


def scatter_expand(cache, rows, slots, pos):  # spell7: unsqueeze(-1).expand, in place
    flat = (slots.unsqueeze(1) * L + pos).reshape(-1)
    n = flat.shape[0]
    cache.view(-1, R).scatter_(0, flat.unsqueeze(-1).expand(n, R), rows.reshape(-1, R))


def scatter_view(cache, rows, slots, pos):  # a [N, 1] view of the mapping, expand_as
    flat = (pos + L * slots.view(-1, 1)).flatten()
    src = rows.flatten(0, 1)
    cache.view(S * L, R).scatter_(0, flat.view(-1, 1).expand_as(src), src)


def scatter_grid(cache, rows, slots, pos):  # spell6: the [B, T] mapping viewed [N, 1] itself
    flat_idx = (slots.unsqueeze(1) * L + pos).reshape(-1, 1).expand(-1, R)
    cache.view(-1, R).scatter_(0, flat_idx, rows.reshape(-1, R))


@pytest.mark.parametrize("write,rows_shape", [(scatter_expand, (2, 1, R)),
                                              (scatter_expand, (2, 3, R)),
                                              (scatter_view, (2, 3, R)),
                                              (scatter_grid, (2, 1, R)),
                                              (scatter_grid, (2, 3, R))])
def test_row_scatter_becomes_a_slot_position_write(write, rows_shape):
    c, state, eager_state = _step(write, rows_shape)
    assert c.counts["scatter_rows"] == 1 and c.counts["paged_write"] == 1
    _slot_pos_write(c)
    assert not any(n.target is aten.scatter.src for n in c.after.graph.nodes)
    assert_same_values(c, rel=0)
    assert torch.equal(state, eager_state)


@pytest.mark.parametrize("positions", [(0, L), (-1, 5)])
def test_a_position_outside_the_cache_is_refused_before_any_write(positions):
    """spell6's grid scatter: past the cache the flat row lands in the next slot's rows, below it
    in the previous slot's (eager writes both silently); the compiled step refuses the call."""
    model = Cache(scatter_grid)
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "keep_graphs": False})
    rows = torch.randn(2, 1, R)
    with torch.no_grad():
        step(rows, torch.tensor([3, 1]), torch.tensor([0, 5]))
        before = model.cache.clone()
        with pytest.raises(ValueError, match="positions"):
            step(rows, torch.tensor([3, 1]), torch.tensor(positions))
    assert torch.equal(model.cache, before)


def per_column(cache, rows, slots, pos):  # each column its own row: not a row write
    flat = (slots.unsqueeze(1) * L + pos).reshape(-1, 1) + torch.arange(R) % 2
    cache.view(-1, R).scatter_(0, flat, rows.reshape(-1, R))


def along_the_row(cache, rows, slots, pos):  # dim 1: within a row
    idx = torch.arange(R).flip(0).expand(S * L, R)
    cache.view(-1, R).scatter_(1, idx, cache.view(-1, R) * 0 + rows.reshape(-1)[0])


def scatter_add(cache, rows, slots, pos):  # accumulates
    flat = (slots.unsqueeze(1) * L + pos).reshape(-1)
    n = flat.shape[0]
    cache.view(-1, R).scatter_add_(0, flat.unsqueeze(-1).expand(n, R), rows.reshape(-1, R))


def other_multiplier(cache, rows, slots, pos):  # slot * (L - 1) + pos: not a row of a slot
    flat = (slots.unsqueeze(1) * (L - 1) + pos).reshape(-1)
    n = flat.shape[0]
    cache.view(-1, R).scatter_(0, flat.unsqueeze(-1).expand(n, R), rows.reshape(-1, R))


@pytest.mark.parametrize("write", [per_column, along_the_row, scatter_add, other_multiplier])
def test_look_alike_is_left_alone(write):
    rows = torch.randn(2, 1, R, generator=torch.Generator().manual_seed(0))
    args = {"rows": rows, "slots": torch.tensor([3, 1]), "positions": torch.tensor([0, 5])}
    compiled, eager = Cache(write), Cache(write)
    c = canonicalize(None, args, module=compiled)
    with torch.no_grad():
        want = eager(*args.values())
    assert c.counts.get("scatter_rows", 0) == 0
    assert torch.equal(c.output, want) and torch.equal(compiled.cache, eager.cache)
