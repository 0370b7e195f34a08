"""Weights updated after compile are what the compiled step computes with (issue 20, items 1-2).

Two copies of a two-layer tiny fp32 model (dense layer 0, KDA + MoE layer 1: every kind of fused
group), one compiled (executor aten), one eager; each update is applied to both the same way, then
both step on the same inputs and must agree. The weights are those of fused groups: KDA's q_proj
(`k3.linear_concat`), the shared experts' gate (`k3.situ_gate_up`), the router (`k3.moe_front`),
and in the transformers-style spelling (k3compile/models/hf_k3.py) the stacked q|k|v parameter
[3, W, D] whose rows `k3.linear_concat` reads as three weights,
with stage `pack` on (each group lives in one buffer, the parameters are views of it) and off
(each weight its own tensor: the fused ops used to cache a concatenation keyed on the version
counter, which `param.data.copy_` does not bump).

The matrix (README, "Weights"): `param.copy_`, `param.data.copy_`, `load_state_dict`, a write
through a `state_dict()` tensor taken after the compile, through a `state_dict()` tensor or a
`.data` taken before it (pack re-points the old storage at the packed rows), and `param.data = t`
(a new tensor for the parameter: the compiled step reads the parameter, so it sees the new one):
all seen. `.to(dtype)` and a second `torch.compile` of the same model: Dynamo's dtype guard
recompiles, and the recompile sees the new weights (pack leaves them where they are: an earlier
compile was handed them). The CUDA-graph path of the same matrix:
tests/e2e/test_weight_updates_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from k3compile.models.hf_k3 import from_reference
from k3compile.stages.pack import CAN_REPOINT
from tests.conftest import TOL, rel_err

CFG = get_config("tiny").with_layers(2)
LAYER = "language_model.model.layers.1."
TARGETS = ("self_attn.q_proj.weight", "mlp.shared_experts.gate_proj.weight", "mlp.gate.weight")


def _copy(model, before, name, new):
    with torch.no_grad():
        model.get_parameter(name).copy_(new)


def _data_copy(model, before, name, new):
    model.get_parameter(name).data.copy_(new)


def _load_state_dict(model, before, name, new):
    model.load_state_dict({name: new}, strict=False)


def _state_dict_after(model, before, name, new):
    model.state_dict()[name].copy_(new)


def _state_dict_before(model, before, name, new):  # taken before the first compiled call
    before["state_dict"][name].copy_(new)


def _data_before(model, before, name, new):
    before["data"][name].copy_(new)


def _rebind_data(model, before, name, new):  # the parameter gets a new tensor (and storage)
    model.get_parameter(name).data = new.clone()


# in order: a rebind leaves the aliases taken before (in eager too) and the packed buffer behind
UPDATES = {"copy_": _copy, "data.copy_": _data_copy, "load_state_dict": _load_state_dict,
           "state_dict after compile": _state_dict_after,
           "state_dict before compile": _state_dict_before, ".data before compile": _data_before,
           "param.data = t": _rebind_data}
ALIASED_BEFORE = ("state_dict before compile", ".data before compile")


def aliases_before(model) -> dict:
    """What a user may hold on to before the first compiled call."""
    return {"state_dict": model.state_dict(),
            "data": {name: p.data for name, p in model.named_parameters()}}


def build_pair(dtype=torch.float32, device="cpu"):
    kw = {"dtype": dtype, "device": device, "max_batch": 4, "max_seq_len": 64}
    return build_model(CFG, **kw), build_model(CFG, **kw)


def step_args(i, device="cpu"):
    gen = torch.Generator().manual_seed(i)
    args = (torch.randint(0, CFG.vocab_size, (3,), generator=gen),
            torch.tensor([i, 5 + i, 9 + i]), torch.tensor([2, 0, 1]))
    return tuple(a.to(device) for a in args)


def logits(out):
    return out[0] if isinstance(out, tuple) else out


def perturbed(eager, name, gen):
    """A new value for weight `name`: it changes the logits well beyond any tolerance here, so a
    stale weight would show."""
    old = eager.get_parameter(name).detach()
    return old + 0.5 * torch.randn(old.shape, generator=gen).to(old)


def pack_report():
    return next(n["pack"] for n in k3be.last_compiled().observer.notes.values() if "pack" in n)


def run_matrix(step, model, eager, before, tol, first_step=1, device="cpu"):
    """Every update of UPDATES on every target, each followed by one step of both models."""
    gen, i = torch.Generator().manual_seed(1), first_step
    for how, update in UPDATES.items():
        if how in ALIASED_BEFORE and not CAN_REPOINT:  # README "Weights": needs the storage swap
            continue
        for target in TARGETS:
            name = LAYER + target
            new = perturbed(eager, name, gen)
            update(model, before["model"], name, new)
            update(eager, before["eager"], name, new)
            want = logits(eager(*step_args(i, device)))
            got = logits(step(*step_args(i, device)))
            assert torch.equal(model.get_parameter(name), new), (how, target)
            if how in ALIASED_BEFORE:  # the alias still is the parameter's memory
                alias = before["model"]["data"][name]
                assert alias.data_ptr() == model.get_parameter(name).data_ptr(), (how, target)
            assert rel_err(got, want) <= tol, (how, target, rel_err(got, want))
            i += 1
    return i


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_every_update_is_seen_by_the_compiled_step(pack):
    torch._dynamo.reset()
    model, eager = build_pair()
    before = {"model": aliases_before(model), "eager": aliases_before(eager)}
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "pack_weights": pack, "buckets": (4,)})
    assert rel_err(logits(step(*step_args(0))), logits(eager(*step_args(0)))) <= TOL["aten_cpu"]
    report = pack_report() if pack else None
    if pack:  # the targets' groups really moved: their weights are views of one buffer
        assert len(report.packed) == 5 and not report.skipped, report
        for target in TARGETS:
            weight = model.get_parameter(LAYER + target)
            assert weight.untyped_storage().nbytes() > weight.nbytes, target
    run_matrix(step, model, eager, before, TOL["aten_cpu"])


@pytest.mark.skipif(not CAN_REPOINT, reason="this torch has no UntypedStorage._swap_data_ptr_")
def test_pack_repoints_aliases_and_keeps_values():
    """Stage `pack` alone, on real tensors: the values and every alias taken before it."""
    from k3compile.stages.pack import _move

    gen = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(r, 8, generator=gen), requires_grad=False)
               for r in (3, 5, 2)]
    values = [w.detach().clone() for w in weights]
    data, detached, row = weights[1].data, weights[1].detach(), weights[2].data[1]
    buffer = _move(weights, 8)
    assert all(torch.equal(w, v) for w, v in zip(weights, values, strict=True))
    assert weights[1].data_ptr() == buffer.data_ptr() + 3 * 8 * 4
    data.fill_(1.0)  # `.data` and `detach()` taken before: the packed rows
    assert torch.equal(buffer[3:8], torch.ones(5, 8)) and torch.equal(detached, weights[1])
    row.fill_(2.0)  # a view of a row, at its offset
    assert torch.equal(buffer[9], torch.full((8,), 2.0)) and torch.equal(weights[2][1], buffer[9])
    held = buffer.untyped_storage()._weak_ref()
    del weights, data, detached, buffer
    assert not torch.UntypedStorage._expired(held)  # an alias keeps the buffer alive
    assert torch.equal(row, torch.full((8,), 2.0))
    del row
    assert torch.UntypedStorage._expired(held)  # and nothing else does


@pytest.mark.skipif(not CAN_REPOINT, reason="this torch has no UntypedStorage._swap_data_ptr_")
def test_pack_leaves_tied_and_embedded_weights_where_they_are():
    """Look-alikes `_move` must not touch: two weights on one storage, a weight in a larger one,
    a weight tied to one packed before."""
    from k3compile.stages.pack import _move, _unmovable

    base = torch.randn(16, 8)
    assert "tied" in _unmovable([base, base.view(16, 8)])
    assert "larger storage" in _unmovable([base[:8], torch.randn(4, 8)])
    assert _unmovable([torch.randn(3, 8), torch.randn(4, 8)]) is None
    weight = torch.nn.Parameter(torch.randn(4, 8), requires_grad=False)
    twin = torch.nn.Parameter(weight.data, requires_grad=False)  # tied, another parameter
    _move([weight, torch.randn(2, 8)], 8)
    assert "packed before" in _unmovable([twin, torch.randn(2, 8)])
    assert torch.equal(twin, weight) and twin.data_ptr() == weight.data_ptr()


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_updates_of_a_stacked_qkv_parameter_are_seen(pack):
    """One KDA layer of the second spelling: q|k|v are `select`s of one [3, W, D] parameter that
    `k3.linear_concat` reads (packed: the parameter is rows of the group's buffer)."""
    torch._dynamo.reset()
    cfg = dataclasses.replace(get_config("tiny"), num_hidden_layers=1, full_attn_layers=())
    ref = build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=64)
    model, eager = from_reference(ref), from_reference(ref)
    before = {"model": aliases_before(model), "eager": aliases_before(eager)}
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "pack_weights": pack, "buckets": (4,)})
    assert rel_err(logits(step(*step_args(0))), logits(eager(*step_args(0)))) <= TOL["aten_cpu"]
    (graph,) = k3be.last_compiled().observer.graphs.values()
    ops = [n for n in graph.nodes if n.target is torch.ops.k3.linear_concat.default]
    assert len(ops) == 1 and sum(w.op != "placeholder" for w in ops[0].args[1]) == 3
    attn = model.model.layers[0].self_attn
    group = [getattr(attn, n).weight for n in ("qkv_proj", "g_proj", "f_a_proj", "b_proj")]
    one_buffer = {w.untyped_storage().nbytes() for w in group} == {sum(w.nbytes for w in group)}
    assert one_buffer == pack
    gen, i = torch.Generator().manual_seed(1), 1
    for how, update in UPDATES.items():
        if how in ALIASED_BEFORE and not CAN_REPOINT:
            continue
        for name in ("model.layers.0.self_attn.qkv_proj.weight",
                     "model.layers.0.self_attn.g_proj.weight"):
            new = perturbed(eager, name, gen)
            update(model, before["model"], name, new)
            update(eager, before["eager"], name, new)
            want, got = logits(eager(*step_args(i))), logits(step(*step_args(i)))
            assert torch.equal(model.get_parameter(name), new), (how, name)
            assert rel_err(got, want) <= TOL["aten_cpu"], (how, name, rel_err(got, want))
            i += 1


