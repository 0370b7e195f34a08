"""route_mask: the routing weights renormalised over a dense row masked to the top-k by a boolean
mask and read at the ids (spell6's router, a `masked_fill` spelling) become the gathered form of
`math.route_top_k`, within a few fp32 ulps, and then fuse into `k3.moe_route`; masks from other
ids, other fills, half precision and a dense row read elsewhere stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import route_mask
from k3compile.math import route_top_k
from tests.canonical.rule_checks import rewrite, targets
from tests.conftest import rel_err

ULP32 = 2.0**-23
K, EPS = 4, 1e-20


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 16, generator=gen).to(dtype), torch.randn(16, generator=gen).to(dtype)


def _ids(s, bias):
    return torch.topk(s + bias, K, dim=-1).indices


def _spell6(logits, bias, scale):
    """tests/models/spell6_k3.py LatentMoE.forward's routing"""
    s = torch.sigmoid(logits)
    ids = _ids(s, bias)
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter(1, ids, True)
    dense = torch.where(chosen, s, 0.0)
    dense = dense / (dense.sum(-1, keepdim=True) + EPS) * scale
    return ids, dense.gather(1, ids)


def spell6(logits, bias):
    return _spell6(logits, bias, 1.0)


def no_scale(logits, bias):
    s = torch.sigmoid(logits)
    ids = _ids(s, bias)
    dense = torch.where(torch.zeros_like(s, dtype=torch.bool).scatter(-1, ids, True), s, 0)
    return ids, (dense / (dense.sum(dim=-1, keepdim=True) + EPS)).gather(-1, ids)


SPELLED = {"spell6": spell6, "scaled": lambda lg, b: _spell6(lg, b, 2.5), "no_scale": no_scale}


def _other_ids(logits, bias):
    s = torch.sigmoid(logits)
    ids, other = _ids(s, bias), _ids(s, -bias)
    dense = torch.where(torch.zeros_like(s, dtype=torch.bool).scatter(1, other, True), s, 0.0)
    return ids, (dense / (dense.sum(-1, keepdim=True) + EPS)).gather(1, ids)


def _fill(logits, bias):
    s = torch.sigmoid(logits)
    ids = _ids(s, bias)
    dense = torch.where(torch.zeros_like(s, dtype=torch.bool).scatter(1, ids, True), s, 0.5)
    return ids, (dense / (dense.sum(-1, keepdim=True) + EPS)).gather(1, ids)


def _inverted(logits, bias):
    s = torch.sigmoid(logits)
    ids = _ids(s, bias)
    dense = torch.where(torch.ones_like(s, dtype=torch.bool).scatter(1, ids, False), s, 0.0)
    return ids, (dense / (dense.sum(-1, keepdim=True) + EPS)).gather(1, ids)


def _dense_read(logits, bias):
    s = torch.sigmoid(logits)
    ids = _ids(s, bias)
    dense = torch.where(torch.zeros_like(s, dtype=torch.bool).scatter(1, ids, True), s, 0.0)
    return ids, (dense / (dense.sum(-1, keepdim=True) + EPS)).gather(1, ids), dense * 2


LOOKALIKES = {"other_ids": _other_ids, "fill": _fill, "inverted_mask": _inverted,
              "dense_read_elsewhere": _dense_read}


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_masked_dense_routing_is_the_gathered_form(name):
    logits, bias = _inputs()
    before, after, n = rewrite(route_mask.RULE, SPELLED[name], logits, bias, joint=True)
    assert n == 1
    assert "aten.where.self" not in targets(after) and "aten.scatter.value" not in targets(after)
    (ids, got), (want_ids, want) = after(logits, bias), before(logits, bias)
    assert torch.equal(ids, want_ids)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 4 * ULP32
    scale = 2.5 if name == "scaled" else 1.0
    _, canonical = route_top_k(logits, bias, K, scale, EPS)
    assert rel_err(got, canonical) <= 4 * ULP32


def test_rewritten_graph_is_route_top_k_as_traced():
    logits, bias = _inputs()
    _, after, _ = rewrite(route_mask.RULE, spell6, logits, bias, joint=True)
    canonical, _, n = rewrite(route_mask.RULE, lambda lg, b: route_top_k(lg, b, K, 1.0, EPS),
                              logits, bias, joint=True)
    assert n == 0 and targets(after) == targets(canonical)  # the canonical form is no site


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_stay(name):
    logits, bias = _inputs()
    before, after, n = rewrite(route_mask.RULE, LOOKALIKES[name], logits, bias, joint=True)
    assert n == 0 and targets(after) == targets(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays(dtype):
    logits, bias = _inputs(dtype)
    _, _, n = rewrite(route_mask.RULE, spell6, logits, bias, joint=True)
    assert n == 0


def _router(x, w, bias):
    return spell6(F.linear(x.float(), w.float()), bias)


def test_fuses_into_moe_route_under_the_backend():
    """spell6's router after an fp32 router GEMM becomes the fused route op(s)."""
    import k3compile.backend as k3be

    gen = torch.Generator().manual_seed(1)
    x, w, bias = (torch.randn(*s, generator=gen) for s in ((2, 64), (16, 64), (16,)))
    torch._dynamo.reset()
    step = torch.compile(_router, backend="k3", fullgraph=True, options={"executor": "aten"})
    (ids, got), (want_ids, want) = step(x, w, bias), _router(x, w, bias)
    (graph,) = k3be.last_compiled().observer.graphs.values()
    names = {str(n.target) for n in graph.nodes}
    assert names & {"k3.moe_route.default", "k3.moe_front_route.default"}, names
    assert torch.equal(ids, want_ids)
    assert rel_err(got, want) <= 4 * ULP32
