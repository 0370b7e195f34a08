"""Rule `expert_pick`: experts picked from the whole dequantised stack (a one-hot einsum or matmul,
spell12's; an index by the [N, k] ids) become the dequant of the picked bytes, op for op the form
`math.mxfp4_experts` has, equal in value to the original (bit for bit but a zero's sign);
look-alikes stay; an unpicked non-finite expert is the documented difference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import expert_pick as rule
from k3compile.canonical import mxfp4_dequant, table_lookup
from k3compile.math import e2m1_table
from k3compile.math import mxfp4_dequant as dequant

from .rule_checks import assert_one_site_becomes, assert_same, rewritten, trace
from .test_table_lookup import _spell12_dequant

E, OUT, WIDTH = 5, 8, 64


def _inputs(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    return [torch.randint(0, 256, (E, OUT, WIDTH // 2), dtype=torch.uint8, generator=g),
            torch.randint(110, 135, (E, OUT, WIDTH // 32), dtype=torch.uint8, generator=g),
            torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(rows)]),
            e2m1_table(dtype=dtype)]


def _einsum(p, s, ids, lut):  # spell12: one-hot(ids, E) contracted with every expert
    return torch.einsum("nke,eio->nkio", F.one_hot(ids, E).to(lut.dtype), dequant(p, s, lut))


def _matmul(p, s, ids, lut):
    d = dequant(p, s, lut)
    return (F.one_hot(ids, E).to(lut.dtype) @ d.flatten(1)).unflatten(-1, d.shape[1:])


def _index(p, s, ids, lut):  # spell12's probe `experts`: dequantise all, then gather
    return dequant(p, s, lut)[ids]


def _spell12(p, s, ids, lut):  # as written: embedding E2M1, ldexp scales, cast, one-hot einsum
    d = _spell12_dequant(p, s, lut.view(16, 1)).to(lut.dtype)
    return torch.einsum("nke,eio->nkio", F.one_hot(ids, E).to(lut.dtype), d)


def _canonical(p, s, ids, lut):
    return dequant(p[ids], s[ids], lut)


SPELLINGS = {"einsum": _einsum, "matmul": _matmul, "index": _index, "spell12": _spell12}


def _rewrite(fn, args):  # after the rules stage canonicalize runs before it
    gm, (*_, count) = rewritten(fn, args, table_lookup, mxfp4_dequant, rule)
    return gm, count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_picked_stack_becomes_the_dequant_of_the_picked_bytes(spelling, rows, dtype):
    args = _inputs(rows, dtype)
    gm, count = _rewrite(SPELLINGS[spelling], args)
    # values (a zero's sign aside: below); spell12 also has the E2M1 table mxfp4_dequant computes
    assert_one_site_becomes(gm, count, SPELLINGS[spelling], _canonical, args,
                            gone={"aten.bmm.default", "aten.mm.default"},
                            same_ops=spelling != "spell12")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gather_is_bit_equal_and_the_one_hot_differs_only_in_a_zeros_sign(dtype):
    args = _inputs(3, dtype)
    got, bits = _rewrite(_einsum, args)[0](*args), {2: torch.int16, 4: torch.int32}
    assert torch.equal(got.view(bits[got.element_size()]),
                       _index(*args).view(bits[got.element_size()]))
    eager = _einsum(*args)
    flipped = got.signbit() != eager.signbit()
    assert flipped.any() and (got[flipped] == 0).all() and (eager[flipped] == 0).all()


def test_an_unpicked_inf_expert_is_the_documented_difference():
    """Scale byte 254 makes nibble 7 (6.0) 6 * 2^127 = inf in fp32. Unpicked, eager's one-hot
    sum reads 0 * inf = NaN; the rewrite never reads that expert (the routing's meaning)."""
    p, s, ids, lut = _inputs(2, torch.float32)
    ids = torch.tensor([[0, 1], [2, 1]])
    p[4].fill_(0x77)
    s[4].fill_(254)
    gm, count = _rewrite(_einsum, [p, s, ids, lut])
    assert count == 1
    assert _einsum(p, s, ids, lut).isnan().all()
    assert_same(gm(p, s, ids, lut), _canonical(p, s, ids, lut))
    assert gm(p, s, ids, lut).isfinite().all()
    ids[1, 0] = 4  # picked: both read its inf where it is, and agree everywhere
    assert_same(gm(p, s, ids, lut)[1, 0], _einsum(p, s, ids, lut)[1, 0])
    assert _canonical(p, s, ids, lut)[1, 0].isinf().all()


def _soft_mix(p, s, ids, lut):  # every expert weighted by a softmax: a mix, not a pick
    mix = torch.softmax(F.one_hot(ids, E).to(lut.dtype) * 3.0, -1)
    return torch.einsum("nke,eio->nkio", mix, dequant(p, s, lut))


def _scaled_one_hot(p, s, ids, lut):
    return torch.einsum("nke,eio->nkio", F.one_hot(ids, E).to(lut.dtype) * 2.0,
                        dequant(p, s, lut))


def _more_classes(p, s, ids, lut):  # a one-hot over E + 1 classes, its first E columns read
    return torch.einsum("nke,eio->nkio", F.one_hot(ids, E + 1)[..., :E].to(lut.dtype),
                        dequant(p, s, lut))


def _transposed(p, s, ids, lut):  # a pick, but read [N, k, I, O]: not the canonical layout
    return torch.einsum("nke,eio->nkoi", F.one_hot(ids, E).to(lut.dtype), dequant(p, s, lut))


def _plain_weights(p, s, ids, lut):  # a float stack that is no MXFP4 dequant
    w = lut[(p & 15).long()] * 2.0
    return torch.einsum("nke,eio->nkio", F.one_hot(ids, E).to(lut.dtype), w)


def _other_dim(p, s, ids, lut):  # rows of every expert gathered, not experts
    return dequant(p, s, lut)[:, ids[0]]


LOOK_ALIKES = {"soft_mix": _soft_mix, "scaled_one_hot": _scaled_one_hot,
               "more_classes": _more_classes, "transposed": _transposed,
               "plain_weights": _plain_weights, "other_dim": _other_dim}


@pytest.mark.parametrize("look_alike", sorted(LOOK_ALIKES))
def test_look_alikes_are_left_alone(look_alike):
    args = _inputs(3, torch.float32)
    fn = LOOK_ALIKES[look_alike]
    gm, count = _rewrite(fn, args)
    assert count == 0
    assert_same(gm(*args), trace(fn, args)(*args))  # the graph as traced, unrewritten
