"""Dynamo's warm start with the k3 backend (k3compile/precompile.py, `TORCH_CACHING_PRECOMPILE=1`).

In-process: the artifact the backend records rebuilds a compiled step whose buckets give bitwise
the original's outputs; nothing is recorded without torch's switch; what cannot be pickled is
logged and left out; an artifact of another format is refused with a clear error. `slow`: two
processes on one pair of cache folders, the second one tracing nothing (Dynamo's package loaded,
our graph restored), bitwise the first's outputs at two buckets, and a call the loaded guards
reject compiled afresh (torch's own path there fails on a global's name: `_names_past`).
"""

import json
import logging
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from k3compile import precompile
from k3compile.backend import K3Compiled, last_compiled, mark_batch
from k3compile.math import rms_norm
from tests.conftest import cold_and_warm

OPTIONS = {"executor": "aten", "buckets": (2, 4)}


class Step(nn.Module):
    """A norm feeding a GEMM whose output rows go to state rows `slots` (an input the step
    writes, as a decode step's state)."""

    def __init__(self, d: int = 32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(d, generator=g))
        self.w = nn.Parameter(torch.randn(d, d, generator=g) / d ** 0.5)
        self.register_buffer("state", torch.zeros(8, d))

    def forward(self, x, slots):
        y = torch.nn.functional.linear(rms_norm(x, self.norm, 1e-6), self.w)
        self.state.index_copy_(0, slots, y)
        return y * 2


def _inputs(batch: int):
    x = torch.randn(batch, 32, generator=torch.Generator().manual_seed(batch))
    return x, torch.arange(batch) * 2 % 7


def _run(step, batches, marked=True) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for b in batches:
            x, slots = _inputs(b)
            if marked:
                mark_batch(x, slots)
            outs.append(step(x, slots).clone())
    return outs


@pytest.fixture
def recording(monkeypatch):
    """Torch's switch on for this test (Dynamo reads it per torch.compile), a clean context; what
    the test restores is forgotten after it (`mark_batch` marks nothing in a restoring process)."""
    from torch._dynamo.precompile_context import PrecompileContext

    monkeypatch.setattr(precompile, "RESTORED", [])
    PrecompileContext.clear()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(caching_precompile=True):
        yield PrecompileContext
    PrecompileContext.clear()
    torch._dynamo.reset()


