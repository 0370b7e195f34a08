"""`k3compile.adapt` stacks each MoE block's routed experts at adapt time: per projection one
[E, ...] buffer (dense `weight`; MXFP4 `weight_packed` and `weight_scale`: tests/adapt/
test_mxfp4_load.py), every expert's parameter a view of its row, so the step reads one graph input
per tensor instead of E (`kimi_linear.stack_experts`, `pack.stack_parts`).

1. the model's `state_dict()` names and values unchanged; parameters are views of the stacks;
   the adapted step's logits bit-equal to an unstacked adapter's (fp32 and bf16, eager;
   compiled fp32 in the slow run);
2. updates through the per-expert parameters are seen (issue 20's rules): `param.copy_`,
   `param.data.copy_`, `load_state_dict`, a `state_dict()` tensor taken before adapt or after
   the compile, and `step.to(dtype)` (stacked again); eager here, compiled in the slow run;
   references: Moonshot's own forward, which reads the per-expert parameters;
3. where a tensor cannot move (tied experts), the block reads its experts one by one, with the
   reason, and is still right.
"""

from __future__ import annotations

import pytest
import torch

import k3compile.backend as k3be
from k3compile.adapt import adapt, kimi_linear
from tests.adapt.test_moonshot import PROMPT, compile_step, rel

LAYER = "model.layers.1.block_sparse_moe"  # KDA + MoE; layer 2 is MLA + MoE
SLOTS, START = torch.arange(PROMPT.shape[0]), torch.zeros(PROMPT.shape[0], dtype=torch.long)


def _model(moonshot, dtype=torch.float32):
    return moonshot.build(moonshot.tiny_config(num_hidden_layers=3, mla_layers=(2,)), dtype=dtype)


def _unstacked(monkeypatch, model):
    with monkeypatch.context() as m:
        m.setattr(kimi_linear, "stack_parts", lambda parts: "stacking off (test)")
        return adapt(model, max_batch=2, max_seq_len=16)


def _blocks(step):
    return [m for m in step.modules() if type(m).__name__.endswith("KimiSparseMoeBlock")]


def prompt_logits(step):
    step.reset_cache()
    return step(PROMPT, START, SLOTS)[:, -1]


