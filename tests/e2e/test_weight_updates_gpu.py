"""The weight-update matrix of tests/e2e/test_weight_updates.py on the CUDA-graph path (issue 20,
item 2): every step after the first replays the bucket's captured graph, which reads the
parameters at the addresses it saw. In-place updates and aliases taken before the compile write
those addresses (pack re-points the aliases' storages at the packed rows); `param.data = t`,
`.to(dtype)` and back, and `model.to("cuda")` give a parameter new memory, and the step is then
captured again (backend `_moved`): every step equal to eager, never the old weights."""

from __future__ import annotations

import pytest
import torch

import k3compile.backend as k3be
from tests.conftest import TOL, rel_err
from tests.e2e.test_weight_updates import (
    LAYER,
    TARGETS,
    _copy,
    aliases_before,
    build_pair,
    logits,
    pack_report,
    perturbed,
    run_matrix,
    step_args,
)

pytestmark = pytest.mark.gpu

OPTIONS = {"executor": "aten", "buckets": (4,), "fuse_without_kernels": True}


def _bucket():
    (entry,) = k3be.last_compiled().buckets.values()
    return entry


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_every_update_is_seen_by_the_replayed_graph(pack):
    torch._dynamo.reset()
    model, eager = build_pair(device="cuda")
    before = {"model": aliases_before(model), "eager": aliases_before(eager)}
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={**OPTIONS, "pack_weights": pack})
    args = step_args(0, "cuda")
    assert rel_err(logits(step(*args)), logits(eager(*args))) <= TOL["inductor_fp32"]
    assert _bucket().graph is not None, "the bucket was not captured in a CUDA graph"
    if pack:
        assert pack_report().packed, pack_report()
    steps = run_matrix(step, model, eager, before, TOL["inductor_fp32"], device="cuda")
    assert _bucket().runs == steps  # every step ran the bucket (captured again after a rebind)
    assert _bucket().graph is not None


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_device_and_dtype_change_are_seen(pack):
    """A bf16 model compiled and stepped on the CPU, then `.to("cuda")` and `.float()` (Dynamo
    recompiles on the device and dtype guards; the CUDA step is captured), replayed, updated in
    place, replayed: each step equal to eager. (Back to bf16 eager itself cannot run: its fp32
    states would become bf16; tests/e2e/test_weight_updates.py checks the compiled step raises.)"""
    torch._dynamo.reset()
    model, eager = build_pair(torch.bfloat16)
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={**OPTIONS, "pack_weights": pack})
    args = step_args(0)
    assert rel_err(logits(step(*args)), logits(eager(*args))) <= TOL["bfloat16"]
    for m in (model, eager):
        m.to("cuda").float()
    gen = torch.Generator().manual_seed(3)
    for i, change in enumerate([None, None, "update", None], start=1):
        if change == "update":
            name = LAYER + TARGETS[0]
            new = perturbed(eager, name, gen)
            _copy(model, None, name, new), _copy(eager, None, name, new)
        got, want = logits(step(*step_args(i, "cuda"))), logits(eager(*step_args(i, "cuda")))
        assert got.dtype == want.dtype == torch.float32 and got.is_cuda, (i, change)
        # the CPU bf16 step wrote the states: bf16 rounding carries into the fp32 steps
        assert rel_err(got, want) <= TOL["gpu_bf16"], (i, change, rel_err(got, want))
    assert _bucket().graph is not None and _bucket().runs == 4


def test_a_rebound_parameter_is_captured_again():
    """`param.data = t` (same dtype and shape: no Dynamo guard sees it) under a captured graph:
    the next step captures again and reads t."""
    torch._dynamo.reset()
    model, eager = build_pair(device="cuda")
    step = torch.compile(model, backend="k3", fullgraph=True, options=OPTIONS)
    for i in range(2):  # capture, replay
        step(*step_args(i, "cuda")), eager(*step_args(i, "cuda"))
    graph = _bucket().graph
    name = LAYER + TARGETS[0]
    new = perturbed(eager, name, torch.Generator().manual_seed(4))
    for m in (model, eager):
        m.get_parameter(name).data = new.clone()
    got, want = logits(step(*step_args(2, "cuda"))), logits(eager(*step_args(2, "cuda")))
    assert _bucket().graph is not graph, "the graph was replayed on the old weight's address"
    assert rel_err(got, want) <= TOL["inductor_fp32"]
