"""Stage `streams`: each MoE layer's shared-expert branch runs on side stream 1 between a
`k3.stream_fork` and a `k3.stream_join`, its ops carrying `stream=1` in their calls; collectives
stay on the main stream, the schedule passes the hazard check, and planted hazards are caught. On
CPU fork/join are identities and the stream argument changes nothing: the compiled model equals
eager under both executors. Under Inductor, its wrapper (the Python that launches the ops) keeps
the side-stream calls after their fork and before their join, reading only the fork's alias,
weights and each other, with nothing they touch reused before the join."""

from __future__ import annotations

import copy
import dataclasses
import operator
import re

import pytest
import torch
from torch import fx
from torch._inductor.utils import run_and_get_code

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from k3compile.ops.side_streams import on_stream
from k3compile.rewrite import inductor
from k3compile.stages.streams import happens_before, hazards, takes_stream
from tests.conftest import TOL, rel_err

FORK, JOIN = torch.ops.k3.stream_fork.default, torch.ops.k3.stream_join.default
SHARED, LINEAR = torch.ops.k3.situ_gate_up.default, torch.ops.k3.linear.default


# ---- the stream argument -------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["situ_gate_up", "linear", "prefetch_l2"])
def test_side_stream_ops_take_a_stream_argument(op):
    (arg,) = [a for a in getattr(torch.ops.k3, op).default._schema.arguments if a.name == "stream"]
    assert arg.kwarg_only and str(arg.type) == "int" and arg.default_value == 0


def test_references_ignore_the_stream():
    g = torch.Generator().manual_seed(0)
    x, wg, wu, wd = (torch.randn(*s, generator=g) for s in ((3, 64), (32, 64), (32, 64), (64, 32)))
    a = [torch.ops.k3.situ_gate_up(x, wg, wu, 4.0, 25.0, stream=s) for s in (0, 1)]
    y = [torch.ops.k3.linear(a[0], wd, stream=s) for s in (0, 1)]
    assert torch.equal(a[0], a[1]) and torch.equal(y[0], y[1])
    assert torch.equal(a[0], torch.ops.k3.situ_gate_up(x, wg, wu, 4.0, 25.0))
    # the prefetch passes `after` through (aliases); on CPU it touches nothing
    (alias,) = torch.ops.k3.prefetch_l2([wg, wu], 1024, stream=2, after=[x])
    assert alias.data_ptr() == x.data_ptr() and torch.ops.k3.prefetch_l2([wg], 64) == []


def test_on_stream_takes_the_argument_off():
    calls = []
    impl = on_stream(lambda *args, **kwargs: calls.append((args, kwargs)) or args[0])
    x = torch.ones(2)
    assert impl(x, 1.5, stream=1) is x and impl(x, 1.5) is x and impl(x, 1.5, eps=2) is x
    assert calls == [((x, 1.5), {}), ((x, 1.5), {}), ((x, 1.5), {"eps": 2})]


# ---- the stage, executor aten --------------------------------------------------------------------


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


def test_check_stage_runs_the_hazard_checker(compiled):
    """Stage `check` (after `streams` and `prefetch`) runs `hazards` on the graph they made: the
    schedule the test above found clean passed it, and a broken one fails it."""
    from k3compile.settings import Options
    from k3compile.stages import Context
    from k3compile.stages.check import InvariantError, check

    records = next(iter(k3be.last_compiled().observer.records.values()))
    names = [r.name for r in records]
    assert names.index("streams") < names.index("prefetch") < names.index("check")
    graph = copy.deepcopy(compiled[2])
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    shared = next(n for n in graph.nodes if n.target is SHARED and n.kwargs.get("stream"))
    shared.kwargs = {**shared.kwargs, "stream": 0}  # runs on main; the schedule says side
    with pytest.raises(InvariantError, match="stream"):
        check(gm, Context(Options(), None))


def _check_stream_arguments(graph):
    """stream=1 on exactly the branch's ops (both MoE layers' gate/up and down GEMM), 0 on every
    other op that takes one (the dense MLP's gate/up, the other GEMMs)."""
    side = [n for n in graph.nodes if takes_stream(n) and n.kwargs.get("stream", 0)]
    assert [n.target for n in side] == [SHARED, LINEAR] * 2
    assert all(n.kwargs["stream"] == n.meta["k3_stream"] == 1 for n in side)
    scheduled = [n for n in graph.nodes if n.meta.get("k3_stream") and n.op == "call_function"
                 and n.target is not operator.getitem and "view" not in str(n.target)]
    assert scheduled == side  # nothing else runs on the side stream (views launch nothing)
    for n in side:  # the branch reads the forked x, weights and itself
        for i in n.all_input_nodes:
            assert (i in side or i.op == "placeholder"
                    or (i.target is operator.getitem and i.args[0].target is FORK)), (n, i)


