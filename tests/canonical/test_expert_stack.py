"""Rule `expert_stack` and op `k3.expert_stack`: a stack of per-expert graph inputs indexed by the
routed ids becomes `k3.expert_stack(parts)[ids]`, equal to the original; the op is a view of the
parts where they lie back to back (no copy) and a fresh stack otherwise (never stale); look-alikes
stay."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import k3compile.backend as be
from k3compile.canonical import expert_stack as rule
from k3compile.ops.expert_stack import back_to_back
from k3compile.stages import pack
from tests.conftest import TOL

from . import expert_spellings as sp
from .rule_checks import assert_same, targets, trace

E, ROWS, WIDTH = 5, 6, 16
STACK = "k3.expert_stack.default"


def _parts(dtype=torch.uint8):
    return [torch.randint(0, 255, (ROWS, WIDTH)).to(dtype) for _ in range(E)]


def _ids():
    return torch.tensor([[0, 4], [2, 2], [3, 1]])


def _check(fn, parts, ids, want_count):
    args = [ids, *parts]
    gm = trace(fn, args)
    count = rule.apply(gm.graph)
    gm.recompile()
    assert count == want_count
    assert (STACK in targets(gm)) == bool(want_count)
    assert_same(gm(*args), fn(*args))
    return gm


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32], ids=str)
def test_stack_indexed_by_ids_becomes_expert_stack(dtype):
    def select(ids, *parts):
        return torch.stack(list(parts))[ids]

    gm = _check(select, _parts(dtype), _ids(), 1)
    assert "aten.cat.default" not in targets(gm)
    stacked = next(n for n in gm.graph.nodes if str(n.target) == STACK)
    assert [u.target for u in stacked.users] == [torch.ops.aten.index.Tensor]


def test_cat_of_unsqueezes_and_two_selections():
    def select(ids, *parts):
        stacked = torch.cat([p.unsqueeze(0) for p in parts])
        return stacked[ids] + 1, stacked[ids[:, :1]]

    _check(select, _parts(torch.float32), _ids(), 1)


def _whole_and_selected(stacked, ids):
    return stacked.sum(0) + stacked[ids].sum()


@pytest.mark.parametrize("case", ["computed_parts", "other_dim", "mixed_shapes", "read_whole",
                                  "index_dim1"])
def test_look_alikes_are_left_alone(case):
    parts = _parts(torch.float32)
    if case == "mixed_shapes":
        parts[-1] = torch.randn(ROWS, WIDTH // 2)
    fns = {
        "computed_parts": lambda ids, *p: torch.stack([x * 2 for x in p])[ids],
        "other_dim": lambda ids, *p: torch.stack(list(p), dim=1)[ids],
        "mixed_shapes": lambda ids, *p: torch.stack([x[:, :WIDTH // 2] for x in p[:-1]]
                                                    + [p[-1]])[ids],
        "read_whole": lambda ids, *p: _whole_and_selected(torch.stack(list(p)), ids),
        "index_dim1": lambda ids, *p: torch.stack(list(p))[:, ids[0]],
    }
    _check(fns[case], parts, _ids(), 0)


def test_op_is_a_view_of_back_to_back_parts():
    buffer = torch.randn(E, ROWS, WIDTH)
    parts = list(buffer.unbind(0))
    assert back_to_back(parts)
    out = torch.ops.k3.expert_stack(parts)
    assert out.data_ptr() == buffer.data_ptr() and torch.equal(out, buffer)
    parts[2].copy_(torch.ones(ROWS, WIDTH))  # an in-place update is seen
    assert torch.equal(torch.ops.k3.expert_stack(parts)[2], torch.ones(ROWS, WIDTH))


@pytest.mark.parametrize("layout", ["separate", "reordered", "gap", "rebound"])
def test_op_copies_where_parts_are_not_back_to_back(layout):
    buffer = torch.randn(E + 1, ROWS, WIDTH)
    parts = {"separate": [torch.randn(ROWS, WIDTH) for _ in range(E)],
             "reordered": list(buffer[:E].unbind(0))[::-1],
             "gap": list(buffer[::2].unbind(0)) + [buffer[1]],
             "rebound": list(buffer[:E].unbind(0))}[layout]
    if layout == "rebound":  # a part replaced after packing: read the new one, never the buffer
        parts[3] = torch.full((ROWS, WIDTH), 7.0)
    assert not back_to_back(parts)
    out = torch.ops.k3.expert_stack(parts)
    assert torch.equal(out, torch.stack(parts))
    assert out.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


# --- end to end: per-expert ModuleList experts, LUT dequant, stack + index, bmm / matmul -------

def _list_experts(gemm: str, dequant: str = "lut_stack", seed: int = 0) -> sp.ListExperts:
    torch.manual_seed(seed)
    model = sp.ListExperts(4, 64, 64, gemm=gemm, dequant=dequant)
    for proj in (p for e in model.experts for p in (e.gate_proj, e.up_proj, e.down_proj)):
        proj.weight_packed.data.copy_(torch.randint(0, 256, proj.weight_packed.shape))
        proj.weight_scale.data.copy_(torch.randint(120, 130, proj.weight_scale.shape))
    return model


def _compiled_ops(model, args):
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    out = step(*args)
    graph = next(iter(be.last_compiled().observer.graphs.values()))
    # a stack that stage stack_inputs made one graph input counts as its expert_stack op
    stacks = [STACK for n in graph.nodes if n.op == "placeholder" and n.name.startswith("k3_stack")]
    return out, [str(n.target) for n in graph.nodes if n.op == "call_function"] + stacks


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("gemm,rows,dequant,dtype", [
    ("bmm", 3, "lut_stack", torch.float32), ("bmm", 3, "lut_stack", torch.bfloat16),
    ("matmul", 1, "lut_stack", torch.float32), ("matmul", 1, "codes_first", torch.bfloat16),
    ("x_first", 3, "bits_ldexp", torch.float32)], ids=str)
def test_list_experts_fuse_into_moe_experts(gemm, rows, dequant, dtype):
    torch._dynamo.reset()
    model = _list_experts(gemm, dequant)
    z = torch.randn(rows, 64).to(dtype)
    args = (z, torch.tensor([[0, 2], [3, 3], [1, 0]])[:rows], torch.rand(rows, 2))
    want = model(*args)
    got, ops = _compiled_ops(model, args)
    assert ops.count("k3.moe_experts.default") == 1, ops
    assert ops.count("k3.expert_stack.default") == 6  # the only other ops: no GEMM, no dequant
    assert set(ops) == {"k3.moe_experts.default", "k3.expert_stack.default"}, ops
    assert got.dtype == want.dtype and got.shape == want.shape
    assert _rel(got, want) <= (1e-6 if dtype == torch.float32 else TOL["bf16_rel_norm"])


def _stack_graph(n: int) -> fx.Graph:
    graph = fx.Graph()
    parts = [graph.placeholder(f"p{i}") for i in range(n)]
    graph.output(graph.call_function(torch.ops.k3.expert_stack.default, (parts,)))
    return graph


def test_pack_stores_an_expert_stack_as_one_buffer_or_says_why_not():
    parts = _parts(torch.float32)
    values = [p.clone() for p in parts]
    report = pack.pack_concatenated(_stack_graph(E), parts)
    assert len(report.packed) == 1 and back_to_back(parts), report
    assert all(torch.equal(p, v) for p, v in zip(parts, values))
    stacked = torch.ops.k3.expert_stack(parts)
    assert stacked.data_ptr() == parts[0].data_ptr() and torch.equal(stacked, torch.stack(values))
    odd = [torch.randn(3, 1) for _ in range(E)]  # 12 bytes an expert: the next would be unaligned
    report = pack.pack_concatenated(_stack_graph(E), odd)
    assert not report.packed and "experts of 12 bytes" in report.skipped[0], report
    assert not back_to_back(odd)


@pytest.mark.slow
def test_packed_list_experts_see_every_weight_update():
    """After the compile the experts lie back to back (no copy per step); in-place writes, a
    state dict load and a rebound `.data` are all seen by the compiled step (issue 20)."""
    torch._dynamo.reset()
    model = _list_experts("bmm")
    args = (torch.randn(3, 64), torch.tensor([[0, 2], [3, 3], [1, 0]]), torch.rand(3, 2))
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    step(*args)
    compiles = len(be._compiled)
    for attr in ("weight_packed", "weight_scale"):
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert back_to_back([getattr(getattr(e, name), attr) for e in model.experts])
    note = next(iter(be.last_compiled().observer.notes.values()))["pack"]
    assert len(note.packed) == 6, note

    def assert_current():
        assert _rel(step(*args), model(*args)) <= 1e-6

    assert_current()
    written = model.experts[2].down_proj.weight_packed
    written.data.copy_(torch.randint(0, 256, written.shape))
    assert_current()
    other = _list_experts("bmm", seed=1).state_dict()
    model.load_state_dict(other)
    assert_current()
    rebound = model.experts[1].up_proj
    rebound.weight_scale.data = torch.full_like(rebound.weight_scale, 126)
    assert not back_to_back([e.up_proj.weight_scale for e in model.experts])
    assert_current()
    assert len(be._compiled) == compiles  # the compiled step saw it, not a recompile


@pytest.mark.slow
def test_expert_stack_under_inductor_executor():
    """The default executor (Inductor) takes the view-returning op (an alias annotation, not a
    custom op's copy) and reads the packed experts as they are now."""
    torch._dynamo.reset()
    model = _list_experts("bmm")
    args = (torch.randn(3, 64), torch.tensor([[0, 2], [3, 3], [1, 0]]), torch.rand(3, 2))
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "inductor"})
    assert _rel(step(*args), model(*args)) <= 1e-6
    graph = next(iter(be.last_compiled().observer.graphs.values()))
    assert "k3.moe_experts.default" in [str(n.target) for n in graph.nodes]
    assert back_to_back([e.gate_proj.weight_packed for e in model.experts])
    rebound = model.experts[1].up_proj
    rebound.weight_scale.data = torch.full_like(rebound.weight_scale, 126)
    assert _rel(step(*args), model(*args)) <= 1e-6