def test_the_artifact_rebuilds_the_step(recording, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the packages stay here
    model = Step()
    cold = _run(torch.compile(model, backend="k3", options=OPTIONS), [3, 2])
    original = last_compiled()
    (artifact,) = [a for a in recording._backend_artifacts_by_key.values()
                   if isinstance(a, precompile.K3Artifact)]
    restored = artifact.after_deserialization()
    assert isinstance(restored, K3Compiled) and restored is not original
    assert restored.signature.outputs_batched == original.signature.outputs_batched
    assert [i.name for i in restored.inputs] == [i.name for i in original.inputs]
    assert restored.guards == original.guards  # the same buckets over the same batch symbol
    model.state.zero_()
    with torch.no_grad():
        for b, want in zip([3, 2], cold, strict=True):
            x, slots = _inputs(b)
            assert torch.equal(_call_like_dynamo(original, model, x, slots, b, restored), want)
    assert precompile.RESTORED[-1] == artifact.key


def _call_like_dynamo(original, model, x, slots, batch, restored):
    """`restored` called as Dynamo's bytecode calls the compiled function: the graph's flat
    inputs in its placeholders' order (built from their names)."""
    by_name = {"l_x_": x, "l_slots_": slots}
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    args = []
    for inp in original.inputs:
        if inp.symint:
            args.append(batch)
        elif inp.name in by_name:
            args.append(by_name[inp.name])
        else:  # l_self_parameters_norm_ / l_self_buffers_state_
            args.append(next(t for k, t in params.items() if inp.name.endswith(f"_{k}_")))
    (out,) = restored(*args)
    return out


def test_nothing_is_recorded_without_the_switch():
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    gm._backend_id = "__compiled_fn_test"
    with torch._dynamo.config.patch(caching_precompile=False):
        assert not precompile.record(gm, None, None)


def test_what_cannot_be_pickled_is_logged_and_left_out(recording, caplog):
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    gm._backend_id = "__compiled_fn_test"
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        assert not precompile.record(gm, None, {"hook": lambda: 0})
    assert "is not saved for a warm start" in caplog.text
    assert "__compiled_fn_test" not in recording._backend_artifacts_by_key


def test_a_slice_bounded_by_the_batch_round_trips():
    """`x[:, :n]` with n a graph value: torch 2.11's GraphPickler met it as a raw node (the
    H200's compile of the yardstick failed so in session 19) unless slices are pytrees."""
    seen = []

    def backend(gm, _):
        gm.recompile()
        seen.append((gm.code, precompile._graph_bytes(gm)))
        return gm

    fn = torch.compile(lambda x: x[:, : x.shape[0]] * 2, backend=backend, dynamic=True)
    fn(torch.randn(3, 8))
    (code, data), = seen
    with precompile._slices_as_pytrees():
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler

        loaded = GraphPickler.loads(data, FakeTensorMode())
    loaded.recompile()
    assert loaded.code == code
    x = torch.randn(4, 8)
    args = [x if n.name.lower().startswith("l_x") else 4
            for n in loaded.graph.find_nodes(op="placeholder")]
    (out,) = loaded(*args)
    assert torch.equal(out, x[:, :4] * 2)


@pytest.mark.parametrize("content", [pickle.dumps({"format": -1}), b"not a pickle"],
                         ids=["another format", "not a pickle"])
def test_an_artifact_of_another_format_is_refused_clearly(content):
    with pytest.raises(RuntimeError, match="does not load.*remove .*start again"):
        precompile.K3Artifact(key="__compiled_fn_x", content=content).after_deserialization()


@pytest.mark.slow
def test_a_second_process_traces_nothing(tmp_path):
    env = {**os.environ, "TORCH_CACHING_PRECOMPILE": "1", "K3_QUIET": "1",
           "K3_CACHE_DIR": str(tmp_path / "k3"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    (cold, cold_out), (warm, warm_out) = cold_and_warm("tests.e2e.test_precompile", tmp_path, env)
    # two graphs: the marked batch's, and the transposed x's (the first one's guards reject it)
    assert cold["dynamo_cache"] == {"dynamo_cache_miss": 1} and cold["saved"] == 2
    assert cold["graphs"] == 2
    # warm: no trace but for the x that requires grad, which no saved graph's guards accept
    assert warm == {"dynamo_cache": {"dynamo_cache_hit": 1}, "saved": 3, "restored": 2,
                    "graphs": 1}
    for a, b in zip(cold_out, warm_out[:-1], strict=True):  # the last, warm only: below
        assert torch.equal(a, b)
    torch.testing.assert_close(warm_out[-1], Step()(*_inputs(5)).detach(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model = Step()
        for b, got in zip([3, 2], warm_out[:2], strict=True):
            torch.testing.assert_close(got, model(*_inputs(b)), rtol=1e-5, atol=1e-5)


def _one_process(out: Path, which: str) -> None:
    """test_a_second_process_traces_nothing's child: compile, two marked buckets, then a call
    whose strides the step's guards reject (a transposed x); warm, one more that every saved
    graph's guards reject (an x that requires grad); then save the packages."""
    from k3compile.backend import ensure_registered

    ensure_registered()
    model = Step()
    step = torch.compile(model, backend="k3", options=OPTIONS)
    outs = _run(step, [3, 2])
    with torch.no_grad():
        x, slots = _inputs(4)
        outs.append(step(x.t().contiguous().t(), slots).clone())
        if which == "warm":
            x, slots = _inputs(5)
            outs.append(step(x.requires_grad_(), slots).clone())
    saved = precompile.save()
    out.with_suffix(".json").write_text(json.dumps({
        "dynamo_cache": dict(counters["dynamo_cache"]), "saved": saved,
        "restored": len(precompile.RESTORED), "graphs": counters["stats"]["unique_graphs"]}))
    torch.save(outs, out.with_suffix(".pt"))


if __name__ == "__main__":
    _one_process(Path(sys.argv[1]), sys.argv[2])