def test_stream_argument_on_exactly_the_branch(compiled):
    _check_stream_arguments(compiled[2])


def test_stream_argument_disagreeing_with_the_schedule_is_a_hazard(compiled):
    graph = _copy(compiled[2])
    shared = next(n for n in graph.nodes if n.target is SHARED and n.kwargs.get("stream"))
    shared.kwargs = {**shared.kwargs, "stream": 0}  # scheduled on 1, would run on the main stream
    assert any(p.startswith(f"{shared.name}: scheduled on stream 1, runs on stream 0")
               for p in hazards(graph))


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


# ---- executor inductor: its wrapper --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Call:
    """One k3 op call of an Inductor wrapper: `out = torch.ops.k3.<op>.default(<args>)`."""

    line: int
    out: str
    op: str
    args: str

    @property
    def reads(self) -> list[str]:
        return re.findall(r"\b(?:buf\d+|arg\d+_\d+)\b", self.args)

    @property
    def stream(self) -> int:  # the stream argument; for fork/join, their stream id
        m = re.search(r"\bstream=(\d+)", self.args) or (
            re.search(r",\s*(\d+)$", self.args) if self.op.startswith("stream_") else None)
        return int(m.group(1)) if m else 0


def wrapper_calls(code: str) -> tuple[list[Call], dict[str, str], list[tuple[int, str]]]:
    """The k3 calls of a wrapper's `call` in launch order, each buffer name's producing call
    (through `b = a` / `b = a[i]` aliases), and the buffers Inductor's planner hands to a later
    buffer (`b = a; del a  # reuse`): (line, a)."""
    calls, producer, reuses = [], {}, []
    for i, line in enumerate(code.splitlines()):
        line = line.strip()
        if m := re.fullmatch(r"(buf\d+) = torch\.ops\.k3\.(\w+)\.default\((.*)\)", line):
            calls.append(Call(i, m[1], m[2], m[3]))
            producer[m[1]] = m[1]
        elif m := re.fullmatch(r"(buf\d+) = (buf\d+); del (buf\d+)  # reuse", line):
            reuses.append((i, producer.get(m[2], m[2])))
        elif m := re.fullmatch(r"(buf\d+) = (buf\d+)(?:\[\d+\])?", line):
            producer[m[1]] = producer.get(m[2], m[2])
    return calls, producer, reuses


def check_side_calls(code: str, stream: int) -> list[Call]:
    """Every call with `stream=<stream>` in the wrapper: after the fork whose alias it reads (or a
    side call that did), reading nothing else but graph inputs (weights), and before a join that
    takes its output; nothing it touches, nor the forked input, reused before that join. Returns
    the side calls, in launch order."""
    calls, producer, reuses = wrapper_calls(code)
    by_out = {c.out: c for c in calls}
    side = [c for c in calls if c.op not in ("stream_fork", "stream_join") and c.stream == stream]
    for c in side:
        sources = [by_out.get(producer.get(r, r)) for r in c.reads if r.startswith("buf")]
        assert sources and all(s is not None and (s.op == "stream_fork" or s in side)
                               for s in sources), f"{c.op} ({c.args}) reads past the fork"
        fork = c
        while fork.op != "stream_fork":  # back through the side calls to the fork
            fork = next(by_out[producer[r]] for r in fork.reads if r.startswith("buf"))
        assert fork.stream == stream and fork.line < c.line
        join = next((j for j in calls if j.op == "stream_join" and j.line > c.line
                     and c.out in {producer.get(r) for r in j.reads}), None)
        assert join is not None and join.stream == stream, f"no join after {c.op} ({c.out})"
        touched = {c.out, fork.out, *(producer.get(r, r) for r in fork.reads)}
        assert not [r for line, r in reuses if c.line < line < join.line and r in touched]
    return side


_WRAPPER = """
        buf1 = torch.ops.k3.stream_fork.default([buf0], 1)
        buf2 = buf1[0]
        buf3 = torch.ops.k3.situ_gate_up.default(buf2, arg1_1, arg2_1, 4.0, 25.0, stream=1)
        buf4 = buf3
        cpp_fused_cos_0(buf0, buf9)
        buf5 = torch.ops.k3.stream_join.default([buf4, buf2, buf9], 1)
"""


