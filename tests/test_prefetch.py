"""Stage `prefetch`: before the main stream waits on a collective (or on the side stream), a
`k3.prefetch_l2` names the weights of the next GEMMs within the L2 budget; a no-op on CPU."""

from __future__ import annotations

import torch

from k3compile import inductor
from k3compile.options import Options
from k3compile.prefetch import H200_L2_BYTES, SHARE, insert_prefetches, l2_bytes

_c10d = torch.ops._c10d_functional
PREFETCH = torch.ops.k3.prefetch_l2.default


def step(x, partial, w_a, w_b, w_c, cache):
    """An all-reduced partial feeding three GEMMs; `cache` is state written in place."""
    r = _c10d.wait_tensor(_c10d.all_reduce(partial, "sum", "0"))
    h = (x + r) @ w_a.t()
    h = h @ w_b.t()
    cache.copy_(h[:, :4])
    return h @ w_c.t()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g),
            torch.randn(128, 64, generator=g), torch.randn(96, 128, generator=g),
            torch.randn(32, 96, generator=g), torch.zeros(2, 4)]


def _graph():
    return inductor.fwd_only_fake(step, _inputs()).graph


def _prefetches(graph):
    return [n for n in graph.nodes if n.target is PREFETCH]


def test_prefetch_before_the_wait_names_next_gemm_weights():
    graph = _graph()
    found = insert_prefetches(graph, l2=1 << 30)
    (node,) = _prefetches(graph)
    assert found[0].node is node
    assert node.next.target is _c10d.wait_tensor.default  # overlaps the collective in flight
    assert node.prev.target is _c10d.all_reduce.default
    weights = [w.name for w in node.args[0]]
    assert weights == ["w_a_1", "w_b_1", "w_c_1"]  # in GEMM order; not x, partial or the state
    assert node.args[1] == 4 * (128 * 64 + 96 * 128 + 32 * 96)
    assert node.meta["k3_prefetch"]["weights"] == weights
    assert node.meta["k3_prefetch"]["before"] == node.next.name
    assert "val" in node.meta and node.meta["k3_stream"] == 0


def test_budget_caps_the_bytes():
    graph = _graph()
    l2 = 2 * 128 * 64 * 4  # room for w_a only, at SHARE = 0.5
    insert_prefetches(graph, l2=l2)
    (node,) = _prefetches(graph)
    assert node.args[1] == int(l2 * SHARE)
    assert [w.name for w in node.args[0]] == ["w_a_1"]


def test_no_wait_no_prefetch():
    graph = inductor.fwd_only_fake(lambda x, w: (x @ w.t()).relu(), _inputs()[:1] + _inputs()[2:3]).graph
    assert insert_prefetches(graph, l2=1 << 30) == []


def test_cpu_run_is_unchanged_and_dce_keeps_the_op():
    gm = inductor.fwd_only_fake(step, _inputs())
    insert_prefetches(gm.graph, l2=1 << 30)
    gm.graph.eliminate_dead_code()
    assert len(_prefetches(gm.graph)) == 1  # side-effecting: kept although nothing reads it
    torch.ops.k3.prefetch_l2([torch.randn(4, 4)], 64)  # CPU: a no-op


def test_l2_budget_option():
    graph = _graph()
    assert l2_bytes(None, graph) == H200_L2_BYTES  # CPU graph: an H200's L2
    assert l2_bytes(Options.make({"l2_bytes": 1 << 20}).l2_bytes, graph) == 1 << 20
