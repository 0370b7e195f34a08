"""Rule slot_mapping: a cache read by a per-token slot mapping that is the slots themselves (one
token per request, spelled as a serving engine builds it) becomes the read by the slots; the
rewritten graph computes what the unrewritten one does, bit for bit, on three spellings of the
mapping. Look-alikes (the slots repeated per verify row, reversed, doubled, or only some of
them) are left alone. Under the backend, spell7's absorbed MLA then gets mla_decode at T = 1
(tests/e2e/test_spell7_spelling.py, `LOST`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from .compiled import assert_same_values, canonicalize

aten = torch.ops.aten
S, L, R = 6, 8, 4


class Read(nn.Module):
    """Writes one row per request at (slots, positions) and returns the cache rows read by
    `mapping(slots)`, times 2."""

    def __init__(self, mapping):
        super().__init__()
        self.register_buffer("cache", torch.randn(S, L, R, generator=torch.Generator().manual_seed(2)))
        self.mapping = mapping

    def forward(self, rows, slots, positions):
        self.cache[slots, positions] = rows
        return self.cache[self.mapping(slots)] * 2


def vllm(slots):  # spell7: slots.unsqueeze(1).expand(B, T).reshape(-1) at T = 1
    return slots.unsqueeze(1).expand(slots.shape[0], 1).reshape(-1)


def column_flat(slots):
    return slots[:, None].flatten()


def viewed(slots):
    return slots.view(-1, 1).view(-1)


def _reads_slots(graph) -> bool:
    reads = [n for n in graph.nodes if n.target is aten.index.Tensor]
    return len(reads) == 1 and reads[0].args[1][0].op == "placeholder"


def _case(mapping, slots=(3, 1)):
    args = {"rows": torch.randn(len(slots), R, generator=torch.Generator().manual_seed(0)),
            "slots": torch.tensor(slots), "positions": torch.tensor([0, 5, 2][:len(slots)])}
    model, eager = Read(mapping), Read(mapping)
    c = canonicalize(None, args, module=model)
    with torch.no_grad():
        want = eager(*args.values())
    return c, want, model, eager


@pytest.mark.parametrize("slots", [(3, 1), (4,)])
@pytest.mark.parametrize("mapping", [vllm, column_flat, viewed])
def test_a_mapping_that_is_the_slots_reads_by_the_slots(mapping, slots):
    c, want, model, eager = _case(mapping, slots)
    assert c.counts["slot_mapping"] == 1 and _reads_slots(c.after.graph)
    assert not _reads_slots(c.before.graph)
    assert_same_values(c, rel=0)
    assert torch.equal(c.output, want) and torch.equal(model.cache, eager.cache)


def repeated(slots):  # two verify rows per request: each slot twice
    return slots.unsqueeze(1).expand(slots.shape[0], 2).reshape(-1)


def reversed_slots(slots):
    return slots.flip(0)


def doubled(slots):  # a view of the slots times 2 (the layout reader's scale): not the slots
    return (slots * 2).view(-1)


def narrowed(slots):  # the first slot only (a view, but not all of them)
    return slots[:1]


@pytest.mark.parametrize("mapping", [repeated, reversed_slots, doubled, narrowed])
def test_look_alike_is_left_alone(mapping):
    c, want, model, eager = _case(mapping, (2, 1))
    assert c.counts.get("slot_mapping", 0) == 0
    assert torch.equal(c.output, want) and torch.equal(model.cache, eager.cache)