@pytest.mark.parametrize("edit", [
    None,
    ("situ_gate_up.default(buf2", "situ_gate_up.default(buf9"),  # reads a main-stream value
    ("[buf4, buf2, buf9], 1", "[buf2, buf9], 1"),  # not joined
    ("        cpp_fused", "        buf7 = buf4; del buf4  # reuse\n        cpp_fused"),
], ids=["sound", "bypasses-fork", "no-join", "reused-before-join"])
def test_wrapper_check_catches(edit):
    code = _WRAPPER if edit is None else _WRAPPER.replace(*edit)
    if edit is None:
        assert [c.op for c in check_side_calls(code, 1)] == ["situ_gate_up"]
    else:
        with pytest.raises(AssertionError):
            check_side_calls(code, 1)


def moe_like(x0, w_router, w_down, w_gate, w_up, w_shared_down, w_routed_up):
    """A routed path (k3.moe_front, then aten ops) and the shared experts' SiTU MLP on one x."""
    x = (x0 * 2).sin()
    logits, z = torch.ops.k3.moe_front(x, w_router, w_down)
    routed = (z.relu() * logits.sum(-1, keepdim=True)) @ w_routed_up.t() + x.cos()
    shared = torch.ops.k3.linear(torch.ops.k3.situ_gate_up(x, w_gate, w_up, 4.0, 25.0),
                                 w_shared_down)
    return (routed.cos() + shared) * 3


def test_inductor_wrapper_keeps_the_branch_between_fork_and_join():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 16), (4, 16), (8, 16), (32, 16), (32, 16), (16, 32), (16, 8)]
    args = [torch.randn(*s, generator=g) for s in shapes]
    step = torch.compile(moe_like, backend="k3",
                         options={"executor": "inductor", "side_streams": True})
    got, (code,) = run_and_get_code(step, *args)
    assert rel_err(got, moe_like(*args)) <= TOL["inductor_fp32"]
    calls, producer, _ = wrapper_calls(code)
    (fork,), (join,) = ([c for c in calls if c.op == op] for op in ("stream_fork", "stream_join"))
    front = next(c for c in calls if c.op == "moe_front")
    shared, down = check_side_calls(code, 1)
    assert (shared.op, down.op, fork.stream, join.stream) == ("situ_gate_up", "linear", 1, 1)
    assert fork.line < shared.line < down.line < join.line
    assert producer[shared.reads[0]] == fork.out and producer[down.reads[0]] == shared.out
    # the routed path reads x through the fork (so it comes after it), the join takes the routed
    # path's output (so it comes after it: the main stream waits as late as the data allows)
    assert producer[front.reads[0]] == fork.out and fork.line < front.line
    joined = [producer.get(r, r) for r in join.reads]
    assert joined[:3] == [down.out, shared.out, fork.out] and len(joined) == 4
    routed_up = next(c for c in calls if c.op == "linear" and c != down)
    assert routed_up.stream == 0 and front.line < routed_up.line < join.line


# ---- executor inductor: the tiny model end to end (one bucket: CPU Inductor builds are slow) -----

@pytest.fixture(scope="module")
def inductor_run():
    torch._dynamo.reset()
    cfg = get_config("tiny").with_layers(3)
    eager, model = (build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=32)
                    for _ in range(2))
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "inductor", "side_streams": True})
    steps = [(torch.tensor([5, 7]), torch.tensor([0, 4]), torch.tensor([1, 0])),
             (torch.tensor([2, 9]), torch.tensor([1, 5]), torch.tensor([1, 0]))]
    got, (code,) = run_and_get_code(step, *steps[0])
    errors = [rel_err(got, eager(*steps[0]))]
    errors += [rel_err(step(*a), eager(*a)) for a in steps[1:]]
    graph = next(iter(k3be.last_compiled().observer.graphs.values()))
    return errors, graph, code


def test_inductor_executor_equals_eager(inductor_run):
    errors, _, _ = inductor_run
    assert max(errors) <= TOL["inductor_fp32"], errors


def test_inductor_graph_schedule(inductor_run):
    _, graph, _ = inductor_run
    _check_stream_arguments(graph)
    assert hazards(graph) == []


def test_inductor_wrapper_side_calls(inductor_run):
    code = inductor_run[2]
    side = check_side_calls(code, 1)
    assert [c.op for c in side] == ["situ_gate_up", "linear"] * 2
    calls = wrapper_calls(code)[0]
    joins = [c for c in calls if c.op == "stream_join"]
    experts = [c for c in calls if c.op == "moe_experts"]
    # each layer's join after its routed experts: the main stream waits for the branch last
    assert len(joins) == len(experts) == 2
    assert all(e.line < j.line for e, j in zip(experts, joins))