@pytest.mark.slow
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_dtype_change_and_second_compile_are_seen(pack):
    """A bf16 model: a second `torch.compile` of it (other options), then `model.float()`
    (`.to(torch.float32)`: Dynamo recompiles on the dtype guard) and an update after it: each
    step equal to eager. Back to bf16 the model's own eager step raises (its fp32 states become
    bf16): so does the compiled one, it never runs on the old weights."""
    torch._dynamo.reset()
    compiles = len(k3be._compiled)
    options = {"executor": "aten", "pack_weights": pack, "buckets": (4,)}
    model, eager = build_pair(torch.bfloat16)
    step = torch.compile(model, backend="k3", fullgraph=True, options=options)
    # other options: a compile of its own (with the same ones Dynamo reuses the first one's)
    again = torch.compile(model, backend="k3", fullgraph=True, options={**options, "strict": False})
    tol = TOL["bfloat16"]  # bf16 steps before the change round the states differently
    gen = torch.Generator().manual_seed(2)
    for i, (fn, change) in enumerate([(step, None), (again, None), (again, "update"),
                                      (step, "float"), (step, "update")]):
        if change == "float":
            model.float(), eager.float()
        elif change == "update":
            name = LAYER + TARGETS[i % len(TARGETS)]
            new = perturbed(eager, name, gen)
            _copy(model, None, name, new), _copy(eager, None, name, new)
        got, want = logits(fn(*step_args(i))), logits(eager(*step_args(i)))
        if pack and i == 1:  # the second compile finds the groups packed and moves nothing
            assert pack_report().already and not pack_report().packed, pack_report()
        assert got.dtype == want.dtype, (i, change)
        assert rel_err(got, want) <= tol, (i, change, rel_err(got, want))
    assert len(k3be._compiled) == compiles + 3  # bf16, the second compile, fp32
    model.bfloat16(), eager.bfloat16()
    with pytest.raises(RuntimeError, match="dtype"):
        eager(*step_args(9))
    with pytest.raises(RuntimeError, match="dtype"):
        step(*step_args(9))


def test_pack_never_repoints_what_an_earlier_compile_was_handed():
    """A storage an earlier compile reads through another tensor (a CUDA graph captured its
    address) stays where it is: the weight counts as seen."""
    from k3compile.stages.pack import _seen, remember

    weight, other = torch.randn(4, 8), torch.randn(4, 8)
    remember([weight.data[1:]])  # handed an alias of the weight's storage, not the weight
    assert _seen(weight) and not _seen(other)


def test_a_rebound_parameter_counts_as_moved_under_a_captured_graph():
    """backend `_moved`: the check before each CUDA-graph replay (here its CPU fallback)."""
    from k3compile.backend import _Bucket, _moved

    weight, ids = torch.zeros(4), torch.zeros(2)
    entry = _Bucket(None, 2)
    entry.fixed, entry.pointers = [0], [weight.data_ptr(), None, None]
    assert not _moved(entry, [weight, ids, 3])
    weight.data.copy_(torch.ones(4))  # in place: the captured address still holds it
    assert not _moved(entry, [weight, ids, 3])
    weight.data = torch.ones(4)
    assert _moved(entry, [weight, ids, 3])
