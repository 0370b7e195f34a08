"""A bad call of the compiled step raises what eager raises (issue 20 item 8), and padding finds
the slot input from the graph, whatever it is called (the backend's `_pad` / `scratch`).

A float id or batch sizes that disagree used to fail inside Dynamo's trace (the first call, or
the recompile a later call triggers) and reach the caller as Dynamo's `TorchRuntimeError`, or an
`AssertionError` from a guard where the batch was marked unbacked. k3compile/calls.py's pre-hook
checks the call before Dynamo sees it: the built-in models register it (first call covered),
any other module gets it from the backend after its first compile. Each test compares the
exception's type and message with the eager module's, or with validate.py's clear error.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import k3compile.backend as k3be
from k3compile.calls import check_calls
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err
from tests.e2e.test_validation import ForeignDecode, IndexingDecode, _states
from tests.models.hf_k3 import from_reference

GOOD = ((1, 2, 3), (0, 3, 1), (0, 2, 1))
BAD = {  # Dynamo's trace fails on these: its fake run of the embedding, of a view
    "float ids": ((1.0, 2.0, 3.0), (0, 3, 1), (0, 2, 1)),
    "float positions": ((1, 2, 3), (0.0, 3.0, 1.0), (0, 2, 1)),
    "batch sizes differ": ((1, 2, 3), (0, 3), (0, 2, 1)),
}


class CheckedDecode(IndexingDecode):
    """A decode module that registers the call check itself, as the built-in models do."""

    def __init__(self, **kw):
        super().__init__(**kw)
        check_calls(self, ("input_ids", "positions", "slots"))


class RenamedDecode(ForeignDecode):
    """The foreign step with other argument names: nothing says which one holds the slots."""

    def forward(self, tokens, start, rows):
        return super().forward(tokens, start, rows)


def _toy(cls):
    torch.manual_seed(0)
    return cls().eval().requires_grad_(False)


def _args(values, mark: bool):
    args = tuple(torch.tensor(v) for v in values)
    if mark:
        k3be.mark_batch(*args)
    return args


def _raised(fn, *args) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn(*args)
    return type(info.value), str(info.value)


def _compile(model, buckets=(4,), **kw):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "buckets": buckets}, **kw)


# ---- the call check ------------------------------------------------------------------------------


@pytest.mark.parametrize("mark", [False, True], ids=["static", "mark_batch"])
@pytest.mark.parametrize("when", ["first", "later"])
@pytest.mark.parametrize("case", BAD)
def test_a_model_with_the_check_raises_eagers_error(case, when, mark):
    model, eager = _toy(CheckedDecode), _toy(CheckedDecode)
    step = _compile(model)
    if when == "later":
        assert rel_err(step(*_args(GOOD, mark)), eager(*_args(GOOD, mark))) <= TOL["aten_cpu"]
    before = _states(model)
    want = _raised(eager, *_args(BAD[case], False))
    assert want[0] is ValueError and "k3: " in want[1]
    assert _raised(step, *_args(BAD[case], mark)) == want
    assert all(torch.equal(b, before[n]) for n, b in _states(model).items())
    assert rel_err(step(*_args(GOOD, mark)), eager(*_args(GOOD, mark))) <= TOL["aten_cpu"]


@pytest.mark.parametrize("case", BAD)
def test_any_module_gets_the_check_at_its_first_compile(case):
    """A module that registers nothing: from the second call on, validate's clear error names the
    argument (the first call's trace is Dynamo's); the hook adds no recompile."""
    model, eager = _toy(ForeignDecode), _toy(ForeignDecode)
    step = _compile(model)
    for _ in range(2):
        assert rel_err(step(*_args(GOOD, False)), eager(*_args(GOOD, False))) <= TOL["aten_cpu"]
    kind, message = _raised(step, *_args(BAD[case], False))
    name = "positions" if case == "float positions" else "input_ids"
    assert kind is ValueError
    assert message.startswith(f"k3: {name} has dtype torch.float32" if "float" in case
                              else "k3: the inputs disagree on the batch size")
    assert counters["stats"]["unique_graphs"] == 1


def test_values_the_trace_accepts_raise_validates_error_in_both_calls():
    """An id past the vocabulary: eager raises IndexError after nothing was written; the step
    raises validate's ValueError naming the argument, at its first call and later."""
    for when in ("first", "later"):
        model = _toy(CheckedDecode)
        step = _compile(model)
        if when == "later":
            step(*_args(GOOD, True))
        kind, message = _raised(step, *_args(((1, 32, 3), (0, 3, 1), (0, 2, 1)), True))
        assert kind is ValueError and message.startswith("k3: input_ids [1, 32, 3]: [32] outside")