def test_side_streams_default_and_overrides(monkeypatch):
    """Side streams are on by default under both executors (measured on the H200, session 6);
    the option and K3_SIDE_STREAMS (the option first) turn them off."""
    from k3compile.settings import Options

    monkeypatch.delenv("K3_SIDE_STREAMS", raising=False)
    assert Options.make({"executor": "aten"}).side_streams
    assert Options.make({"executor": "inductor"}).side_streams
    assert not Options.make({"executor": "inductor", "side_streams": False}).side_streams
    monkeypatch.setenv("K3_SIDE_STREAMS", "0")
    assert not Options.make({"executor": "inductor"}).side_streams
    assert Options.make({"executor": "aten", "side_streams": True}).side_streams


def _two_views_moe(h, wr, wd, wg, wu, w2, wm):
    """Moonshot's spelling: the router flattens the tokens (`view(-1, D)`) and the shared experts
    run `nn.Linear` on the [B, T, D] input (a view of their own); a dense MLP reads another value."""
    D = h.shape[-1]
    logits, z = torch.ops.k3.moe_front(h.view(-1, D), wr, wd)
    shared = torch.ops.k3.linear(torch.ops.k3.situ_gate_up(h.view(-1, D), wg, wu, 1.0, 0.5), w2)
    dense = torch.ops.k3.situ_gate_up((h * 2).view(-1, D), wm, wm, 1.0, 0.5)
    return logits, z, shared, dense


def test_shared_experts_reading_another_view_of_the_routers_input_fork():
    from k3compile.stages.streams import schedule_shared_experts

    B, T, D, E, L, I = 2, 1, 16, 8, 8, 8
    shapes = ((B, T, D), (E, D), (L, D), (I, D), (I, D), (D, I), (I, D))
    args = [torch.randn(s, dtype=torch.bfloat16) for s in shapes]
    gm = inductor.fwd_only_fake(_two_views_moe, args)
    branches = schedule_shared_experts(gm.graph)
    (branch,) = branches  # the shared experts; not the dense MLP (no routed path reads its input)
    assert [n.target for n in branch.nodes if n.target is not torch.ops.aten.view.default] == [
        torch.ops.k3.situ_gate_up.default, torch.ops.k3.linear.default]
    assert not hazards(gm.graph)
    (front,) = (n for n in gm.graph.nodes if n.target is torch.ops.k3.moe_front.default)
    x = front.args[0]  # the router reads x through the fork too (its view was the same)
    assert x.target is operator.getitem and x.args[0] is branch.fork.next.args[0].args[0] or (
        x.args[0].target is torch.ops.k3.stream_fork.default)
    gm.recompile()
    torch.testing.assert_close(gm(*args), _two_views_moe(*args), rtol=0, atol=0)


def _chunked_weight_moe(h, wr, wd, w_gate_up, w2):
    """spell6's spelling: the shared experts' gate and up weights are chunks of one parameter,
    chunked where they are used (after the router): a split of a graph input, not a value the
    main stream makes."""
    logits, z = torch.ops.k3.moe_front(h, wr, wd)
    wg, wu = w_gate_up.chunk(2, 0)
    shared = torch.ops.k3.linear(torch.ops.k3.situ_gate_up(h, wg, wu, 1.0, 0.5), w2)
    return logits, z, shared


def test_shared_experts_reading_chunks_of_one_weight_fork():
    """Session 23 (spell6): the branch read the chunks' getitems, which `root` took for values
    the main stream makes ("reads getitem_10, which does not come through the fork"), and
    compiling failed; a split's pieces are views of its input."""
    from k3compile.stages.streams import schedule_shared_experts

    N, D, E, L, I = 2, 16, 8, 8, 8
    shapes = ((N, D), (E, D), (L, D), (2 * I, D), (D, I))
    args = [torch.randn(s, dtype=torch.bfloat16) for s in shapes]
    gm = inductor.fwd_only_fake(_chunked_weight_moe, args)
    (branch,) = schedule_shared_experts(gm.graph)
    assert [n.target for n in branch.nodes] == [torch.ops.k3.situ_gate_up.default,
                                                torch.ops.k3.linear.default]
    assert not hazards(gm.graph)
    gm.recompile()
    torch.testing.assert_close(gm(*args), _chunked_weight_moe(*args), rtol=0, atol=0)
