"""Stage `stack_inputs` (k3compile.stages.stack_inputs): a packed expert stack is one input of the
graph the executor compiles; the wrapper maps the caller's per-part arguments onto it, and a part
rebound after compile is read as it is now (never the old buffer). A small graph first, then the
transformers-style spelling (k3compile/models/hf_k3.py, per-expert `nn.ModuleList` experts) on
the CPU, with the stage on and off."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from k3compile.models.hf_k3 import from_reference
from k3compile.rewrite import inductor
from k3compile.stages.stack_inputs import stack_placeholders
from tests.conftest import TOL, rel_err

E = 4


def _step(ids, x, p0, p1, p2, p3):
    """Experts picked by ids from the stack, and one part also read on its own."""
    stack = torch.ops.k3.expert_stack.default([p0, p1, p2, p3])
    return (torch.ops.aten.index.Tensor(stack, [ids]).sum(1) * x + p2.sum(0),)


def _graph(buffer):
    ids, x = torch.tensor([2, 0]), torch.randn(2, 16)
    args = [ids, x, *buffer.unbind(0)]
    gm = make_fx(_step, tracing_mode="fake")(*args)
    return gm, args


def test_a_packed_stack_is_one_input_and_a_rebound_part_is_read_as_it_is(caplog):
    buffer = torch.randn(E, 8, 16)
    gm, args = _graph(buffer)
    want = _step(*args)[0]
    stacked = stack_placeholders(gm, args)
    assert stacked is not None and len(stacked.stacks) == 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 3, [n.name for n in placeholders]  # ids, x, the stack
    assert stacked.static([2, 3, 4, 5]) == [2]  # the stack is static where every part was
    assert stacked.static([2, 3]) == []
    step = stacked.wrap(inductor.make_boxed_func(gm.forward))
    assert torch.equal(step(list(args))[0], want)
    with torch.no_grad():  # written in place: the buffer, read through the stack's view
        args[3].add_(1.0)
    assert torch.equal(step(list(args))[0], _step(*args)[0])
    args[4] = torch.randn(8, 16)  # rebound (`param.data = t`): no longer its row of the buffer
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        got = step(list(args))[0]
    assert torch.equal(got, _step(*args)[0])
    assert "moved" in caplog.text
    args[5] = torch.randn(8, 16)  # a later change of any part: read per call from now on
    assert torch.equal(step(list(args))[0], _step(*args)[0])


def test_parts_apart_are_left_as_they_are():
    buffer = torch.randn(E, 8, 16)
    gm, args = _graph(buffer)
    args[3] = args[3].clone()  # one part elsewhere: not one buffer
    assert stack_placeholders(gm, args) is None
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == 2 + E


# ---- the transformers-style spelling under backend="k3" ------------------------------------------

CFG = dataclasses.replace(get_config("tiny"), num_hidden_layers=4, full_attn_layers=(2, 3))
BUCKET = 4
EXPERT = "model.layers.1.block_sparse_moe.experts.{}.gate_proj.weight_packed"
_COMPILE = inductor.compile_fx_inner


def _model(dtype):
    return from_reference(build_model(CFG, dtype=dtype, max_batch=4, max_seq_len=64, seed=0))


def _inputs(batch, dynamic):
    gen = torch.Generator().manual_seed(0)
    pos, slots = torch.tensor([0, 5, 9, 1][:batch]), torch.tensor([2, 0, 3, 1][:batch])
    for _ in range(3):
        ids = torch.randint(0, CFG.vocab_size, (batch,), generator=gen)
        if dynamic:
            for t in (ids, pos, slots):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        yield ids, pos, slots
        pos = pos + 1


def _run(dtype, dynamic, stack, executor="aten", monkeypatch=None):
    """Logits of each step of the compiled hf spelling, and what the compile recorded."""
    torch._dynamo.reset()
    model = _model(dtype)
    seen = []
    if monkeypatch is not None:  # the inputs Inductor compiles the graph on
        def spy(gm, inputs, **kw):
            seen.append(len(inputs))
            return _COMPILE(gm, inputs, **kw)

        monkeypatch.setattr(inductor, "compile_fx_inner", spy)
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": executor, "buckets": (BUCKET,),
                                  "stack_inputs": stack, "stage_cache": False})
    outs = []
    for ids, pos, slots in _inputs(3 if dynamic else BUCKET, dynamic):
        with torch.no_grad():
            outs.append(_logits(step(ids, pos, slots)).clone())
    notes = list(k3be.last_compiled().observer.notes.values())
    return outs, notes, seen, model


def _logits(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dynamic", [True, False], ids=["marked", "static"])
def test_outputs_equal_with_and_without_stacked_inputs(dtype, dynamic):
    on, notes, _, _ = _run(dtype, dynamic, True)
    off, _, _, _ = _run(dtype, dynamic, False)
    (note,) = notes
    assert note["stack_inputs"] is not None and len(note["stack_inputs"].stacks) == 18
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_inductor_takes_one_input_per_stack(monkeypatch):
    on, notes, seen_on, model = _run(torch.float32, False, True, "inductor", monkeypatch)
    off, _, seen_off, _ = _run(torch.float32, False, False, "inductor", monkeypatch)
    experts = [n for n, _ in model.named_parameters() if ".experts." in n]
    stacks = {n.split(".experts.")[0] + n.split(".experts.")[1].split(".", 1)[1]
              for n in experts}  # layer + weight name: one stack each
    (note,) = notes
    assert len(note["stack_inputs"].stacks) == len(stacks) == 18
    assert len(seen_on) == len(seen_off) == 1
    assert seen_off[0] - seen_on[0] == len(experts) - len(stacks)
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_a_rebound_expert_weight_is_seen(executor, caplog):
    """After the first step every expert's gate weight of layer 1 gets new memory and values
    (`param.data = t`) in the compiled model and its eager twin: the next steps agree with the
    twin, and differ from a third copy left as it was (the rebind matters)."""
    torch._dynamo.reset()
    model, eager, stale = _model(torch.float32), _model(torch.float32), _model(torch.float32)
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": executor, "buckets": (BUCKET,),
                                  "stage_cache": False})
    gen = torch.Generator().manual_seed(1)
    for n, (ids, pos, slots) in enumerate(_inputs(BUCKET, False)):
        if n == 1:
            for e in range(CFG.num_experts):
                new = torch.randint(0, 256, model.get_parameter(EXPERT.format(e)).shape,
                                    generator=gen, dtype=torch.uint8)
                for m in (model, eager):
                    m.get_parameter(EXPERT.format(e)).data = new.clone()
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="k3compile"):
            got = _logits(step(ids, pos, slots))
            want, old = _logits(eager(ids, pos, slots)), _logits(stale(ids, pos, slots))
        assert rel_err(got, want) <= TOL["aten_cpu"], (n, rel_err(got, want))
        if n >= 1:
            assert rel_err(old, want) > 100 * TOL["aten_cpu"], n
    notes = list(k3be.last_compiled().observer.notes.values())
    assert notes[0]["stack_inputs"] is not None
    assert "moved" in caplog.text
