"""Rule `cast_split`: an upcast of a bf16 / fp16 value before its chunk / split (spell10's
`gate_up.float().chunk(2, -1)` and its KDA conv output's `qkv.float().split(...)`) becomes the
split, then a cast of each piece, bit for bit; a cast also read whole, a downcast (spell5's
rounded q|k|v conv) or an integer cast stays where it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.canonical.spell10_kda import assert_kda_fuses_with_only

from .compiled import assert_same_values, canonicalize

aten = torch.ops.aten
CAST = torch.ops.prims.convert_element_type.default
N, D, INTER = 3, 64, 48


def chunk_after_float(x, w):  # spell10's dense / shared MLP
    g, u = F.linear(x, w).float().chunk(2, dim=-1)
    return (torch.tanh(g / 4) * 4 * torch.sigmoid(g) * (torch.tanh(u / 25) * 25)).to(x.dtype)


def split_sizes_after_to(x, w):  # a split by sizes of an einsum's output, `.to(float32)`
    h = torch.einsum("nd,od->no", x, w).to(torch.float32)
    g, u = h.split([INTER, INTER], dim=-1)
    return (g * torch.sigmoid(u)).to(x.dtype)


def _inputs(dtype=torch.bfloat16):
    return {"x": torch.randn(N, D).to(dtype), "w": torch.randn(2 * INTER, D).to(dtype)}


def _split_input_casts(gm):
    return [n for n in gm.graph.nodes if n.target in (aten.split.Tensor,
                                                      aten.split_with_sizes.default)
            and n.args[0].target is CAST and n.args[0].args[1] == torch.float32]


def upcast_of_no_gemm(x, w):  # (session 29 left any source but a GEMM)
    g, u = torch.cat([x, x], dim=-1).float().chunk(2, dim=-1)
    return (g * u).to(x.dtype) + F.linear(x, w).sum()


def three_pieces(x, w):  # (session 29 left a split into more than two)
    a, b, c = F.linear(x, w).float().split(INTER * 2 // 3, dim=-1)
    return (a * b * c).to(x.dtype)


def rounded_conv_upcast(x, w):  # spell10's bf16 KDA: the rounded conv + SiLU upcast, cut q|k|v
    qkv = F.silu(F.linear(x, w) * 2)
    q, k, v = qkv.float().split([INTER * 2 // 3] * 3, dim=-1)
    return q * k + v


@pytest.mark.parametrize("spelled", [chunk_after_float, split_sizes_after_to, upcast_of_no_gemm,
                                     three_pieces, rounded_conv_upcast])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cast_moves_after_the_split(spelled, dtype):
    c = canonicalize(spelled, _inputs(dtype))
    assert c.counts.get("cast_split") == 1
    assert _split_input_casts(c.before) and not _split_input_casts(c.after)
    assert_same_values(c, rel=0)


def cast_read_whole(x, w):
    h = F.linear(x, w).float()
    g, u = h.chunk(2, dim=-1)
    return (g * u).to(x.dtype), h.sum(-1)


def rounded_conv_split(x, w):  # spell5's bf16 KDA: an fp32 value rounded, then q|k|v split
    q, k, v = (F.linear(x, w).float() * 2).to(x.dtype).split(INTER * 2 // 3, dim=-1)
    return q + k + v


def integer_cast(x, w):
    codes = (F.linear(x, w) > 0).to(torch.int32)
    a, b = codes.chunk(2, dim=-1)
    return a + b


def fp32_input(x, w):  # nothing to move: an fp32 -> fp64 cast is not an upcast of bf16 / fp16
    g, u = F.linear(x, w).float().double().chunk(2, dim=-1)
    return (g * u).to(x.dtype)


@pytest.mark.parametrize("spelled", [cast_read_whole, rounded_conv_split, integer_cast,
                                     fp32_input])
def test_look_alikes_are_left_alone(spelled):
    c = canonicalize(spelled, _inputs())
    assert not c.counts.get("cast_split")
    assert_same_values(c, rel=0)


@pytest.mark.slow
def test_spell10_bf16_kda_fuses_with_its_upcast_before_the_cut():
    """spell10 in bf16 with `qkv.float().split(...)` (its probe `kda_cast_pieces` off) and its
    other KDA idioms on the fused spellings (`conv1d`: a bf16 conv, kda_decode's conv_rounded)"""
    assert_kda_fuses_with_only("kda_cast_pieces", torch.bfloat16)
