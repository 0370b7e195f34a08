"""Rule cache_block: a functional cache update (the requests' block gathered, rows put in out of
place, the block read, then written back whole; spell9) becomes the row write and reads of the
written cache; the rewritten graph computes what the unrewritten one does, bit for bit, outputs
and cache (and eager's cache bit for bit), at one and several tokens, batch 1 and 2, written back by `index_copy_` or by
indexing. Look-alikes (the block changed otherwise, written back at other slots, gathered from
another buffer, rows put at another batch row, an accumulating put, a block never written back)
are left alone. Under the backend spell9's MLA gets the trio (tests/e2e/test_spell9_spelling.py,
`test_the_functional_cache_gets_the_mla_ops`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ..conftest import rel_err
from .compiled import ATEN_ONLY, assert_same_values, canonicalize

aten = torch.ops.aten
S, L, W = 6, 8, 4


def functional(cache, rows, slots, pos):
    """spell9's block: gathered, rows put in at (arange(B), pos), written back by index_copy_."""
    B = slots.shape[0]
    batch = torch.arange(B)[:, None].expand(B, pos.shape[1])
    return torch.index_put(cache[slots], (batch, pos), rows), "index_copy"


def setitem_back(cache, rows, slots, pos):  # written back by `cache[slots] = block`
    block, _ = functional(cache, rows, slots, pos)
    return block, "setitem"


def broadcast_rows(cache, rows, slots, pos):  # the batch index [B, 1], broadcast by index_put
    return torch.index_put(cache[slots], (torch.arange(slots.shape[0])[:, None], pos), rows), \
        "index_copy"


def tokenless(cache, rows, slots, pos):  # one row per request: pos [B], rows [B, W]
    return torch.index_put(cache[slots], (torch.arange(slots.shape[0]), pos[:, 0]), rows[:, 0]), \
        "index_copy"


class Block(nn.Module):
    """Updates the requests' cache block as `spelling` does, returns a softmax-weighted read of
    it (every row, as attention over the whole block reads it), then writes the block back."""

    def __init__(self, spelling, write_back=None):
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.register_buffer("cache", torch.randn(S, L, W, generator=gen))
        self.register_buffer("other", torch.randn(S, L, W, generator=gen))
        self.spelling, self.write_back = spelling, write_back

    def forward(self, rows, slots, positions):
        pos = positions[:, None] + torch.arange(rows.shape[1])
        block, how = self.spelling(self.cache, rows, slots, pos)
        out = torch.softmax(block.sum(-1), -1).unsqueeze(-1) * block
        if self.write_back is not None:
            self.write_back(self, block, slots)
        elif how == "index_copy":
            self.cache.index_copy_(0, slots, block)
        else:
            self.cache[slots] = block
        return out.sum(1)


def _case(spelling, slots=(3, 1), tokens=1, write_back=None):
    B = len(slots)
    gen = torch.Generator().manual_seed(0)
    args = {"rows": torch.randn(B, tokens, W, generator=gen), "slots": torch.tensor(slots),
            "positions": torch.tensor([0, 5, 2][:B])}
    model, eager = Block(spelling, write_back), Block(spelling, write_back)
    c = canonicalize(None, args, module=model)
    with torch.no_grad():
        want = eager(*args.values())
    return c, want, model, eager


def _reads_the_written_cache(graph) -> bool:
    """The block's reads are index(index_put(cache, [slots, pos], rows), [slots])."""
    reads = [n for n in graph.nodes if n.target is aten.index.Tensor
             and getattr(n.args[0], "target", None) is aten.index_put.default]
    return len(reads) == 1 and reads[0].args[0].args[0].op == "placeholder" \
        and len(reads[0].args[0].args[1]) == 2


@pytest.mark.parametrize("slots,tokens", [((3, 1), 1), ((3, 1), 3), ((4,), 1), ((4,), 3)])
@pytest.mark.parametrize("spelling", [functional, setitem_back, broadcast_rows])
def test_a_block_written_back_whole_is_the_row_write(spelling, slots, tokens):
    c, want, model, eager = _case(spelling, slots, tokens)
    assert c.counts["cache_block"] == 1
    assert _reads_the_written_cache(c.after.graph) and not _reads_the_written_cache(c.before.graph)
    assert_same_values(c, rel=0)
    assert rel_err(c.output, want) <= 1e-6 and torch.equal(model.cache, eager.cache)


@pytest.mark.parametrize("slots", [(3, 1), (4,)])
def test_one_row_per_request_without_a_token_dim(slots):
    c, want, model, eager = _case(tokenless, slots)
    assert c.counts["cache_block"] == 1 and _reads_the_written_cache(c.after.graph)
    assert_same_values(c, rel=0)
    assert rel_err(c.output, want) <= 1e-6 and torch.equal(model.cache, eager.cache)


def changed(cache, rows, slots, pos):  # the block scaled after the put: not only the new rows
    block, how = functional(cache, rows, slots, pos)
    return block * 2, how


def put_twice(cache, rows, slots, pos):  # a second put into the block (another position)
    block, how = functional(cache, rows, slots, pos)
    return torch.index_put(block, (torch.arange(slots.shape[0])[:, None], pos + 1), rows), how


def other_batch_row(cache, rows, slots, pos):  # request b's rows put into request B-1-b's block
    batch = torch.arange(slots.shape[0]).flip(0)[:, None]
    return torch.index_put(cache[slots], (batch, pos), rows), "index_copy"


def accumulated(cache, rows, slots, pos):
    batch = torch.arange(slots.shape[0])[:, None]
    return torch.index_put(cache[slots], (batch, pos), rows, accumulate=True), "index_copy"


def other_gather(cache, rows, slots, pos):  # the block gathered from the cache, rows reversed
    return torch.index_put(cache[slots.flip(0)], (torch.arange(slots.shape[0])[:, None], pos),
                           rows), "index_copy"


def into_other(module, block, slots):  # written back into another buffer
    module.other.index_copy_(0, slots, block)


def not_written(module, block, slots):  # never written back (a read-only copy)
    pass


@pytest.mark.parametrize("spelling,write_back", [
    (changed, None), (put_twice, None), (other_batch_row, None), (accumulated, None),
    (other_gather, None), (functional, into_other), (functional, not_written)])
def test_look_alike_is_left_alone(spelling, write_back):
    c, want, model, eager = _case(spelling, (2, 1), tokens=2, write_back=write_back)
    assert c.counts.get("cache_block", 0) == 0
    assert rel_err(c.output, want) <= 1e-6
    assert torch.equal(model.cache, eager.cache) and torch.equal(model.other, eager.other)


def test_duplicate_slots_are_refused_before_any_write():
    """The one case where the forms differ (a slot twice: eager keeps one request's block) never
    runs: the input check reads `slots` as a state buffer's rows and refuses duplicates."""
    c, _, model, _ = _case(functional, (3, 1), tokens=2)
    assert c.counts["cache_block"] == 1
    step = torch.compile(model, backend="k3", fullgraph=True, options=ATEN_ONLY)
    before = model.cache.clone()
    rows = torch.randn(2, 2, W)
    with torch.no_grad(), pytest.raises(ValueError, match="slots"):
        step(rows, torch.tensor([1, 1]), torch.tensor([0, 5]))
    assert torch.equal(model.cache, before)
