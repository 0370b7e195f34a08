"""Rule `table_lookup`: an embedding into a one-column table read without its column becomes a
gather from the flat table, bit-equal; with it, rule mxfp4_dequant takes spell12's dequant (E2M1
by `F.embedding`); wider embeddings and one-column ones also read whole stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import mxfp4_dequant, table_lookup
from k3compile.math import E2M1_VALUES, e2m1_table
from k3compile.math import mxfp4_dequant as canonical_dequant

from .rule_checks import assert_same, rewritten, targets

EMBEDDING = "aten.embedding.default"


def _codes(*shape):
    return torch.randint(0, 16, shape)


def _table():
    return torch.randn(16, 1)


def _squeezed(codes, table):
    return F.embedding(codes, table).squeeze(-1)


def _selected(codes, table):
    return F.embedding(codes, table)[..., 0]


def _reshaped(codes, table):
    return F.embedding(codes, table).reshape(codes.shape) * 2.0


SPELLINGS = {"squeeze": _squeezed, "select": _selected, "reshape": _reshaped}


@pytest.mark.parametrize("shape", [(3, 8, 6), (1, 5)], ids=str)
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_one_column_embedding_becomes_a_flat_gather(spelling, shape):
    args = [_codes(*shape), _table()]
    gm, (count,) = rewritten(SPELLINGS[spelling], args, table_lookup)
    assert count == 1
    assert EMBEDDING not in targets(gm) and "aten.index.Tensor" in targets(gm)
    assert_same(gm(*args), SPELLINGS[spelling](*args))


def _spell12_dequant(packed, scale, table):
    """tests/models/spell12_k3.py's MXFP4Experts.weight, in fp32: remainder / floor-div nibbles,
    E2M1 by embedding into a [16, 1] table, the E8M0 scale by ldexp."""
    lo, hi = torch.remainder(packed, 16), torch.div(packed, 16, rounding_mode="floor")
    nib = torch.stack([lo, hi], -1).flatten(-2).long()
    w = F.embedding(nib, table.float()).squeeze(-1)
    return torch.ldexp(w, scale.int().repeat_interleave(32, -1) - 127)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_with_it_mxfp4_dequant_takes_the_embedding_dequant(dtype):
    packed = (torch.arange(4 * 8 * 16) % 256).to(torch.uint8).view(4, 8, 16)
    scale = torch.randint(100, 140, (4, 8, 1), dtype=torch.uint8)

    def fn(p, s, t):
        return _spell12_dequant(p, s, t).to(dtype)

    args = [packed, scale, torch.tensor(E2M1_VALUES, dtype=dtype)[:, None]]
    assert rewritten(fn, args, mxfp4_dequant)[1] == [0]  # the embedding stops it alone
    gm, counts = rewritten(fn, args, table_lookup, mxfp4_dequant)
    assert counts == [1, 1]  # the flat table, a view of an input, is read as E2M1
    assert EMBEDDING not in targets(gm) and "aten.ldexp.Tensor" not in targets(gm)
    assert_same(gm(*args), fn(*args))
    assert_same(gm(*args), canonical_dequant(packed, scale, e2m1_table(dtype=dtype)))


def test_a_wide_embedding_is_left_alone():
    args = [_codes(3, 4), torch.randn(16, 8)]
    gm, (count,) = rewritten(lambda c, t: F.embedding(c, t).sum(-1), args, table_lookup)
    assert count == 0 and EMBEDDING in targets(gm)


def test_a_one_column_embedding_also_read_whole_is_left_alone():
    def both(codes, table):
        e = F.embedding(codes, table)
        return e.squeeze(-1), e * 3.0

    args = [_codes(3, 4), _table()]
    gm, (count,) = rewritten(both, args, table_lookup)
    assert count == 0 and EMBEDDING in targets(gm)
    assert_same(gm(*args), both(*args))
