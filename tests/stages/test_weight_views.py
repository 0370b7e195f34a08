"""Stage `weight_views` (k3compile/stages/weight_views.py): a weight cut out of a flat storage
(`flat.narrow(0, a, n).view(N, K)`, FSDP's FlatParameter) is read as a graph input of its own,
handed by the wrapper as a view of the flat storage. On hand-written ATen graphs (make_fx), then
end to end on an FSDP-style MLP under backend k3 against the same MLP with a Parameter per
weight (the second spelling; spell13, tests/e2e/test_spell13_spelling.py, is the third)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile.backend as k3be
from k3compile.settings import Options
from k3compile.stages import Context
from k3compile.stages.weight_views import view_inputs
from tests.conftest import rel_err

aten = torch.ops.aten
D, F_ = 64, 96


def _views(fn, inputs, user=(), **options):
    """(graph module after the stage, the mapping) for fn traced on `inputs`."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    ctx = Context(Options.make(options or None), None, inputs=list(inputs),
                  user_inputs=frozenset(user))
    return gm, view_inputs(gm, ctx)


def _call(gm, viewed, inputs):
    """The rewritten graph called as the executor calls it (its wrapper, the real inputs)."""
    return viewed.wrap(lambda args: gm(*args))(list(inputs))


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _two_linears(x, flat):
    w1 = flat.narrow(0, 0, 8 * 16).view(16, 8)
    w2 = flat.narrow(0, 8 * 16, 16 * 4).view(4, 16)
    return F.linear(torch.relu(F.linear(x, w1)), w2)


def _flat(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(n, generator=gen), requires_grad=False)


def test_each_view_of_a_flat_storage_is_an_input_of_its_own():
    x, flat = torch.randn(3, 8), _flat(8 * 16 + 16 * 4 + 5)
    want = _two_linears(x, flat)
    gm, viewed = _views(_two_linears, [x, flat], user=[0])
    added = _placeholders(gm)[2:]
    assert [list(p.meta["val"].shape) for p in added] == [[16, 8], [4, 16]]
    assert [c.offset for c in viewed.cuts] == [0, 128]
    assert not _placeholders(gm)[1].users, "the flat input is read by nobody now"
    for mm in gm.graph.find_nodes(op="call_function", target=aten.mm.default):
        w = mm.args[1]  # F.linear: mm(x, t(w)) on the new input
        assert w.target in (aten.t.default, aten.permute.default) and w.args[0] in added, \
            mm.format_node()
    got = _call(gm, viewed, [x, flat])
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_views_follow_every_write_and_move_of_the_flat_storage():
    x, flat = torch.randn(3, 8), _flat(8 * 16 + 16 * 4)
    gm, viewed = _views(_two_linears, [x, flat], user=[0])
    step = viewed.wrap(lambda args: gm(*args))
    assert torch.equal(step([x, flat]), _two_linears(x, flat))
    with torch.no_grad():
        flat.mul_(-0.5)  # in place: the kept views share the storage
    assert torch.equal(step([x, flat]), _two_linears(x, flat))
    flat.data = torch.randn(flat.numel())  # moved: the views are made again
    assert torch.equal(step([x, flat]), _two_linears(x, flat))
    other = _flat(flat.numel(), seed=3)  # another tensor in the same place
    assert torch.equal(step([x, other]), _two_linears(x, other))


def test_a_column_slice_is_cut_at_the_contiguous_weight_it_slices():
    def fn(x, flat):
        w = flat.narrow(0, 4, 16 * 8).view(16, 8)
        return F.linear(x, w[:, :4]) + F.linear(x[:, :4] * 2, w[:4, 4:]).sum()

    x, flat = torch.randn(3, 4), _flat(4 + 16 * 8)
    gm, viewed = _views(fn, [x, flat], user=[0])
    # w[:, :4] at the whole weight, w[:4, 4:] at its first four rows (one contiguous run)
    assert [(c.size, c.offset) for c in viewed.cuts] == [((16, 8), 4), ((4, 8), 4)]
    assert torch.equal(_call(gm, viewed, [x, flat]), fn(x, flat))


def test_chains_cut_at_one_shared_view_take_one_input():
    def fn(x, flat):
        w = flat.narrow(0, 2, 16 * 8).view(16, 8)
        return (F.linear(x, w[:, :4]) + F.linear(x, w[:, 4:])).sum() + (x @ w[:4, :4]).sum()

    x, flat = torch.randn(3, 4), _flat(2 + 16 * 8)
    gm, viewed = _views(fn, [x, flat], user=[0])
    assert [(c.size, c.offset) for c in viewed.cuts] == [((16, 8), 2), ((4, 8), 2)]
    assert torch.equal(_call(gm, viewed, [x, flat]), fn(x, flat))


def _cut_nothing(fn, inputs, user=(0,)):
    gm, viewed = _views(fn, inputs, user=user)
    assert viewed is None
    assert len(_placeholders(gm)) == len(inputs)
    for got, want in zip(*(torch.utils._pytree.tree_leaves(o) for o in (gm(*inputs), fn(*inputs))),
                         strict=True):
        assert torch.equal(got, want)


def test_a_caller_s_input_is_never_cut():
    x = torch.randn(3, 8)
    _cut_nothing(lambda x, flat: F.linear(x, flat[:64].view(8, 8)), [x, torch.randn(70)],
                 user=(0, 1))


