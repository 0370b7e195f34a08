"""Rule `cast_split`: an upcast of a merged gate|up GEMM's output before its chunk / split
(spell10's `gate_up.float().chunk(2, -1)`) becomes the split, then a cast of each piece, bit for
bit; a cast also read whole, a downcast, the upcast of anything but a GEMM, a split into three
(spell5's rounded q|k|v conv) or an integer cast stays where it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
            and n.args[0].target is CAST]


@pytest.mark.parametrize("spelled", [chunk_after_float, split_sizes_after_to])
def test_the_cast_moves_after_the_split(spelled):
    c = canonicalize(spelled, _inputs())
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


def upcast_of_no_gemm(x, w):
    g, u = torch.cat([x, x], dim=-1).float().chunk(2, dim=-1)
    return (g * u).to(x.dtype) + F.linear(x, w).sum()


def three_pieces(x, w):
    a, b, c = F.linear(x, w).float().split(INTER * 2 // 3, dim=-1)
    return (a * b * c).to(x.dtype)


def integer_cast(x, w):
    codes = (F.linear(x, w) > 0).to(torch.int32)
    a, b = codes.chunk(2, dim=-1)
    return a + b


@pytest.mark.parametrize("spelled", [cast_read_whole, rounded_conv_split, upcast_of_no_gemm,
                                     three_pieces, integer_cast])
def test_look_alikes_are_left_alone(spelled):
    c = canonicalize(spelled, _inputs())
    assert not c.counts.get("cast_split")
    assert_same_values(c, rel=0)
