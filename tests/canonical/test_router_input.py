"""router_input: the router GEMM and the latent down-projection each flattening x (Moonshot's MoE
block) read one [N, D] view afterwards, with the same values; equal views of GEMMs without a
router (F.linear's per-GEMM view, the canonical form of every other projection), and different
views, stay."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.canonical import router_input, view_chains
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 1, 16, generator=g).to(dtype), torch.randn(8, 16, generator=g).to(dtype),
            torch.randn(4, 16, generator=g).to(dtype), torch.randn(8, generator=g))


def gate_and_down(x, router_w, down_w, bias):  # Moonshot: each consumer flattens x itself
    scores = torch.sigmoid(F.linear(x.view(-1, 16).float(), router_w.float()))
    _, ids = torch.topk(scores + bias, 2, dim=-1)
    z = F.linear(x.view(-1, x.shape[-1]), down_w)
    return ids, scores.gather(-1, ids), z


def flatten_once(x, router_w, down_w, bias):  # our model: one [N, D] value for both GEMMs
    flat = x.reshape(-1, 16)
    scores = torch.sigmoid(F.linear(flat.float(), router_w.float()))
    _, ids = torch.topk(scores + bias, 2, dim=-1)
    return ids, scores.gather(-1, ids), F.linear(flat, down_w)


def _input_views(gm) -> list:
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    return [u for u in x.users if view_chains.is_view(u)]


def test_router_and_down_projection_read_one_view():
    for dtype in (torch.float32, torch.bfloat16):
        args = _inputs(dtype=dtype)
        before, after, n = rewrite(router_input, gate_and_down, *args)
        assert n == 1 and len(_input_views(before)) == 2
        (view,) = _input_views(after)
        assert len(view.users) == 2
        _, canonical, _ = rewrite(router_input, flatten_once, *args)
        assert ops(after) == ops(canonical)
        assert_same(before, after, args)
        for got, want in zip(after(*args), flatten_once(*args)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gemms_without_a_router_keep_their_views():
    def fn(x, router_w, down_w, bias):  # two projections of one input, no top-k
        return torch.sigmoid(F.linear(x.view(-1, 16), router_w)), F.linear(x.view(-1, 16), down_w)

    args = _inputs(1)
    before, after, n = rewrite(router_input, fn, *args)
    assert n == 0 and len(_input_views(after)) == 2
    assert_same(before, after, args)


def test_different_views_and_more_than_two_stay():
    def fn(x, router_w, down_w, bias):
        scores = torch.sigmoid(F.linear(x.view(-1, 16), router_w))
        _, ids = torch.topk(scores + bias, 2, dim=-1)
        z1 = F.linear(x.view(-1, 16), down_w)
        z2 = F.linear(x.view(-1, 16), down_w * 2)  # a third reader: which one is the down?
        return ids, z1, z2, x.view(2, 16).sum(-1)

    args = _inputs(2)
    before, after, n = rewrite(router_input, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)
