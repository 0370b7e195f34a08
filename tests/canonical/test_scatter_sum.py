"""Rule `scatter_sum`: the per-token experts' finalize written as a scatter-add / index_add of
their [N*k, L] rows into zeros by a constant token index (`arange(N)` repeated k times; spell10,
a serving file's static-shape dispatch) becomes `X.sum(1)` over the [N, k, L] rows, equal to the
unrewritten graph to fp32 summation order; look-alikes (a tiled index, routed ids, a base that is
not zeros, bf16 accumulation, rows that are no view of [N, k, L]) are left alone."""

from __future__ import annotations

import pytest
import torch

from .compiled import assert_same_values, canonicalize

aten = torch.ops.aten
N, K, L = 3, 4, 32


def _rows(y, w):
    return (y.float() * w[:, :, None]).view(N * K, L)


def scatter_add_(y, w):  # spell10: repeat_interleave, the index expanded over the row
    tok = torch.arange(N).repeat_interleave(K)
    out = torch.zeros(N, L)
    return out.scatter_add_(0, tok[:, None].expand(N * K, L), _rows(y, w))


def index_add_(y, w):  # the index as expand + reshape of a column
    tok = torch.arange(N)[:, None].expand(N, K).reshape(-1)
    return torch.zeros(N, L).index_add_(0, tok, _rows(y, w))


def scatter_add_floordiv(y, w):  # out of place, the token of a pair `p // k`
    tok = torch.div(torch.arange(N * K), K, rounding_mode="floor")
    return torch.zeros(N, L).scatter_add(0, tok.unsqueeze(1).expand(-1, L), _rows(y, w))


def _inputs(dtype=torch.float32):
    return {"y": torch.randn(N, K, L).to(dtype), "w": torch.rand(N, K)}


@pytest.mark.parametrize("spelled", [scatter_add_, index_add_, scatter_add_floordiv])
def test_row_group_scatter_becomes_a_sum_over_k(spelled):
    inputs = _inputs()
    c = canonicalize(spelled, inputs)
    assert c.counts.get("scatter_sum") == 1
    ops = {n.target for n in c.after.graph.nodes}
    assert not ops & {aten.scatter_add.default, aten.index_put.default}
    assert aten.sum.dim_IntList in ops
    assert_same_values(c, rel=1e-6)
    y, w = inputs.values()
    assert torch.allclose(c.output, (y * w[:, :, None]).sum(1), rtol=1e-6, atol=1e-6)


def tiled(y, w):  # arange(N).repeat(k): row p goes to token p % N, not p // k
    tok = torch.arange(N).repeat(K)
    return torch.zeros(N, L).index_add_(0, tok, _rows(y, w))


def routed(y, w, ids):  # an index read from a graph input
    return torch.zeros(N, L).index_add_(0, ids, _rows(y, w))


def ones_base(y, w):
    tok = torch.arange(N).repeat_interleave(K)
    return torch.ones(N, L).index_add_(0, tok, _rows(y, w))


def bf16_sum(y, w):  # bf16 accumulation rounds after every add
    tok = torch.arange(N).repeat_interleave(K)
    rows = (y * w[:, :, None].to(y.dtype)).view(N * K, L)
    return torch.zeros(N, L, dtype=y.dtype).index_add_(0, tok, rows)


def flat_rows(y, w):  # rows [N*k, L] computed flat, no view of an [N, k, L] value
    tok = torch.arange(N).repeat_interleave(K)
    rows = y.float().reshape(N * K, L) * w.reshape(-1, 1)
    return torch.zeros(N, L).index_add_(0, tok, rows)


@pytest.mark.parametrize("spelled,extra,dtype", [
    (tiled, {}, torch.float32), (routed, {"ids": torch.tensor([0, 1, 2] * 4)}, torch.float32),
    (ones_base, {}, torch.float32), (bf16_sum, {}, torch.bfloat16),
    (flat_rows, {}, torch.float32)])
def test_look_alikes_are_left_alone(spelled, extra, dtype):
    c = canonicalize(spelled, {**_inputs(dtype), **extra})
    assert not c.counts.get("scatter_sum")
    assert_same_values(c, rel=0)
