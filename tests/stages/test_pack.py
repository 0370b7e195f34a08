"""Stage `pack` (k3compile.stages.pack): each fused group's weights moved into one buffer, the
parameters views of it, `concatenated` a view instead of a copy; values, state_dict and in-place
updates as before. CPU, the tiny model, executor "aten"."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import fx

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from k3compile.ops.linear_concat import adjacent, concatenated
from k3compile.stages import pack as weights

KDA_GROUP = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj")


def test_concatenated_is_a_view_of_weights_back_to_back(caplog):
    buffer = torch.randn(10, 4)
    rows = list(buffer.split([3, 7]))
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        got = concatenated(rows)
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, buffer)
    assert "copies" not in caplog.text
    apart = [torch.randn(3, 4), torch.randn(5, 4)]
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        copy = concatenated(apart)
        concatenated(apart)  # the copy per call is logged once per group
    assert copy.data_ptr() not in (w.data_ptr() for w in apart)
    assert torch.equal(copy, torch.cat(apart))
    assert caplog.text.count("copies its 2 weights") == 1, caplog.text
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


@pytest.mark.slow  # its own compile; the default run: test_pack_keeps_values_state_and_updates
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


@pytest.mark.slow
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


# ---- weights that are views of one input (q|k|v rows of a stacked parameter) -------------------

def _views_graph(pick):
    """x -> k3.linear_concat(x, pick(a, stacked, b)) split into its outputs."""

    def in_proj(x, a, stacked, b):
        ws = pick(a, stacked, b)
        return torch.ops.k3.linear_concat(x, ws).split([w.shape[0] for w in ws], -1)

    return in_proj


def _stacked_inputs():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in ((2, 8), (4, 8), (3, 5, 8), (6, 8))]


def _pack_traced(pick, inputs):
    from tests.fusions.pattern_checks import graph

    fn = _views_graph(pick)
    gm = graph(fn, *inputs)
    want = fn(*[t.clone() for t in inputs])
    report = weights.pack_concatenated(gm.graph, inputs)
    gm.recompile()
    return gm, fn, want, report


def _op_weights(gm):
    (op,) = (n for n in gm.graph.nodes if n.target is torch.ops.k3.linear_concat.default)
    return op.args[1]


def test_rows_of_one_input_are_ordered_by_storage_and_packed():
    """The matcher binds q|k|v in no particular order: pack puts the views of one input in the
    order it stores them, the split's readers follow, and the input becomes rows of the buffer."""
    inputs = _stacked_inputs()
    _, a, stacked, b = inputs
    values = [t.clone() for t in inputs]
    pick = lambda a, s, b: [a, s[1], s[0], s[2], b]
    gm, fn, want, report = _pack_traced(pick, inputs)
    assert len(report.packed) == 1 and not report.skipped, report
    assert report.saved_bytes == (4 + 15 + 6) * 8 * 4
    order = [(w.target, w.args[1:]) for w in _op_weights(gm)]
    assert order[1:4] == [(torch.ops.aten.select.int, (0, i)) for i in range(3)]
    assert weights.adjacent([a, *stacked.unbind(0), b])
    assert all(torch.equal(t, v) for t, v in zip(inputs, values)), "packing changed a value"
    for got, w in zip(gm(*inputs), want, strict=True):  # every output where its readers look
        assert torch.equal(got, w)
    with torch.no_grad():
        stacked[1].mul_(-2)  # an update of the stacked parameter is seen
    for got, w in zip(gm(*inputs), fn(*inputs), strict=True):
        assert torch.equal(got, w)


def test_rows_of_one_input_back_to_back_are_already_packed():
    inputs = _stacked_inputs()
    ptr = inputs[2].data_ptr()
    gm, _, want, report = _pack_traced(lambda a, s, b: [s[0], s[1], s[2]], inputs)
    assert report.already and not report.packed and not report.skipped, report
    assert inputs[2].data_ptr() == ptr
    assert all(torch.equal(g, w) for g, w in zip(gm(*inputs), want, strict=True))


def test_a_group_read_out_of_the_buffers_order_is_reported(monkeypatch, caplog):
    """The stage checks its own work: a group moved in another order than the op reads it (the
    bug of session 15: a copy per call on the GPU) is logged as such."""
    move = weights._move
    monkeypatch.setattr(weights, "_move", lambda roots, width: move(roots[::-1], width))
    inputs = _stacked_inputs()
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        _pack_traced(lambda a, s, b: [a, b], inputs)
    assert "reads its weights out of the buffer's order" in caplog.text
    caplog.clear()
    monkeypatch.setattr(weights, "_move", move)
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        _pack_traced(lambda a, s, b: [a, b], _stacked_inputs())
    assert "out of the buffer's order" not in caplog.text


