"""`k3compile.adapt` stacks each MoE block's routed experts at adapt time: per projection one
[E, ...] buffer (dense `weight`; MXFP4 `weight_packed` and `weight_scale`: tests/adapt/
test_mxfp4_load.py), every expert's parameter a view of its row, so the step reads one graph input
per tensor instead of E (`k3compile.adapt.stacks`, `pack.stack_parts`).

1. the model's `state_dict()` names and values unchanged; parameters are views of the stacks;
   the adapted step's logits bit-equal to an unstacked adapter's (fp32 and bf16, eager;
   compiled fp32 in the slow run);
2. updates through the per-expert parameters are seen (issue 20's rules): `param.copy_`,
   `param.data.copy_`, `load_state_dict`, a `state_dict()` tensor taken before adapt or after
   the compile; references: Moonshot's own forward, which reads the per-expert parameters;
   rebinds (`stacks.ExpertRow`) seen or refused: `param.data = t` (and writes through t after),
   `load_state_dict(assign=True)`, `model.to(bfloat16)` (the device move's stand-in on the CPU;
   `model.to("cuda")` in the gpu test) seen: logits equal a freshly adapted copy's; `param.data =`
   a view or another shape, `assign=True` of views, `model.double()` under
   `set_swap_module_params_on_conversion(True)` refused: the error, the parameters and the
   logits unchanged; `step.to(dtype)` converts the stacks. Eager here, compiled in the slow run
   (no recompile for a rebind in the same dtype);
3. where a tensor cannot move (tied experts), the block reads its experts one by one, with the
   reason, and is still right.
"""

from __future__ import annotations

import copy

import pytest
import torch

import k3compile.backend as k3be
from k3compile.adapt import adapt, stacks
from k3compile.stages.pack import CAN_REPOINT
from tests.adapt.test_moonshot import PROMPT, TOL_COMPILED_BF16, compile_step, rel

LAYER = "model.layers.1.block_sparse_moe"  # KDA + MoE; layer 2 is MLA + MoE
TOL = {torch.float32: 1e-5, torch.bfloat16: TOL_COMPILED_BF16}  # against a fresh adapter, Moonshot
SLOTS, START = torch.arange(PROMPT.shape[0]), torch.zeros(PROMPT.shape[0], dtype=torch.long)


def _model(moonshot, dtype=torch.float32):
    return moonshot.build(moonshot.tiny_config(num_hidden_layers=3, mla_layers=(2,)), dtype=dtype)


def _unstacked(monkeypatch, model):
    with monkeypatch.context() as m:
        m.setattr(stacks, "stack_parts", lambda parts: "stacking off (test)")
        return adapt(model, max_batch=2, max_seq_len=16)


def _blocks(step):
    return [m for m in step.modules() if type(m).__name__.endswith("KimiSparseMoeBlock")]


def prompt_logits(step):
    step.reset_cache()
    device = step.lm.lm_head.weight.device
    return step(PROMPT.to(device), START.to(device), SLOTS.to(device))[:, -1]


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
        if what == "state_dict before adapt" and not CAN_REPOINT:  # torch 2.11: README "Weights"
            continue
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


def _fresh_logits(model):
    """The logits of a freshly adapted copy of the model (its own stacks)."""
    return prompt_logits(adapt(copy.deepcopy(model), max_batch=2, max_seq_len=16))


def _rows_of_stacks(block) -> bool:
    """Whether every expert tensor is still its row of the block's stack."""
    for key in block.expert_stacks:
        _, projection, tensor = key.split("_", 2)
        stack = getattr(block, key)
        for e, expert in enumerate(block.experts):
            part = getattr(getattr(expert, projection), tensor)
            if not (type(part) is stacks.ExpertRow and part.data_ptr() == stack[e].data_ptr()
                    and (part.dtype, part.device) == (stack.dtype, stack.device)):
                return False
    return True


def _rebound(model, shift: float) -> dict:
    """Layer 1's expert w2 weights plus `shift`, each in its own new memory."""
    return {f"{LAYER}.experts.{e}.w2.weight": _w2(model, e).detach() + shift for e in range(16)}


