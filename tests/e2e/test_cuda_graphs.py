"""On a GPU: each bucket's step captured once in a CUDA graph and replayed; 50 decode steps of the
tiny and small configs equal to eager (state buffers and inputs static, so replays stay right);
under executor inductor with the shared experts on a side stream, 24 steps equal to eager and a
captured graph that really branches."""

from __future__ import annotations

import collections
import re

import pytest
import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err

pytestmark = pytest.mark.gpu


def _decode(step, eager, cfg, steps: int) -> float:
    """`steps` decode steps of the compiled and the eager model on the same random tokens,
    alternating batch 4 and 3 (bucket 4 with and without a padding row); the worst relative
    logit error."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for i in range(steps):
        batch = 3 if i % 2 else 4
        ids = torch.randint(0, cfg.vocab_size, (batch,), device="cuda", generator=gen)
        pos = torch.full((batch,), i, device="cuda")
        slots = torch.arange(batch, device="cuda")
        for t in (ids, pos, slots):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        worst = max(worst, rel_err(step(ids, pos, slots), eager(ids, pos, slots)))
    return worst


# Both run the fused graph op by op (executor aten): what is under test is the capture and replay
# of every fused op's CUDA path; Inductor's GPU compile of the two configs outran the minutes a
# device call gives this test (2026-11-29), and the yardstick (benchmarks/decode_layer.py) checks
# the Inductor executor under CUDA graphs at the real shapes.
@pytest.mark.parametrize("config,executor", [("tiny", "aten"), ("small", "aten")])
def test_cuda_graph_replay_equals_eager(config, executor):
    torch._dynamo.reset()
    cfg = get_config(config)
    kw = {"device": "cuda", "dtype": torch.float32, "max_batch": 8, "max_seq_len": 64}
    eager, model = build_model(cfg, **kw), build_model(cfg, **kw)
    # every fused op in the graph (also those without a GPU kernel yet): their CUDA paths and
    # the capture of all of them are under test
    options = {"buckets": (4, 8), "fuse_without_kernels": True, "executor": executor}
    step = torch.compile(model, backend="k3", fullgraph=True, options=options)
    worst = _decode(step, eager, cfg, 50)
    compiled = next(c for c in reversed(k3be._compiled) if c.guards)  # this test's
    entry = compiled.buckets[next(iter(compiled.buckets))]
    assert entry.graph is not None, "the bucket was not captured in a CUDA graph"
    assert entry.runs == 50
    # the replays read the fused groups' weights packed into one buffer each (stage `pack`)
    packs = [notes["pack"] for notes in compiled.observer.notes.values() if "pack" in notes]
    assert any(p.packed for p in packs), packs
    assert worst <= TOL["inductor_fp32"], f"worst relative logit error {worst:.3g}"
    for (name, a), (_, b) in zip(model.named_buffers(), eager.named_buffers()):
        if a.dim() >= 3 and a.dtype != torch.uint8:
            assert rel_err(a[:8], b[:8]) <= TOL["inductor_fp32"], name


def _edges(dot: str) -> list[tuple[str, str]]:
    return re.findall(r'"([^"]+)"\s*->\s*"([^"]+)"', dot)


def test_inductor_cuda_graph_with_side_streams_equals_eager(tmp_path):
    """Executor inductor under CUDA graphs with the shared experts on side stream 1 (their ops'
    `stream=1`): 24 replays equal eager, and the captured graph branches (on one stream a capture
    is a chain: no node with two successors). Three layers, one bucket: Inductor's GPU compile of
    the full configs outruns a device call."""
    from k3compile.stages.streams import hazards, takes_stream

    torch._dynamo.reset()
    cfg = get_config("tiny").with_layers(3)  # dense layer 0, two MoE layers: two side branches
    kw = {"device": "cuda", "dtype": torch.float32, "max_batch": 8, "max_seq_len": 64}
    eager, model = build_model(cfg, **kw), build_model(cfg, **kw)
    options = {"buckets": (4,), "fuse_without_kernels": True, "executor": "inductor",
               "side_streams": True}
    step = torch.compile(model, backend="k3", fullgraph=True, options=options)
    steps = 24
    worst = _decode(step, eager, cfg, steps)
    compiled = next(c for c in reversed(k3be._compiled) if c.guards)  # this test's
    (entry,) = compiled.buckets.values()
    assert entry.graph is not None and entry.runs == steps
    assert worst <= TOL["inductor_fp32"], f"worst relative logit error {worst:.3g}"
    graph = compiled.observer.graphs[4]
    side = [n for n in graph.nodes if takes_stream(n) and n.kwargs.get("stream")]
    assert [str(n.target) for n in side] == ["k3.situ_gate_up.default", "k3.linear.default"] * 2
    assert hazards(graph) == []
    # capture the bucket's step once more, with the graph's debug dump
    g = torch.cuda.CUDAGraph(keep_graph=True)  # else the graph is gone before the dump
    g.enable_debug_mode()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        entry.fn(*entry.static_in)
    g.debug_dump(str(tmp_path / "step.dot"))
    edges = _edges((tmp_path / "step.dot").read_text())
    succ, pred = collections.Counter(a for a, _ in edges), collections.Counter(b for _, b in edges)
    assert edges and max(succ.values()) >= 2 and max(pred.values()) >= 2, "one stream only"


def test_second_spelling_replays_equal_to_eager_and_sees_weight_updates():
    """The transformers-style spelling (tests/models/hf_k3.py: per-expert modules stacked by
    `k3.expert_stack`, LUT dequant, non-absorbed MLA, ...) captured and replayed: equal to its
    eager copy, and a write through `.data` into an expert's packed weights and into a KDA
    projection after capture is what the next replay computes with."""
    from tests.models.hf_k3 import from_reference

    torch._dynamo.reset()
    cfg = get_config("tiny")
    kw = {"device": "cuda", "dtype": torch.float32, "max_batch": 8, "max_seq_len": 64}
    eager, model = (from_reference(build_model(cfg, **kw)) for _ in range(2))
    options = {"buckets": (4,), "fuse_without_kernels": True, "executor": "aten"}
    step = torch.compile(model, backend="k3", fullgraph=True, options=options)
    assert _decode(step, eager, cfg, 6) <= TOL["inductor_fp32"]
    compiled = next(c for c in reversed(k3be._compiled) if c.guards)
    entry = compiled.buckets[next(iter(compiled.buckets))]
    assert entry.graph is not None, "the bucket was not captured in a CUDA graph"
    (graph,) = compiled.observer.graphs.values()
    stacks = [n for n in graph.nodes if n.target is torch.ops.k3.expert_stack.default]
    assert stacks, "the per-expert weights are not read through k3.expert_stack"
    shape = eager.model.layers[1].block_sparse_moe.experts[0].gate_proj.weight_packed.shape
    new = torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8)
    for m in (model, eager):  # the same update on both, through .data (no version bump)
        m.model.layers[1].block_sparse_moe.experts[0].gate_proj.weight_packed.data.copy_(new)
        m.model.layers[1].self_attn.o_proj.weight.data.mul_(1.5)
    assert _decode(step, eager, cfg, 4) <= TOL["inductor_fp32"]
