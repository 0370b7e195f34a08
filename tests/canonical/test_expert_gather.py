"""Rule `expert_gather`: MXFP4 experts gathered by the flattened top-k ids, dequantised flat and
viewed back to [N, k, ...] (vLLM style) become the dequant of `packed[ids]` with ids [N, k], op
for op the form `math.mxfp4_experts` has, bit-equal to the original; look-alikes stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import expert_gather as rule
from k3compile.canonical import mxfp4_dequant
from k3compile.math import e2m1_table
from k3compile.math import mxfp4_dequant as dequant
from tests.models.redteam_k3 import _mxfp4

from .rule_checks import assert_one_site_becomes, assert_same, rewritten

E, OUT, LATENT = 5, 64, 96


def _inputs(rows, dtype):
    return [torch.randint(0, 255, (E, OUT, LATENT // 2), dtype=torch.uint8),
            torch.randint(120, 130, (E, OUT, LATENT // 32), dtype=torch.uint8),
            torch.randint(0, E, (rows, 2)), e2m1_table(dtype=dtype)]


def _flat_index_select(p, s, ids, lut):
    flat = ids.reshape(-1)
    w = dequant(p.index_select(0, flat), s.index_select(0, flat), lut)
    return w.view(*ids.shape, *w.shape[1:])


def _flat_index(p, s, ids, lut):
    w = dequant(p[ids.flatten()], s[ids.flatten()], lut)
    return w.unflatten(0, ids.shape)


def _redteam(p, s, ids, lut):  # tests/models/redteam_k3.py: bit-op E2M1, cast at the end
    flat = ids.reshape(-1)
    w = _mxfp4(p.index_select(0, flat), s.index_select(0, flat), lut.dtype)
    return w.view(ids.shape[0], ids.shape[1], *w.shape[1:])


def _canonical(p, s, ids, lut):
    return dequant(p[ids], s[ids], lut)


SPELLINGS = {"index_select": _flat_index_select, "index": _flat_index, "redteam": _redteam}


def _rewrite(fn, args):
    gm, (_, count) = rewritten(fn, args, mxfp4_dequant, rule)  # as stage canonicalize runs them
    return gm, count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_flat_gather_becomes_the_gather_by_ids(spelling, rows, dtype):
    args = _inputs(rows, dtype)
    gm, count = _rewrite(SPELLINGS[spelling], args)
    # (redteam also has the E2M1 table mxfp4_dequant computes: not op for op)
    assert_one_site_becomes(gm, count, SPELLINGS[spelling], _canonical, args,
                            gone={"aten.index_select.default"}, same_ops=spelling != "redteam")


def _swapped(packed, scale, lut):
    """math.mxfp4_dequant with the nibbles swapped: the canonical ops, not its values."""
    vals = torch.stack((lut[(packed >> 4).long()], lut[(packed & 0x0F).long()]), dim=-1)
    vals = vals.flatten(-2)
    *lead, out, width = vals.shape
    factor = torch.exp2(scale.to(torch.float32) - 127.0).to(lut.dtype).unsqueeze(-1)
    return (vals.view(*lead, out, width // 32, 32) * factor).view(*lead, out, width)


def _both(w, ids):
    return w.view(*ids.shape, OUT, LATENT), w


LOOK_ALIKES = {
    # packed and scale gathered by different index tensors
    "two_indices": lambda p, s, ids, lut: dequant(
        p.index_select(0, ids.reshape(-1)), s.index_select(0, ids.flip(0).reshape(-1)),
        lut).view(*ids.shape, OUT, LATENT),
    # the flat ids are not a reshape of an [N, k] tensor (a transpose first: order [k, N])
    "ids_transposed": lambda p, s, ids, lut: dequant(
        p[ids.t().reshape(-1)], s[ids.t().reshape(-1)], lut).view(*ids.shape, OUT, LATENT),
    # the view does not split N*k into (N, k)
    "other_view": lambda p, s, ids, lut: dequant(
        p[ids.reshape(-1)], s[ids.reshape(-1)], lut).view(-1, 2, OUT // 2, LATENT),
    # the flat dequant is also read flat
    "also_read_flat": lambda p, s, ids, lut: _both(
        dequant(p[ids.reshape(-1)], s[ids.reshape(-1)], lut), ids),
    # the canonical ops with the nibbles swapped (not the dequant)
    "nibbles_swapped": lambda p, s, ids, lut: _swapped(
        p[ids.reshape(-1)], s[ids.reshape(-1)], lut).view(*ids.shape, OUT, LATENT),
    # not a dequant (the nibbles' values, no scale)
    "no_dequant": lambda p, s, ids, lut: lut[(p[ids.reshape(-1)] & 15).long()].view(
        *ids.shape, OUT, LATENT // 2),
}


@pytest.mark.parametrize("case", sorted(LOOK_ALIKES))
def test_look_alikes_are_left_alone(case):
    args = _inputs(3, torch.float32)
    gm, count = _rewrite(LOOK_ALIKES[case], args)
    assert count == 0
    assert_same(gm(*args), LOOK_ALIKES[case](*args))
