"""Rule `mxfp4_dequant`: each foreign spelling of the MXFP4 dequant becomes math.mxfp4_dequant's
form, equal bit for bit over every byte value and the scales 0..254; look-alikes stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import mxfp4_dequant as rule
from k3compile.math import E2M1_VALUES, e2m1_table, mxfp4_dequant

from . import expert_spellings as sp
from .rule_checks import assert_same, targets, trace

DTYPES = (torch.float32, torch.bfloat16)


def _packed():  # every byte value at every nibble position across the rows
    return (torch.arange(4 * 8 * 32) % 256).to(torch.uint8).view(4, 8, 32)[:, :, :16].clone()


def _scale_sets():  # [4, 8, 1] scales covering 0..254 over the sets
    s = torch.arange(255)
    return [s[i:i + 32].view(4, 8, 1).to(torch.uint8) for i in range(0, 224, 32)] + [
        s[-32:].view(4, 8, 1).to(torch.uint8)]


def _rewritten(fn, dtype):
    f = lambda p, s, lut: fn(p, s, dtype, lut)
    gm = trace(f, [_packed(), _scale_sets()[0], sp._e2m1_lut()])
    return f, gm, rule.apply(gm.graph)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spelling", sorted(sp.DEQUANTS))
def test_spelling_becomes_canonical(spelling, dtype):
    f, gm, count = _rewritten(sp.DEQUANTS[spelling], dtype)
    gm.recompile()
    assert count == 1
    ops = targets(gm)
    for op in ("aten.bitwise_and.Scalar", "aten.__rshift__.Scalar", "aten.exp2.default",
               "aten.index.Tensor", "aten.cat.default"):
        assert op in ops, (op, ops)
    for gone in ("aten.ldexp.Tensor", "aten.pow.Scalar", "aten.slice_scatter.default",
                 "aten.where.self"):
        assert gone not in ops
    tables = {n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten.index.Tensor}
    assert len(tables) == 1  # one table node, computed in the graph: the E2M1 values in dtype
    assert_same(rule.known_value(tables.pop()), e2m1_table(dtype=dtype))
    lut = sp._e2m1_lut()
    for scale in _scale_sets():
        assert_same(gm(_packed(), scale, lut), f(_packed(), scale, lut))
        canonical = mxfp4_dequant(_packed(), scale, e2m1_table(dtype=dtype))
        assert_same(gm(_packed(), scale, lut), canonical)


def test_canonical_form_is_left_as_it_is():
    f = lambda p, s, lut: mxfp4_dequant(p, s, lut.to(torch.bfloat16))
    gm = trace(f, [_packed(), _scale_sets()[0], sp._e2m1_lut()])
    before = targets(gm)
    assert rule.apply(gm.graph) == 0 and targets(gm) == before


def test_table_that_is_not_e2m1_is_left_alone():
    nf4ish = torch.tensor(E2M1_VALUES) * 1.25
    f = lambda p, s, lut: sp.dequant_lut_stack(p, s, torch.float32, lut)
    gm = trace(f, [_packed(), _scale_sets()[0], nf4ish])
    assert rule.apply(gm.graph) == 0


def test_table_of_unknown_value_is_left_alone():
    f = lambda p, s, lut: sp.dequant_lut_stack(p, s, torch.float32, lut)
    gm = trace(f, [_packed(), _scale_sets()[0], sp._e2m1_lut()])
    gm.meta.pop("real_inputs")  # a graph input nobody handed over: no proof, no rewrite
    assert rule.apply(gm.graph) == 0


def test_swapped_nibbles_are_left_alone():
    def high_first(p, s, lut):
        vals = torch.stack([lut[(p >> 4).long()], lut[(p & 15).long()]], -1).flatten(-2)
        return vals * torch.exp2(s.float() - 127).repeat_interleave(32, -1)

    gm = trace(high_first, [_packed(), _scale_sets()[0], sp._e2m1_lut()])
    assert rule.apply(gm.graph) == 0


@pytest.mark.parametrize("exponent", [
    lambda s: s.float() - 126,  # another bias
    lambda s: s - 127,  # a float tensor, not a uint8 scale
], ids=["bias_126", "float_scale"])
def test_exp2_of_something_else_is_left_alone(exponent):
    def dequant(p, s, lut):
        vals = torch.stack([lut[(p & 15).long()], lut[(p >> 4).long()]], -1).flatten(-2)
        return vals * torch.exp2(exponent(s)).repeat_interleave(32, -1)

    scale = _scale_sets()[0]
    for s in (scale, scale.float()):
        gm = trace(dequant, [_packed(), s, sp._e2m1_lut()])
        assert rule.apply(gm.graph) == 0


def test_fp16_rounding_other_than_the_canonical_form_is_left_alone():
    """fp32 math cast to fp16 rounds tiny and huge scales unlike the canonical fp16 math."""
    _, _, count = _rewritten(sp.dequant_lut_stack, torch.float16)
    assert count == 0
    _, _, count = _rewritten(sp.dequant_e8m0_table, torch.float16)  # fp16 math: the same
    assert count == 1


def _byte_pairs() -> torch.Tensor:  # [256, 2]: each byte's low- and high-nibble E2M1 values
    codes, lut = torch.arange(256), sp._e2m1_lut()
    return torch.stack([lut[codes % 16], lut[codes // 16]], -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_table_cut_out_of_a_larger_constant_is_read(dtype):
    """spell13's table is `byte_pairs[:16, 0]` (a slice and a select of a [256, 2] buffer): its
    value is read exactly, so the spelling becomes canonical, equal to eager bit for bit."""
    f = lambda p, s, pairs: sp.dequant_lut_stack(p, s, dtype, pairs[:16, 0])
    gm = trace(f, [_packed(), _scale_sets()[0], _byte_pairs()])
    assert rule.apply(gm.graph) == 1
    gm.recompile()
    for scale in _scale_sets():
        assert_same(gm(_packed(), scale, _byte_pairs()), f(_packed(), scale, _byte_pairs()))
        assert_same(gm(_packed(), scale, _byte_pairs()),
                    mxfp4_dequant(_packed(), scale, e2m1_table(dtype=dtype)))


@pytest.mark.parametrize("cut, e2m1", [
    (lambda pairs: pairs[:16, 0], True),
    (lambda pairs: pairs[16:32, 0], True),  # bytes 16..31 have the same low nibbles
    (lambda pairs: pairs.narrow(0, 0, 16).unsqueeze(0).select(-1, 0).squeeze(0), True),
    (lambda pairs: pairs[:16, 1], False),  # the high nibbles of bytes 0..15: all zero
    (lambda pairs: pairs[1:17, 0], False),  # one entry off
], ids=["slice_select", "other_rows", "narrow_views", "high_column", "shifted"])
def test_known_value_of_a_cut_table(cut, e2m1):
    """known_value (which moe_experts' table check shares) evaluates a static slice / select /
    narrow / (un)squeeze of a known constant exactly: the canonical form's table is E2M1 exactly
    where the cut picks E2M1's values."""
    f = lambda p, s, pairs: mxfp4_dequant(p, s, cut(pairs))
    gm = trace(f, [_packed(), _scale_sets()[0], _byte_pairs()])
    table = next(n.args[0] for n in gm.graph.nodes if n.target is torch.ops.aten.index.Tensor)
    assert_same(rule.known_value(table), cut(_byte_pairs()))
    assert torch.equal(rule.known_value(table), e2m1_table(dtype=torch.float32)) == e2m1


def test_dequant_through_a_cut_that_is_not_e2m1_is_left_alone():
    f = lambda p, s, pairs: sp.dequant_lut_stack(p, s, torch.float32, pairs[:16, 1])
    gm = trace(f, [_packed(), _scale_sets()[0], _byte_pairs()])
    assert rule.apply(gm.graph) == 0