def _rebinds(model, step):
    """(what, rebind, refusal): each rebinds layer 1's expert w2 weights its own way; refusal is
    None where the rebind is seen, else (any of) the error's words (the exception's or its
    cause's)."""

    def data():
        p, t = _w2(model, 3), _w2(model, 3).detach() + 0.5
        p.data = t
        t.add_(0.25)  # t is the parameter's memory now, as torch's `param.data = t` promises

    def assign():
        model.load_state_dict(_rebound(model, 0.5), strict=False, assign=True)

    def data_view():
        big = torch.zeros(2, *_w2(model, 3).shape)
        big[1] = _w2(model, 3) + 0.5
        _w2(model, 3).data = big[1]

    def data_shape():
        _w2(model, 3).data = torch.zeros(3, 3)

    def assign_views():
        big = torch.stack(list(_rebound(model, 0.5).values()))
        model.load_state_dict(dict(zip(_rebound(model, 0).keys(), big, strict=True)),
                              strict=False, assign=True)

    def swap_convert():
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.double()
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
            model.float()  # what the refused call converted before the first expert

    def to_dtype():
        stacks = [b.stacked_w2_weight for b in _blocks(step)]
        model.to(torch.bfloat16)
        for block, old in zip(_blocks(step), stacks, strict=True):
            assert block.stacked_w2_weight.dtype == torch.bfloat16 and old.dtype == torch.float32
        step.setup_cache(2, 16)  # the step's own caches, in the model's dtype again

    return [("param.data = t", data, None),
            ("load_state_dict(assign=True)", assign, None),
            ("param.data = a view", data_view, "a weight is a view into a larger storage"),
            ("param.data = another shape", data_shape, "its stack holds (128, 128), not (3, 3)"),
            ("load_state_dict(assign=True) of views", assign_views,
             "The block's experts were left as they were"),
            # torch refuses first where the compile holds weakrefs to the parameters
            ("model.double() swapping tensors", swap_convert,
             ("refused to swap this parameter", "Cannot swap t1 because it has weakref")),
            ("model.to(bfloat16)", to_dtype, None)]


def _assert_rebinds_seen_or_refused(model, step):
    for what, rebind, refusal in _rebinds(model, step):
        old, olds = prompt_logits(step), [_w2(model, e) for e in range(16)]
        values = [w.detach().clone() for w in olds]
        if refusal is None:
            with torch.no_grad():
                rebind()
            want = _fresh_logits(model)
            assert rel(want, old) > 1e-3, what  # the rebind matters
            assert rel(prompt_logits(step), want) <= TOL[want.dtype], what
            assert rel(moonshot_logits(model), want) <= TOL[want.dtype], what
        else:
            with pytest.raises((ValueError, RuntimeError)) as raised, torch.no_grad():
                rebind()
            error = raised.value if isinstance(raised.value, ValueError) else raised.value.__cause__
            refusals = (refusal,) if isinstance(refusal, str) else refusal
            assert any(r in str(error) for r in refusals), (what, str(error))
            assert torch.equal(prompt_logits(step), old), what
            assert all(_w2(model, e) is olds[e] and torch.equal(olds[e], values[e])
                       for e in range(16)), what
        assert all(_rows_of_stacks(b) for b in _blocks(step)), what


def test_rebinds_of_expert_parameters_are_seen_or_refused_eager(moonshot):
    model = _model(moonshot)
    step = adapt(model, max_batch=2, max_seq_len=16)
    _assert_rebinds_seen_or_refused(model, step)
    step.float()  # the step converts the experts with their stacks
    assert all(b.stacked_w1_weight.dtype == torch.float32 for b in _blocks(step))
    assert all(_rows_of_stacks(b) for b in _blocks(step))
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


@pytest.mark.slow
def test_compiled_sees_or_refuses_rebinds_without_recompiling(moonshot):
    """The rebind matrix on the compiled step: a rebind within dtype and device recompiles
    nothing (the graph reads the stacks, not the parameters), model.to(float64) recompiles."""
    model = _model(moonshot)
    compiled = compile_step(adapt(model, max_batch=2, max_seq_len=16))
    prompt_logits(compiled)
    compiles = len(k3be._compiled)
    _assert_rebinds_seen_or_refused(model, compiled)
    assert len(k3be._compiled) == compiles + 1  # model.to(float64): a new graph, once


@pytest.mark.gpu
def test_model_to_cuda_moves_the_stacks(moonshot):
    """The user's `model.to("cuda")` after adapt moves each stack with its experts (torch's
    `param.data = t` across devices: `ExpertRow`), eager and compiled; `step.to("cuda")` then
    moves the step's own caches. Logits: a freshly adapted copy on the GPU, and the CPU's."""
    model = _model(moonshot)
    step = adapt(model, max_batch=2, max_seq_len=16)
    on_cpu = prompt_logits(step)
    model.to("cuda")
    assert all(b.stacked_w2_weight.is_cuda and _rows_of_stacks(b) for b in _blocks(step))
    step.to("cuda")
    want = _fresh_logits(model)
    assert rel(prompt_logits(step), want) <= 1e-5
    assert rel(want.cpu(), on_cpu) <= 1e-4
    compiled = compile_step(step)
    assert rel(prompt_logits(compiled), want) <= 1e-4
    with torch.no_grad():
        model.load_state_dict(_rebound(model, 0.5), strict=False, assign=True)
    want = _fresh_logits(model)
    assert rel(want.cpu(), on_cpu) > 1e-3  # the rebinding took
    assert rel(prompt_logits(compiled), want) <= 1e-4
