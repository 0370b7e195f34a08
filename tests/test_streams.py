"""Stage `streams`: each MoE layer's shared-expert branch runs on side stream 1 between a
`k3.stream_fork` and a `k3.stream_join`, collectives stay on the main stream, the schedule passes
the hazard check, and a planted hazard is caught. On CPU fork/join are identities: the compiled
model still equals eager."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

import k3compile.backend as k3be
from k3compile import inductor
from k3compile.models import build_model, get_config
from k3compile.streams import happens_before, hazards

FORK, JOIN = torch.ops.k3.stream_fork.default, torch.ops.k3.stream_join.default


@pytest.fixture(scope="module")
def compiled():
    torch._dynamo.reset()  # no compiled code shared with another module's model
    cfg = get_config("tiny").with_layers(3)  # dense layer 0, two MoE layers
    eager = build_model(cfg, dtype=torch.bfloat16, max_batch=4, max_seq_len=32)
    model = build_model(cfg, dtype=torch.bfloat16, max_batch=4, max_seq_len=32)
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    args = (torch.tensor([5, 7]), torch.tensor([0, 4]), torch.tensor([1, 0]))
    got, want = step(*args), eager(*args)
    graph = next(iter(k3be.last_compiled().observer.graphs.values()))
    return got, want, graph


def _by_target(graph, target):
    return [n for n in graph.nodes if n.target is target]


def test_compiled_equals_eager(compiled):
    got, want, _ = compiled
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_shared_branch_on_side_stream(compiled):
    _, _, graph = compiled
    forks, joins = _by_target(graph, FORK), _by_target(graph, JOIN)
    assert len(forks) == len(joins) == 2  # one per MoE layer, none for the dense MLP
    order = {n: i for i, n in enumerate(graph.nodes)}
    fronts = _by_target(graph, torch.ops.k3.moe_front.default)
    for fork, join, front in zip(forks, joins, fronts):
        assert fork.args[1] == join.args[1] == 1
        side = [n for n in graph.nodes if order[fork] < order[n] < order[join]
                and n.meta.get("k3_stream") == 1 and n.op == "call_function"]
        names = {str(n.target) for n in side}
        # the shared experts' gate/up and down GEMM (a plain GEMM: k3.linear)
        assert {"k3.situ_gate_up.default", "k3.linear.default"} <= names, names
        # the branch is launched before the routed path, and joined after it
        assert max(order[n] for n in side) < order[front] < order[join]
        # the shared expert reads the forked x, the main stream the joined output
        shared = next(n for n in side if n.target is torch.ops.k3.situ_gate_up.default)
        assert shared.args[0].target is operator.getitem and shared.args[0].args[0] is fork
        assert all(u.target is operator.getitem for u in join.users)
    dense = _by_target(graph, torch.ops.k3.situ_gate_up.default)[0]
    assert dense.meta["k3_stream"] == 0
    assert all("k3_stream" in n.meta for n in graph.nodes)


def test_schedule_has_no_hazard(compiled):
    assert hazards(compiled[2]) == []


def _copy(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    env = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    return new


def test_missing_join_is_a_hazard(compiled):
    graph = _copy(compiled[2])
    join = _by_target(graph, JOIN)[0]
    for item in list(join.users):
        item.replace_all_uses_with(join.args[0][item.args[1]])  # read the side result directly
        graph.erase_node(item)
    graph.erase_node(join)
    found = hazards(graph)
    assert found and "with no event between" in found[0], found
    assert any("by linear" in p and "stream 1" in p and "stream 0" in p for p in found), found


def test_missing_fork_is_a_hazard(compiled):
    graph = _copy(compiled[2])
    fork = _by_target(graph, FORK)[0]
    x = fork.args[0][0]  # the side branch now reads x with nothing ordering it after x's writer
    for item in list(fork.users):
        item.replace_all_uses_with(x)
        graph.erase_node(item)
    graph.erase_node(fork)
    found = hazards(graph)
    assert any("read by situ_gate_up" in p and "(stream 1)" in p for p in found), found


def test_collective_off_the_main_stream_is_flagged():
    def step(x, w):
        r = torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_reduce(x @ w, "sum", "0"))
        return r * 2

    graph = inductor.fwd_only_fake(step, [torch.randn(4, 8), torch.randn(8, 8)]).graph
    for n in graph.nodes:
        n.meta["k3_stream"] = 1 if "all_reduce" in str(n.target) else 0
    assert any("collective on stream 1" in p for p in hazards(graph))
    hb = happens_before(graph)
    assert hb.number_of_nodes() > 0
