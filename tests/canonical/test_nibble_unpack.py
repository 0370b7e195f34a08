"""nibble_unpack: the low-first nibble unpack written on a byte-duplicated tensor
(`repeat_interleave(2, -1)` then period-2 shift / mask constants, spell6's `mxfp4_decode`) becomes
the two nibble streams interleaved (`cat` of `p & 15`, `p >> 4`), bit for bit on every byte value,
after which rule `mxfp4_dequant` takes the dequant; another shift pattern, a mask other than 15,
a constant that is not period 2 and a duplicated byte read elsewhere stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import mxfp4_dequant, nibble_unpack
from tests.models.spell6_k3 import mxfp4_decode

from . import expert_spellings as sp
from .rule_checks import assert_same, targets, trace


def _packed():  # [4, 8, 16] uint8: every byte value, each at an even and an odd column
    return (torch.arange(4 * 8 * 16) % 256).to(torch.uint8).view(4, 8, 16)


def _shifts(a, b, w, dtype=torch.uint8):
    return torch.tensor([a, b], dtype=dtype).repeat(w)


def _spell6(p):  # tests/models/spell6_k3.py: mxfp4_decode's unpack
    return (p.repeat_interleave(2, -1) >> _shifts(0, 4, p.shape[-1])) & 15


def _mask_first_int32(p):  # the other order, int32 constants (the codes come out int32)
    w = p.shape[-1]
    dup = torch.repeat_interleave(p, 2, dim=-1)
    return (dup & _shifts(15, 240, w, torch.int32)) >> _shifts(0, 4, w, torch.int32)


def _long_codes(p):  # spell6's, the codes cast to int64 inside the chain
    return ((p.repeat_interleave(2, -1) >> _shifts(0, 4, p.shape[-1])) & 15).long()


UNPACKS = {"spell6": _spell6, "mask_first_int32": _mask_first_int32, "long_codes": _long_codes}


def _read_elsewhere(p):
    dup = p.repeat_interleave(2, -1)
    return (dup >> _shifts(0, 4, p.shape[-1])) & 15, dup


LOOKALIKES = {
    "shift_0_3": lambda p: (p.repeat_interleave(2, -1) >> _shifts(0, 3, p.shape[-1])) & 15,
    "high_first": lambda p: (p.repeat_interleave(2, -1) >> _shifts(4, 0, p.shape[-1])) & 15,
    "mask_7": lambda p: (p.repeat_interleave(2, -1) >> _shifts(0, 4, p.shape[-1])) & 7,
    "no_mask": lambda p: p.repeat_interleave(2, -1) >> _shifts(0, 4, p.shape[-1]),
    "period_4": lambda p: (p.repeat_interleave(2, -1)
                           >> torch.tensor([0, 4, 4, 0], dtype=torch.uint8).repeat(
                               p.shape[-1] // 2)) & 15,
    "repeat_3": lambda p: (p.repeat_interleave(3, -1)
                           >> torch.tensor([0, 4, 0], dtype=torch.uint8).repeat(
                               p.shape[-1])) & 15,
    "read_elsewhere": _read_elsewhere,
}


def _rewritten(rules, fn, *args):
    gm = trace(fn, list(args))
    counts = [rule.apply(gm.graph) for rule in rules]
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm, counts


def test_the_proof_covers_every_byte_value():
    assert_same(torch.unique(_packed()), torch.arange(256, dtype=torch.uint8))


@pytest.mark.parametrize("name", sorted(UNPACKS))
def test_duplicated_byte_unpack_becomes_two_nibble_streams(name):
    fn, p = UNPACKS[name], _packed()
    gm, (n,) = _rewritten([nibble_unpack.RULE], fn, p)
    assert n == 1
    ops = targets(gm)
    assert "aten.cat.default" in ops and "aten.expand.default" not in ops
    assert "aten.__rshift__.Tensor" not in ops and "aten.bitwise_and.Tensor" not in ops
    assert_same(gm(p), fn(p))  # dtype, shape and every value


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_stay(name):
    fn, p = LOOKALIKES[name], _packed()
    before = targets(trace(fn, [p]))
    gm, (n,) = _rewritten([nibble_unpack.RULE], fn, p)
    assert n == 0 and targets(gm) == before
    assert_same(gm(p), fn(p))


@pytest.mark.parametrize("probe", [frozenset(), frozenset({"lut_index"})], ids=["take", "index"])
def test_spell6_dequant_is_then_taken_by_mxfp4_dequant(probe):
    """spell6's whole `mxfp4_decode`: no `mxfp4_dequant` site alone; with `nibble_unpack` first,
    one, and equal bit for bit over every byte and the scales 0..254."""
    f = lambda p, s, lut: mxfp4_decode(p, s, lut, probe)
    p, lut = _packed(), sp._e2m1_lut()
    scales = [(torch.arange(32) + base).clamp(max=254).view(4, 8, 1).to(torch.uint8)
              for base in range(0, 255, 32)]
    _, (alone,) = _rewritten([mxfp4_dequant.RULE], f, p, scales[0], lut)
    gm, counts = _rewritten([nibble_unpack.RULE, mxfp4_dequant.RULE], f, p, scales[0], lut)
    assert alone == 0 and counts == [1, 1]
    assert "aten.exp2.default" in targets(gm) and "aten.pow.Scalar" not in targets(gm)
    for s in scales:
        assert_same(gm(p, s, lut), f(p, s, lut))