def test_the_check_inside_a_larger_compiled_module_is_traced():
    """Dynamo inlines the hook where the checked module is a submodule: still one graph."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _toy(CheckedDecode)

        def forward(self, input_ids, positions, slots):
            return self.inner(input_ids, positions, slots) * 2

    model, eager = Wrapper(), Wrapper()
    step = _compile(model)
    assert rel_err(step(*_args(GOOD, False)), eager(*_args(GOOD, False))) <= TOL["aten_cpu"]
    assert counters["stats"]["unique_graphs"] == 1


# ---- padding finds the slot input structurally --------------------------------------------------


@pytest.mark.parametrize("mark", [False, True], ids=["mark_dynamic", "mark_batch"])
def test_renamed_step_pads_to_the_bucket_with_the_scratch_slot(mark):
    """Batch 3 in bucket 4: padding rows take the scratch slot (4), found from the graph; every
    real state row equals eager's after each step."""
    model, eager = _toy(RenamedDecode), _toy(RenamedDecode)
    step = _compile(model)
    for i, values in enumerate([GOOD, ((4, 5, 6), (1, 4, 2), (0, 2, 1)), ((7, 8), (2, 5), (3, 1))]):
        args = tuple(torch.tensor(v) for v in values)
        for a in args:
            k3be.mark_batch(a) if mark else torch._dynamo.mark_dynamic(a, 0)
        assert rel_err(step(*args), eager(*args)) <= TOL["aten_cpu"], i
        ours = _states(model)
        for name, buf in _states(eager).items():
            assert rel_err(ours[name][:4], buf[:4]) <= TOL["aten_cpu"], (i, name)
    compiled = k3be.last_compiled()
    assert compiled.scratch == 4 and compiled.checks.slots.name == "rows"
    assert {key[0] for key in compiled.buckets} == {4}, "batch 3 was compiled without padding"


# ---- the built-in model and the second spelling --------------------------------------------------

CFG = dataclasses.replace(get_config("tiny"), num_hidden_layers=2, full_attn_layers=(1,),
                          first_k_dense_replace=2)


def _k3(spelling: str, max_batch: int = 4):
    model = build_model(CFG, dtype=torch.float32, max_batch=max_batch, max_seq_len=32)
    return from_reference(model) if spelling == "hf" else model


@pytest.mark.slow
@pytest.mark.parametrize("spelling", ["k3", "hf"])
def test_k3_bad_calls_raise_eagers_error_first_and_later(spelling):
    mark = True
    for when in ("first", "later"):
        for case in ("float ids", "batch sizes differ"):
            model, eager = _k3(spelling), _k3(spelling)
            step = _compile(model)
            if when == "later":
                step(*_args(GOOD, mark))
            assert _raised(step, *_args(BAD[case], mark)) == _raised(eager, *_args(BAD[case],
                                                                                   False))


@pytest.mark.slow
def test_mark_batch_with_the_second_spelling_and_dynamic_true():
    """One Dynamo graph for batch sizes 1..9 in random order (torch's counter), each bucket
    compiled once, logits and real state rows equal to eager's."""
    model, eager = _k3("hf", max_batch=9), _k3("hf", max_batch=9)
    step = _compile(model, buckets=(2, 4, 9), dynamic=True)
    batches = list(range(1, 10))
    random.Random(0).shuffle(batches)
    for i, batch in enumerate(batches):
        args = (torch.randint(0, CFG.vocab_size, (batch,)), torch.full((batch,), i),
                torch.randperm(9)[:batch])
        k3be.mark_batch(*args)
        assert rel_err(step(*args), eager(*args)) <= TOL["aten_cpu"], batch
    ours = dict(model.named_buffers())
    for name, buf in eager.named_buffers():
        if buf.dim() >= 3:
            assert rel_err(ours[name][:9], buf[:9]) <= TOL["aten_cpu"], name
    assert counters["stats"]["unique_graphs"] == 1, "Dynamo recompiled"
    assert sorted(key[0] for key in k3be.last_compiled().buckets) == [2, 4, 9]
