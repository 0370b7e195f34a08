"""causal_mask: a causal mask gathered from a tril-of-ones bool buffer at the positions (gpt-fast,
spell14's `causal_mask[input_pos]`) -> `arange(C) <= positions[..., None]`, the form
k3compile/math.py writes (op for op); bit-equal for positions in range. Other buffers (a band,
a float 0 / -inf mask, one cell changed, a buffer whose value was not handed over) stay.
End to end: spell14 as written gets mla_decode back in both MLA layers
(tests/e2e/test_spell14_spelling.py)."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import causal_mask
from tests.canonical.rewrite_checks import ops
from tests.canonical.rule_checks import assert_one_site_becomes, assert_same, rewritten, trace

L = 16


def _positions():
    return torch.tensor([[3, 4, 5], [0, 1, 2], [13, 14, 15]])  # [B, T], first and last rows


def gathered(buf, pos):  # gpt-fast: mask = causal_mask[None, None, input_pos]
    return buf[pos].unsqueeze(1)


def gathered_none(buf, pos):  # the same with gpt-fast's leading Nones
    return buf[None, None, pos].squeeze(0)


def canonical(buf, pos):
    return (torch.arange(buf.shape[1]) <= pos.unsqueeze(-1)).unsqueeze(1)


@pytest.mark.parametrize("rows", [L, L + 8], ids=["square", "taller"])
def test_gathered_tril_becomes_the_computed_mask(rows):
    buf = torch.ones(rows, L, dtype=torch.bool).tril()
    args = (buf, _positions())
    gm, counts = rewritten(gathered, args, causal_mask.RULE)
    assert_one_site_becomes(gm, counts[0], gathered, canonical, args,
                            gone=["aten.index.Tensor"])
    assert gm.meta["inputs_read"] == {0}  # the stage cache keys by the buffer's value


def test_int32_positions():
    args = (torch.ones(L, L, dtype=torch.bool).tril(), _positions().int())
    gm, counts = rewritten(gathered, args, causal_mask.RULE)
    assert counts == [1] and "index.Tensor" not in ops(gm)
    assert_same(gm(*args), gathered(*args))


LOOKALIKES = {
    "band": torch.ones(L, L, dtype=torch.bool).tril() & ~torch.ones(L, L, dtype=torch.bool).tril(-4),
    "upper": torch.ones(L, L, dtype=torch.bool).triu(),
    "float": torch.zeros(L, L).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf")),
    "one_cell": torch.ones(L, L, dtype=torch.bool).tril().index_put_(
        (torch.tensor([5]), torch.tensor([9])), torch.tensor(True)),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_other_buffers_stay(name):
    args = (LOOKALIKES[name], _positions())
    gm, counts = rewritten(gathered, args, causal_mask.RULE)
    assert counts == [0] and "index.Tensor" in ops(gm)
    assert_same(gm(*args), gathered(*args))


def test_a_buffer_whose_value_was_not_handed_over_stays():
    args = (torch.ones(L, L, dtype=torch.bool).tril(), _positions())
    gm = trace(gathered, args)
    gm.meta.pop("real_inputs")
    assert causal_mask.RULE.apply(gm.graph) == 0


def test_a_gather_by_two_index_tensors_stays():
    def two(buf, pos):
        return buf[pos, pos]

    args = (torch.ones(L, L, dtype=torch.bool).tril(), _positions())
    gm, counts = rewritten(two, args, causal_mask.RULE)
    assert counts == [0]
    assert_same(gm(*args), two(*args))


def test_leading_nones_are_left_alone_or_rewritten_exactly():
    """gpt-fast's `causal_mask[None, None, input_pos]`: whatever the trace makes of the Nones, the
    graph after the rule equals the spelling."""
    args = (torch.ones(L, L, dtype=torch.bool).tril(), _positions())
    gm, _ = rewritten(gathered_none, args, causal_mask.RULE)
    assert_same(gm(*args), gathered_none(*args))