def test_rows_of_one_input_in_pieces_are_packed():
    inputs = _stacked_inputs()
    gm, _, want, report = _pack_traced(lambda a, s, b: [s[0, 4:], s[1], a, s[2], s[0, :4]], inputs)
    assert len(report.packed) == 1 and not report.skipped, report
    # in the order the op reads them: the run of 15 fp32 rows (60-byte outputs) last
    assert weights.adjacent([inputs[1], inputs[2].flatten(0, 1)])
    assert all(torch.equal(g, w) for g, w in zip(gm(*inputs), want, strict=True))


def test_a_shards_rows_of_an_input_stay():
    """A row slice of a sharded front reads part of a parameter: packing it would move rows no
    group reads."""
    inputs = _stacked_inputs()
    ptrs = [t.data_ptr() for t in inputs]
    gm, _, want, report = _pack_traced(lambda a, s, b: [a, s[0], s[2]], inputs)
    assert not report.packed and len(report.skipped) == 1, report
    assert "does not read an input (3, 5, 8) whole" in report.skipped[0], report
    assert [t.data_ptr() for t in inputs] == ptrs
    assert all(torch.equal(g, w) for g, w in zip(gm(*inputs), want, strict=True))


def test_roles_out_of_storage_order_stay():
    """situ_gate_up's gate and up have roles: up stored before gate cannot be one view."""
    from tests.fusions.pattern_checks import graph

    def up_first(x, s):
        return torch.ops.k3.situ_gate_up(x, s[1], s[0], 4.0, 25.0)

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)]
    gm = graph(up_first, *inputs)
    report = weights.pack_concatenated(gm.graph, inputs)
    assert not report.packed and "whole in its order" in report.skipped[0], report
    report = weights.pack_concatenated(graph(lambda x, s: torch.ops.k3.situ_gate_up(
        x, s[0], s[1], 4.0, 25.0), *inputs).graph, inputs)
    assert report.already and not report.skipped, report  # a gate|up parameter sliced in two


def test_views_out_of_order_read_otherwise_stay():
    """The op's output read whole (not split into the weights' outputs): no order but its own."""
    from tests.fusions.pattern_checks import graph

    def whole(x, a, s, b):
        return torch.ops.k3.linear_concat(x, [a, s[1], s[0], s[2], b])

    inputs = _stacked_inputs()
    gm = graph(whole, *inputs)
    want = whole(*inputs)
    report = weights.pack_concatenated(gm.graph, inputs)
    gm.recompile()
    assert not report.packed and "read otherwise" in report.skipped[0], report
    assert torch.equal(gm(*inputs), want)


def test_views_of_one_input_split_by_another_stay():
    """An expert stack of rows of one input with another input between them: the input cannot
    be packed whole in the stack's order (the check is one set lookup per weight: a stack has E
    of them)."""
    from tests.fusions.pattern_checks import graph

    def split(a, s):
        return torch.ops.k3.expert_stack([s[0], a, s[1]])

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)]
    ptrs = [t.data_ptr() for t in inputs]
    gm = graph(split, *inputs)
    want = split(*inputs)
    report = weights.pack_concatenated(gm.graph, inputs)
    gm.recompile()
    assert not report.packed and "split by other weights" in report.skipped[0], report
    assert [t.data_ptr() for t in inputs] == ptrs
    assert torch.equal(gm(*inputs), want)


def test_a_piece_of_unaligned_width_goes_last():
    """Moonshot's KDA b_proj (6 rows in bf16 at TP16) bound before f_a put f_a's output piece
    12 bytes past a 16-byte boundary: the f_b gemv refused it on the H200. Pack puts the storages
    whose output width is not a multiple of 16 bytes after the others; the readers follow."""
    from tests.fusions.pattern_checks import graph

    def in_proj(x, a, b, c, d):
        ws = [a, b, c, d]
        return torch.ops.k3.linear_concat(x, ws).split([w.shape[0] for w in ws], -1)

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, generator=gen, dtype=torch.bfloat16)
              for s in ((1, 16), (8, 16), (6, 16), (16, 16), (8, 16))]
    gm = graph(in_proj, *inputs)
    want = in_proj(*[t.clone() for t in inputs])
    report = weights.pack_concatenated(gm.graph, inputs)
    gm.recompile()
    assert len(report.packed) == 1 and not report.skipped, report
    rows = [w.meta["val"].shape[0] for w in _op_weights(gm)]
    assert rows == [8, 16, 8, 6]
    assert all(sum(rows[:i]) * 2 % 16 == 0 for i in range(len(rows)))
    # the op reads its weights back to back (the CUDA path's view, not a copy per call)
    real = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs))
    assert adjacent([real[w] for w in _op_weights(gm)])
    for got, w in zip(gm(*inputs), want, strict=True):
        assert torch.equal(got, w)