def moonshot_logits(model):
    with torch.no_grad():
        return model(input_ids=PROMPT).logits[:, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stacks_are_the_parameters_storage_and_change_no_value(moonshot, monkeypatch, dtype):
    model = _model(moonshot, dtype)
    names = {n: t.clone() for n, t in model.state_dict().items()}
    plain = _unstacked(monkeypatch, model)
    assert all(b.expert_stacks is None for b in _blocks(plain))
    want = prompt_logits(plain)
    step = adapt(model, max_batch=2, max_seq_len=16)
    blocks = _blocks(step)
    assert len(blocks) == 2 and all(b.expert_stacks == ["stacked_w1_weight", "stacked_w2_weight",
                                                        "stacked_w3_weight"] for b in blocks)
    for block in blocks:
        stack = block.stacked_w2_weight
        assert stack.shape == (16, 128, 128)  # E, routed expert width, intermediate
        for e, expert in enumerate(block.experts):
            assert expert.w2.weight.data_ptr() == stack[e].data_ptr()
    state = model.state_dict()
    assert list(state) == list(names) and all(torch.equal(state[n], names[n]) for n in names)
    assert not any("stacked" in n for n in step.state_dict())
    assert torch.equal(prompt_logits(step), want)  # bit-equal, fp32 and bf16
    assert torch.equal(prompt_logits(plain), want)  # the unstacked adapter reads them too
    again = adapt(model, max_batch=2, max_seq_len=16)  # already stacked: the same buffers
    assert all(a.stacked_w1_weight.data_ptr() == b.stacked_w1_weight.data_ptr()
               for a, b in zip(_blocks(again), blocks, strict=True))


def _w2(model, e):
    return model.get_submodule(f"{LAYER}.experts.{e}.w2").weight


def _updates(model, before: dict):
    """(name, update) pairs, each adding 0.5 to every expert's w2 in layer 1 its own way."""
    keys = [n for n in before if n.startswith(f"{LAYER}.experts.") and n.endswith("w2.weight")]
    experts = range(len(keys))

    def param_copy():
        for e in experts:
            _w2(model, e).copy_(_w2(model, e) + 0.5)

    def data_copy():
        for e in experts:
            _w2(model, e).data.copy_(_w2(model, e).data + 0.5)

    def load_state_dict():
        model.load_state_dict({n: model.state_dict()[n] + 0.5 for n in keys}, strict=False)

    def alias_before():
        for n in keys:
            before[n].add_(0.5)  # a state_dict() tensor taken before adapt

    def alias_after():
        state = model.state_dict()
        for n in keys:
            state[n].add_(0.5)

    return [("param.copy_", param_copy), ("param.data.copy_", data_copy),
            ("load_state_dict", load_state_dict), ("state_dict before adapt", alias_before),
            ("state_dict after compile", alias_after)]


def _assert_updates_seen(model, step, before):
    for what, update in _updates(model, before):
        old = moonshot_logits(model)
        with torch.no_grad():
            update()
        want = moonshot_logits(model)
        assert rel(want, old) > 1e-3, what  # the update matters
        assert rel(prompt_logits(step), want) <= 1e-5, what


def test_updates_through_expert_parameters_are_seen_eager(moonshot):
    model = _model(moonshot)
    before = model.state_dict()
    step = adapt(model, max_batch=2, max_seq_len=16)
    _assert_updates_seen(model, step, before)
    rebound = _w2(model, 3)
    rebound.data = rebound.data + 0.5  # new memory: the eager step stacks again
    want = moonshot_logits(model)
    assert rel(prompt_logits(step), want) <= 1e-5
    step.double()  # parameters and stacks converted apart: stacked again
    assert all(kimi_linear.stacks_intact(b) for b in _blocks(step))
    assert all(b.stacked_w1_weight.dtype == torch.float64 for b in _blocks(step))
    with torch.no_grad():
        _w2(model, 0).mul_(0)
    assert torch.equal(_blocks(step)[0].stacked_w2_weight[0], torch.zeros_like(_w2(model, 0)))


def test_tied_experts_are_read_one_by_one(moonshot, caplog):
    model = _model(moonshot)
    block = model.get_submodule(LAYER)
    block.experts[1].w1.weight = block.experts[0].w1.weight  # tied: cannot move apart
    want = moonshot_logits(model)
    with caplog.at_level("INFO", logger="k3compile"):
        step = adapt(model, max_batch=2, max_seq_len=16)
    first, second = _blocks(step)
    assert first.expert_stacks is None and second.expert_stacks is not None
    assert "experts.*.w1.weight: two weights share one storage (tied)" in caplog.text
    assert rel(prompt_logits(step), want) <= 1e-5


def _graph_inputs() -> int:
    (graph,) = k3be.last_compiled().observer.graphs.values()
    return sum(n.op == "placeholder" for n in graph.nodes)


@pytest.mark.slow
def test_compiled_reads_the_stacks_bit_equal_and_sees_updates(moonshot, monkeypatch):
    """fp32: the compiled stacked step is bit-equal to the compiled unstacked one, its graph
    takes E times fewer expert inputs, and every update of the matrix is seen."""
    model = _model(moonshot)
    before = model.state_dict()
    compiled = compile_step(adapt(model, max_batch=2, max_seq_len=16))
    got = prompt_logits(compiled)
    inputs = _graph_inputs()
    plain = compile_step(_unstacked(monkeypatch, model))  # reads the stacked experts one by one
    assert torch.equal(got, prompt_logits(plain))
    # 2 MoE layers x 3 projections: E = 16 inputs each unstacked, 1 stacked
    assert _graph_inputs() - inputs == 2 * 3 * 15
    _assert_updates_seen(model, compiled, before)
