"""Rule `index_expand`: an integer index expanded to the shape all indices broadcast to anyway
enters `index` / `index_put` as itself; bit-equal reads and writes (an accumulating put and its
duplicates included). Left alone: an expand that decides the broadcast shape (the only index,
or one that grows a dim no other index grows) and a mask index. End to end: spell11's MLA cache
write of verify rows (tests/e2e/test_spell11_spelling.py)."""

from __future__ import annotations

import pytest
import torch

from .compiled import assert_same_values, canonicalize, targets
from .router_spellings import only

B, T, S, L, R = 2, 3, 4, 6, 5


def _args(dtype=torch.int64):
    g = torch.Generator().manual_seed(0)
    return {"cache": torch.randn(S, L, R, generator=g),
            "slots": torch.tensor([2, 0], dtype=dtype),
            "pos": (torch.tensor([[0], [3]]) + torch.arange(T)).to(dtype),
            "rows": torch.randn(B, T, R, generator=g)}


def write_expanded(cache, slots, pos, rows):  # spell11's cache write of T verify rows
    cache.index_put_((slots[:, None].expand(B, T), pos), rows)
    return cache[slots].sum()


def write_expanded_twice(cache, slots, pos, rows):  # a chain: [B] -> [B, 1] -> [B, T]
    cache.index_put_((slots.view(B, 1).expand(B, 1).expand(-1, T), pos), rows)
    return cache.sum()


def read_expanded(cache, slots, pos, rows):  # a read: cache[s, p] rows
    return cache[slots[:, None].expand(B, T), pos] * rows


def accumulate_expanded(cache, slots, pos, rows):  # both requests on slot 2: the duplicates add
    s = slots.clone().fill_(2)[:, None].expand(B, T)
    return cache.index_put((s, pos.clone().fill_(1)), rows, accumulate=True)


FAITHFUL = {"write": write_expanded, "write_chain": write_expanded_twice,
            "read": read_expanded, "accumulate": accumulate_expanded}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("name", sorted(FAITHFUL))
def test_an_index_expanded_to_the_broadcast_shape_enters_as_itself(name, dtype):
    c = canonicalize(FAITHFUL[name], _args(dtype), **only("index_expand"))
    assert c.counts["index_expand"] == 1
    assert "aten.expand.default" in targets(c.before)
    assert "aten.expand.default" not in targets(c.after)
    assert_same_values(c, rel=0)


LOOKALIKES = {
    # the only index: the expand decides the result's shape ([B, T] rows, not [B])
    "only_index": lambda cache, slots, pos, rows: cache[slots[:, None].expand(B, T)].sum(-1),
    # the other index is [B, 1]: only the expand grows T
    "grows_a_dim": lambda cache, slots, pos, rows:
        cache[slots[:, None].expand(B, T), pos[:, :1]] * rows,
    # a mask index is not broadcast with the others
    "mask": lambda cache, slots, pos, rows:
        cache.index_put(((cache[:, :1, 0] > 0).expand(S, L),), rows[0, 0]),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_an_expand_that_decides_the_shape_stays(name):
    c = canonicalize(LOOKALIKES[name], _args(), **only("index_expand"))
    assert c.counts.get("index_expand", 0) == 0
    assert "aten.expand.default" in targets(c.after)
    assert_same_values(c, rel=0)
