"""Stage `pack` (k3compile.stages.pack): each fused group's weights moved into one buffer, the
parameters views of it, `concatenated` a view instead of a copy; values, state_dict and in-place
updates as before. CPU, the tiny model, executor "aten"."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from k3compile.ops.linear_concat import concatenated
from k3compile.stages import pack as weights

KDA_GROUP = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")


def test_concatenated_is_a_view_of_weights_back_to_back():
    buffer = torch.randn(10, 4)
    rows = list(buffer.split([3, 7]))
    got = concatenated(rows)
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, buffer)
    apart = [torch.randn(3, 4), torch.randn(7, 4)]
    copy = concatenated(apart)
    assert copy.data_ptr() not in (w.data_ptr() for w in apart)
    assert torch.equal(copy, torch.cat(apart))
    assert not weights.adjacent([rows[1], rows[0]]), "out of order"
    assert not weights.adjacent([buffer[:, :2], buffer[:, 2:]]), "columns are not rows"


def _kda(model, layer=1):
    attn = model.language_model.model.layers[layer].self_attn
    return [getattr(attn, name).weight for name in KDA_GROUP]


@pytest.fixture
def tiny():
    torch._dynamo.reset()
    cfg = get_config("tiny")
    return tuple(build_model(cfg, dtype=torch.bfloat16, max_batch=4, max_seq_len=64)
                 for _ in range(2))


def test_pack_keeps_values_state_and_updates(tiny):
    model, eager = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not weights.adjacent(_kda(model))
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    for i in range(2):
        assert torch.equal(step(*_args(i)), eager(*_args(i)))
    report = k3be.last_compiled().observer.notes[2]["pack"]
    assert report.packed and not report.skipped, report
    layers = model.language_model.model.layers
    kda = [i for i, layer in enumerate(layers) if hasattr(layer.self_attn, "q_proj")]
    for i in kda:
        assert weights.adjacent(_kda(model, i)), f"layer {i}: KDA in-projection not packed"
    assert report.saved_bytes == sum(sum(w.nbytes for w in _kda(model, i)) for i in kda) + sum(
        _mla_bytes(layers[i]) for i in range(len(layers)) if i not in kda) + sum(
        _gate_up_bytes(layer) for layer in layers)
    for layer in layers:  # situ_gate_up's [W_g; W_u]: shared experts, the dense MLP
        mlp = getattr(layer.mlp, "shared_experts", layer.mlp)
        assert weights.adjacent([mlp.gate_proj.weight, mlp.up_proj.weight])
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "packing changed a value"
    # in-place updates (a reload) write through to the packed buffer
    fresh = build_model(model.config, dtype=torch.bfloat16, seed=5, max_batch=4, max_seq_len=64)
    new = {k: v for k, v in fresh.state_dict().items() if k.endswith("weight")}
    model.load_state_dict(new, strict=False)
    eager.load_state_dict(new, strict=False)
    assert weights.adjacent(_kda(model))
    assert torch.equal(step(*_args(3)), eager(*_args(3)))


def _args(i):
    gen = torch.Generator().manual_seed(i)
    return (torch.randint(0, get_config("tiny").vocab_size, (2,), generator=gen),
            torch.tensor([i, 7 + i]), torch.tensor([1, 0]))


def _gate_up_bytes(layer) -> int:
    mlp = getattr(layer.mlp, "shared_experts", layer.mlp)
    return mlp.gate_proj.weight.nbytes + mlp.up_proj.weight.nbytes


def _mla_bytes(layer) -> int:
    """The MLA layer's linear_concat group: whatever weights feed it (q_a | kv_a | g)."""
    attn = layer.self_attn
    names = [n for n in ("q_a_proj", "kv_a_proj_with_mqa", "g_proj") if hasattr(attn, n)]
    return sum(getattr(attn, n).weight.nbytes for n in names)


def test_a_later_compile_finds_the_groups_packed(tiny):
    model, _ = tiny
    step = torch.compile(model, backend="k3", options={"executor": "aten", "buckets": [2, 4]})
    step(*_args(0))
    ptrs = [w.data_ptr() for w in _kda(model)]
    gen = torch.Generator().manual_seed(9)
    step(torch.randint(0, model.config.vocab_size, (4,), generator=gen), torch.arange(4),
         torch.arange(4))  # a second bucket, a second compile
    report = k3be.last_compiled().observer.notes[4]["pack"]
    assert report.already and not report.packed, report
    assert [w.data_ptr() for w in _kda(model)] == ptrs


def test_off_by_option_and_never_after_an_unpacked_compile(tiny, monkeypatch):
    model, eager = tiny
    monkeypatch.setenv("K3_PACK_WEIGHTS", "0")
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    assert torch.equal(step(*_args(0)), eager(*_args(0)))
    assert "pack" not in k3be.last_compiled().observer.notes[2]
    assert not weights.adjacent(_kda(model))
    # a second compile with packing on must not move weights the first one's graphs read
    monkeypatch.setenv("K3_PACK_WEIGHTS", "1")
    torch._dynamo.reset()
    again = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    assert torch.equal(again(*_args(1)), eager(*_args(1)))
    report = k3be.last_compiled().observer.notes[2]["pack"]
    assert not report.packed and report.skipped
    assert all("earlier compile" in why for why in report.skipped), report.skipped
    assert not weights.adjacent(_kda(model))


def _front_graph():
    """x -> k3.moe_front(x, router, down) and k3.linear_concat(x, [a, b]) on placeholders."""
    import k3compile.ops  # noqa: F401

    graph = fx.Graph()
    x, r, d, a, b = (graph.placeholder(n) for n in "xrdab")
    graph.output((graph.call_function(torch.ops.k3.moe_front.default, (x, r, d)),
                  graph.call_function(torch.ops.k3.linear_concat.default, (x, [a, b]))))
    return graph


def test_groups_left_alone_say_why():
    x = torch.randn(1, 8)
    router, down = torch.randn(4, 8), torch.randn(6, 8).bfloat16()  # fp32 router, bf16 down
    a = torch.randn(3, 8)
    report = weights.pack_concatenated(_front_graph(), [x, router, down, a, a])
    assert not report.packed
    reasons = " | ".join(report.skipped)
    assert "differ in dtype" in reasons and "appears twice" in reasons, reasons
    class Sub(torch.Tensor):
        pass

    sub = weights.pack_concatenated(_front_graph(), [x, *(torch.randn(2, 8).as_subclass(Sub)
                                                         for _ in range(4))])
    assert not sub.packed and all("subclass" in why for why in sub.skipped), sub.skipped
    odd = weights.pack_concatenated(_front_graph(), [x, *(torch.randn(2, 7).bfloat16()
                                                         for _ in range(4))])
    assert not odd.packed and all("multiple of 16" in why for why in odd.skipped), odd.skipped
    short = weights.pack_concatenated(_front_graph(), [x, router])
    assert short.skipped == ["graph: 5 placeholders for 2 inputs"]
    ok = [torch.randn(4, 8), torch.randn(6, 8), torch.randn(3, 8), torch.randn(2, 8)]
    values = [w.clone() for w in ok]
    report = weights.pack_concatenated(_front_graph(), [x, *ok])
    assert len(report.packed) == 2 and report.saved_bytes == (3 + 2) * 8 * 4, report
    assert weights.adjacent(ok[:2]) and weights.adjacent(ok[2:])
    assert all(torch.equal(w, v) for w, v in zip(ok, values))
