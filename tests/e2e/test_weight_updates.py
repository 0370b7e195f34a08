"""Weights updated after compile are what the compiled step computes with (issue 20, item 1).

Two copies of the tiny fp32 model, one compiled (executor aten), one eager; each update is applied
to both the same way, then both step on the same inputs and must agree. The weights are those of
fused groups: KDA's q_proj (`k3.linear_concat`), the shared experts' gate (`k3.situ_gate_up`),
the router (`k3.moe_front`), and in the transformers-style spelling (k3compile/models/hf_k3.py) the
stacked q|k|v parameter [3, W, D] whose rows `k3.linear_concat` reads as three weights, with
stage `pack` on (the groups live in one buffer, parameters are
views of it) and off (each weight its own tensor: the fused ops used to cache a concatenation,
keyed on the version counter, which `param.data.copy_` does not bump: the step never saw it).

Not covered yet (issue 20, item 2): a `state_dict()` tensor or a `.data` taken *before* the first
compile no longer aliases a packed parameter (README, "Weights").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from k3compile.models.hf_k3 import from_reference
from tests.conftest import TOL, rel_err

LAYER = "language_model.model.layers.1."
TARGETS = ("self_attn.q_proj.weight", "mlp.shared_experts.gate_proj.weight", "mlp.gate.weight")


def _copy(model, name, new):
    with torch.no_grad():
        model.get_parameter(name).copy_(new)


def _data_copy(model, name, new):
    model.get_parameter(name).data.copy_(new)


def _load_state_dict(model, name, new):
    model.load_state_dict({name: new}, strict=False)


def _state_dict_alias(model, name, new):  # a state_dict() taken after the compile aliases
    model.state_dict()[name].copy_(new)


UPDATES = {"copy_": _copy, "data.copy_": _data_copy, "load_state_dict": _load_state_dict,
           "state_dict alias": _state_dict_alias}


def _args(i):
    gen = torch.Generator().manual_seed(i)
    return (torch.randint(0, get_config("tiny").vocab_size, (3,), generator=gen),
            torch.tensor([i, 5 + i, 9 + i]), torch.tensor([2, 0, 1]))


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_every_update_is_seen_by_the_compiled_step(pack):
    torch._dynamo.reset()
    cfg = get_config("tiny")
    model, eager = (build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=64)
                    for _ in range(2))
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "pack_weights": pack, "buckets": (4,)})
    assert rel_err(step(*_args(0)), eager(*_args(0))) <= TOL["aten_cpu"]
    _step_and_update(model, eager, step, [LAYER + target for target in TARGETS])


def _step_and_update(model, eager, step, names):
    """Every update of UPDATES to each of `names`, on both models; the steps agree after each."""
    gen = torch.Generator().manual_seed(1)
    i = 1
    for how, update in UPDATES.items():
        for name in names:
            old = eager.get_parameter(name).detach().clone()
            new = old + 0.5 * torch.randn(old.shape, generator=gen)
            update(model, name, new)
            update(eager, name, new)
            want = eager(*_args(i))
            got = step(*_args(i))
            assert torch.equal(model.get_parameter(name), new), (how, name)
            # the update changes the output well beyond the tolerance: a stale weight would show
            assert rel_err(got, want) <= TOL["aten_cpu"], (how, name, rel_err(got, want))
            i += 1


@pytest.mark.slow
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_updates_of_a_stacked_qkv_parameter_are_seen(pack):
    """One KDA layer of the second spelling: q|k|v are `select`s of one [3, W, D] parameter that
    `k3.linear_concat` reads (packed: the parameter is rows of the group's buffer)."""
    torch._dynamo.reset()
    cfg = dataclasses.replace(get_config("tiny"), num_hidden_layers=1, full_attn_layers=())
    ref = build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=64)
    model, eager = from_reference(ref), from_reference(ref)
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "pack_weights": pack, "buckets": (4,)})
    assert rel_err(step(*_args(0)), eager(*_args(0))) <= TOL["aten_cpu"]
    (graph,) = k3be.last_compiled().observer.graphs.values()
    ops = [n for n in graph.nodes if n.target is torch.ops.k3.linear_concat.default]
    assert len(ops) == 1 and sum(w.op != "placeholder" for w in ops[0].args[1]) == 3
    attn = model.model.layers[0].self_attn
    group = [getattr(attn, n).weight for n in ("qkv_proj", "g_proj", "f_a_proj", "b_proj")]
    one_buffer = {w.untyped_storage().nbytes() for w in group} == {sum(w.nbytes for w in group)}
    assert one_buffer == pack
    _step_and_update(model, eager, step, ["model.layers.0.self_attn.qkv_proj.weight",
                                          "model.layers.0.self_attn.g_proj.weight"])