def test_a_flat_storage_written_in_place_is_left_alone():
    def fn(x, flat):
        out = F.linear(x, flat[:64].view(8, 8))
        flat[64:].add_(1.0)
        return out

    x, flat = torch.randn(3, 8), torch.randn(70)
    gm, viewed = _views(fn, [x, flat.clone()], user=[0])
    assert viewed is None


def test_whole_returned_and_strided_reads_are_left_alone():
    x = torch.randn(3, 8)
    _cut_nothing(lambda x, flat: F.linear(x, flat.view(8, 8)), [x, torch.randn(64)])  # whole
    _cut_nothing(lambda x, flat: (x * 2, flat[:8]), [x, torch.randn(70)])  # an output
    _cut_nothing(lambda x, flat: x * flat[::2][:8], [x, torch.randn(70)])  # strided
    _cut_nothing(lambda x, w: F.linear(x, w[:8]), [x, torch.randn(16, 8)])  # not 1-D


def test_static_inputs_include_the_views_of_static_flat_inputs():
    x, flat = torch.randn(3, 8), _flat(8 * 16 + 16 * 4)
    gm, viewed = _views(_two_linears, [x, flat], user=[0])
    assert viewed.static([1]) == [1, 2, 3] and viewed.static([0]) == [0]
    assert viewed.static(None) is None


def test_the_switch_turns_the_stage_off(monkeypatch):
    from k3compile.pipeline import before_key

    def names(options=None):
        return [name for name, _ in before_key(Options.make(options))]

    assert names()[0] == "weight_views"
    assert "weight_views" not in names({"weight_views": False})
    monkeypatch.setenv("K3_WEIGHT_VIEWS", "0")
    assert "weight_views" not in names()


# ---- end to end: an FSDP-style MLP ------------------------------------------------------------

class FlatMLP(nn.Module):
    """K3's dense MLP (RMSNorm, gate|up, SiTU-GLU, down) with its weights in one flat Parameter,
    each read as `narrow().view()` in the forward; `flat=False`: a Parameter per weight."""

    def __init__(self, dtype=torch.float32, seed=0, flat=True, d=D, f=F_):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        scale = 1.0 + 0.1 * torch.randn(d, generator=gen)
        gate_up = torch.randn(2 * f, d, generator=gen) / d ** 0.5
        down = torch.randn(d, f, generator=gen) / f ** 0.5
        self.shapes = {"scale": (d,), "gate_up": (2 * f, d), "down": (d, f)}
        self.is_flat = flat
        if flat:
            self.flat = nn.Parameter(torch.cat([scale, gate_up.flatten(), down.flatten()])
                                     .to(dtype), requires_grad=False)
        else:
            for name, value in (("scale", scale), ("gate_up", gate_up), ("down", down)):
                setattr(self, name, nn.Parameter(value.to(dtype), requires_grad=False))

    def weight(self, name):
        if not self.is_flat:
            return getattr(self, name)
        offset = 0
        for key, shape in self.shapes.items():
            n = torch.Size(shape).numel()
            if key == name:
                return self.flat.narrow(0, offset, n).view(shape)
            offset += n
        raise KeyError(name)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight("scale").float()
        g, u = F.linear(h.to(x.dtype), self.weight("gate_up")).float().chunk(2, -1)
        a = 3.0 * torch.tanh(g / 3.0) * torch.sigmoid(g) * (5.0 * torch.tanh(u / 5.0))
        return x + F.linear(a.to(x.dtype), self.weight("down"))


def _fused(compiled) -> dict:
    (records,) = compiled.observer.records.values()
    return {str(op): n for op, n in records[-1].ops_after.items() if str(op).startswith("k3.")}


def _plan(model, x, **options) -> dict:
    torch._dynamo.reset()
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", **options})
    with torch.no_grad():
        step(x)
    return _fused(k3be.last_compiled())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_mlp_fuses_as_the_mlp_with_a_parameter_per_weight(dtype):
    x = torch.randn(2, D, dtype=dtype)
    want = _plan(FlatMLP(dtype, flat=False), x)
    assert want.get("k3.situ_gate_up") == 1 and want.get("k3.linear") == 1, want
    assert _plan(FlatMLP(dtype), x) == want
    off = _plan(FlatMLP(dtype), x, weight_views=False)
    assert "k3.linear" not in off, off  # (situ_gate_up takes views of an input: it fuses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_mlp_values_and_every_weight_update_are_seen(dtype):
    torch._dynamo.reset()
    model, eager = FlatMLP(dtype), FlatMLP(dtype)
    step = torch.compile(model, backend="k3", fullgraph=True, options={"executor": "aten"})
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    x = torch.randn(2, D, dtype=dtype)
    with torch.no_grad():
        got = step(x)
        assert got.dtype == dtype and got.shape == x.shape
        assert rel_err(got, eager(x)) <= tol
        compiles = len(k3be._compiled)
        new = FlatMLP(dtype, seed=1).state_dict()
        for m in (model, eager):
            m.flat.copy_(new["flat"])  # an in-place write to the flat storage
        assert rel_err(step(x), eager(x)) <= tol
        for m in (model, eager):
            m.load_state_dict(FlatMLP(dtype, seed=2).state_dict())
        assert rel_err(step(x), eager(x)) <= tol
        assert len(k3be._compiled) == compiles, "in-place updates recompile nothing"
        fresh = FlatMLP(dtype, seed=4).flat.detach().clone()
        model.flat.data, eager.flat.data = fresh, fresh.clone()  # new memory: views made again
        assert rel_err(step(x), eager(x)) <= tol
