"""Stage `weight_cast` (k3compile/stages/weight_cast.py): an fp32 weight the graph reads only
through a cast to bf16 / fp16 (torch.autocast) is read as a copy in that dtype, made once and made
again by the wrapper where the weight changed. On hand-written ATen graphs (make_fx: the same
values bitwise, the copies refreshed after in-place writes and rebinding, what is left alone),
then end to end on an autocast MLP under backend k3 (the GEMM fusions back, values, updates)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile.backend as k3be
from k3compile.settings import Options
from k3compile.stages import Context
from k3compile.stages.weight_cast import cast_dtype, cast_inputs
from tests.conftest import TOL, rel_err

prims = torch.ops.prims
bf16 = torch.bfloat16


def _stage(fn, inputs, user=(0,), **options):
    """(graph module after the stage, the mapping, ctx, the graph before it) for fn traced on
    `inputs`."""
    before = make_fx(fn, tracing_mode="fake")(*inputs)
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    ctx = Context(Options.make(options or None), None, inputs=list(inputs),
                  user_inputs=frozenset(user))
    return gm, cast_inputs(gm, ctx), ctx, before


def _call(gm, cast, inputs):
    """The rewritten graph called as the executor calls it (its wrapper, the real inputs)."""
    return cast.wrap(lambda args: gm(*args))(list(inputs))


def _weights(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=gen), requires_grad=False) for s in shapes]


def _mlp(x, w_in, w_out, scale):
    """Autocast's spelling, by hand: each GEMM's operands cast (F.linear: the weight whole,
    `x @ W.mT`: a view of it), a norm weight cast where it meets the bf16 activation."""
    h = x.to(bf16) * scale.to(bf16)
    h = torch.relu(h @ prims.convert_element_type(w_in, bf16).t())
    return h @ w_out.mT.to(bf16)


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def test_weights_read_through_a_cast_become_their_copies_bitwise():
    x = torch.randn(3, 8)
    w_in, w_out, scale = _weights((16, 8), (8, 16), (8,))
    gm, cast, ctx, before = _stage(_mlp, [x, w_in, w_out, scale])
    assert cast.positions == [1, 2, 3], cast.report
    assert [p.meta["val"].dtype for p in _placeholders(gm)] == [torch.float32, bf16, bf16, bf16]
    casts = [n for n in gm.graph.nodes if n.target in (prims.convert_element_type.default,
                                                       torch.ops.aten._to_copy.default)]
    assert [c.args[0].name for c in casts] == ["x_1"], "only the activation's cast is left"
    for w, copy in zip((w_in, w_out, scale), cast.copies, strict=True):
        assert copy.dtype == bf16 and torch.equal(copy, w.to(bf16))
        assert any(t is copy for t in ctx.inputs), "the stages after it see the copy"
    want = before(x, w_in, w_out, scale)
    got = _call(gm, cast, [x, w_in, w_out, scale])
    assert got.dtype == want.dtype and torch.equal(got, want), "the same ops: bitwise"
    assert w_in.dtype == torch.float32, "the masters stay as they are"


def _versions(cast):
    return [c._version for c in cast.copies]


def test_a_weight_changed_after_the_first_call_is_copied_again_alone():
    """Never stale: `copy_`, `load_state_dict` and `param.data = t` reach the next call; the other
    weights' copies are not made again (their version counters do not move); the copy stays at
    its address (a CUDA graph reads it)."""
    x = torch.randn(3, 8)
    module = nn.Module()
    module.w_in, module.w_out, module.scale = _weights((16, 8), (8, 16), (8,))
    inputs = [x, module.w_in, module.w_out, module.scale]
    gm, cast, _, before = _stage(_mlp, inputs)
    step = cast.wrap(lambda args: gm(*args))
    assert torch.equal(step(list(inputs)), before(*inputs))
    pointers, versions = [c.data_ptr() for c in cast.copies], _versions(cast)
    assert torch.equal(step(list(inputs)), before(*inputs))
    assert _versions(cast) == versions, "an unchanged master is not copied again"

    new = _weights((16, 8), (8, 16), (8,), seed=1)
    with torch.no_grad():
        module.w_in.copy_(new[0])
    assert torch.equal(step(list(inputs)), before(*inputs))
    assert _versions(cast)[1:] == versions[1:] and _versions(cast)[0] == versions[0] + 1

    module.load_state_dict({"w_in": new[0], "w_out": new[1], "scale": new[2]})
    assert torch.equal(step(list(inputs)), before(*inputs))
    assert torch.equal(cast.copies[1], new[1].to(bf16))

    versions = _versions(cast)
    module.w_out.data = 3 * new[1]  # new memory, the Parameter's version counter kept
    assert torch.equal(step(list(inputs)), before(*inputs))
    assert torch.equal(cast.copies[1], (3 * new[1]).to(bf16))
    assert [v - w for v, w in zip(_versions(cast), versions)] == [0, 1, 0]
    assert [c.data_ptr() for c in cast.copies] == pointers, "copied into the same buffers"


def test_fp16_casts_are_taken_too():
    x = torch.randn(3, 8)
    (w,) = _weights((16, 8))

    def fn(x, w):
        return x.half() @ w.half().t()

    gm, cast, _, before = _stage(fn, [x, w])
    assert cast.positions == [1] and cast.copies[0].dtype == torch.float16
    assert torch.equal(_call(gm, cast, [x, w]), before(x, w))


def test_a_graph_of_one_weight_alone():
    (w,) = _weights((16, 8))

    def fn(w):
        return w.to(bf16).sum(0)

    gm, cast, _, before = _stage(fn, [w], user=())
    assert cast.positions == [0] and torch.equal(_call(gm, cast, [w]), before(w))


def test_views_of_one_stacked_weight_cast_after_the_split():
    """A q|k|v weight cut into rows, each piece cast (autocast casts what the GEMM reads): the
    copy is the whole weight's, cut as before."""
    x = torch.randn(3, 8)
    (w,) = _weights((24, 8))

    def fn(x, w):
        q, k, v = w.split(8)
        h = x.to(bf16)
        return (h @ q.to(bf16).t()) * (h @ k.to(bf16).t()) + h @ v.to(bf16).t()

    gm, cast, _, before = _stage(fn, [x, w])
    assert cast.positions == [1]
    assert torch.equal(_call(gm, cast, [x, w]), before(x, w))


@pytest.mark.parametrize("heads", [False, True], ids=["mm", "bmm"])
def test_column_slices_cast_for_gemms_become_slices_of_the_copy(heads):
    """A cast of a non-dense view (MLA's W_UK / W_UV, column slices of kv_b: laid out anew by
    the cast) read only by GEMMs, directly or through a transpose: the GEMMs read the slices of
    the copy, bitwise the cast's values (the GEMMs ignore their operands' strides)."""
    if heads:  # spell11's MLA: kv_b viewed heads-first, sliced, each slice cast for a bmm
        x, (w,) = torch.randn(4, 3, 8), _weights((4 * 12, 8))

        def fn(x, w):
            kv = w.view(4, 12, 8)
            q = torch.bmm(x.to(bf16), kv[:, :8].to(bf16))  # [4, 3, 8]
            return torch.bmm(q, kv[:, 8:].mT.to(bf16))  # [4, 3, 4]
    else:
        x, (w,) = torch.randn(3, 8), _weights((8, 8))

        def fn(x, w):
            return x[:, :4].to(bf16) @ w[:, :4].to(bf16).t()

    gm, cast, _, before = _stage(fn, [x, w])
    assert cast is not None and cast.positions == [1]
    casts, source = [n for n in gm.graph.nodes if cast_dtype(n) is not None], None
    for source in casts:  # x's cast alone is left
        while source.op != "placeholder":
            source = source.args[0]
    assert len(casts) == 1 and source is _placeholders(gm)[0], casts
    call = cast.wrap(lambda args: gm(*args))
    assert torch.equal(call([x, w]), before(x, w))
    with torch.no_grad():  # an update of the master reaches the slices: the copy is the whole
        w.mul_(1.5).add_(0.01)
    assert torch.equal(call([x, w]), before(x, w))


def _left(fn, inputs, user=(0,)):
    gm, cast, ctx, _ = _stage(fn, inputs, user)
    assert cast is None and all(p.meta["val"].dtype == v.dtype
                                for p, v in zip(_placeholders(gm), inputs, strict=True))
    return ctx.notes.get("weight_cast")


def test_a_weight_read_in_fp32_too_is_left_alone_with_the_reason():
    """Left alone (not handled): the fp32 read needs the master, and a copy beside it would
    read both per step; the report names the reader."""
    x = torch.randn(3, 8)
    (w,) = _weights((8, 8))

    def fn(x, w):
        return (x.to(bf16) @ w.to(bf16).t()).float() + x @ w

    report = _left(fn, [x, w])
    assert len(report.skipped) == 1 and "read in torch.float32 too" in report.skipped[0], report


@pytest.mark.parametrize("case", ["two_dtypes", "user_input", "column_slice", "output", "bf16"])
def test_what_is_left_alone(case):
    x = torch.randn(3, 8)
    (w,) = _weights((8, 8))
    if case == "two_dtypes":
        report = _left(lambda x, w: (x.to(bf16) @ w.to(bf16)).float() + (x.half() @ w.half()),
                       [x, w])
        assert "cast to torch.bfloat16 and torch.float16" in report.skipped[0], report
    elif case == "user_input":  # an activation the caller passes: never ours to copy
        assert _left(lambda x, w: x.to(bf16) @ w.to(bf16), [x, w], user=(0, 1)) is None
    elif case == "column_slice":  # a cast of a non-dense view read by a view: its layout counts
        report = _left(lambda x, w: x.to(bf16) @ w[:, :4].to(bf16).view(4, 8).t(), [x, w])
        assert "non-dense" in report.skipped[0] and "more than GEMMs" in report.skipped[0], report
    elif case == "output":  # the copy would alias an output the caller keeps
        report = _left(lambda x, w: (x.to(bf16) @ w.to(bf16), w.to(bf16)), [x, w])
        assert "is an output" in report.skipped[0], report
    else:  # already bf16: its cast to bf16 is no narrowing
        assert _left(lambda x, w: x.to(bf16) @ w.to(bf16), [x, w.to(bf16)]) is None


def test_one_copy_per_weight_for_every_compile():
    """Two graphs (two buckets) reading one weight read one copy; the second compile made it
    again from the master's values at that time."""
    (w,) = _weights((16, 8))

    def fn(x, w):
        return x.to(bf16) @ w.to(bf16).t()

    _, first, _, _ = _stage(fn, [torch.randn(1, 8), w])
    with torch.no_grad():
        w.mul_(2)
    _, second, _, _ = _stage(fn, [torch.randn(4, 8), w])
    assert second.copies[0] is first.copies[0] and torch.equal(first.copies[0], w.to(bf16))


def test_the_switch_turns_the_stage_on(monkeypatch):
    """Off by default (a write through `param.data` would not be seen); K3_WEIGHT_CAST=1 or the
    option turns it on, `disabled_stages` off again."""
    from k3compile.pipeline import before_key

    def names(options=None):
        return [name for name, _ in before_key(Options.make(options))]

    assert names() == ["weight_views", "kernel_layout"]
    assert names({"weight_cast": True}) == ["weight_views", "kernel_layout", "weight_cast"]
    monkeypatch.setenv("K3_WEIGHT_CAST", "1")
    assert names() == ["weight_views", "kernel_layout", "weight_cast"]
    assert names({"disabled_stages": ["weight_cast"]}) == ["weight_views", "kernel_layout"]


def test_a_write_through_data_is_not_seen():
    """The limit that keeps the stage off by default: `param.data.copy_(t)` writes the master
    through a tensor with its own version counter, so the copy keeps the old values (what eager
    reads differs); `param.copy_(t)` after it is seen."""
    x = torch.randn(3, 8)
    (w,) = _weights((16, 8))

    def fn(x, w):
        return x.to(bf16) @ w.to(bf16).t()

    gm, cast, _, before = _stage(fn, [x, w])
    step = cast.wrap(lambda args: gm(*args))
    old = before(x, w)
    w.data.copy_(2 * w)
    assert torch.equal(step([x, w]), old) and not torch.equal(old, before(x, w))
    with torch.no_grad():
        w.copy_(w)
    assert torch.equal(step([x, w]), before(x, w))


# ---- end to end -------------------------------------------------------------------------------

class AutocastMLP(nn.Module):
    """A K3 dense MLP in a mixed-precision codebase's style: fp32 master weights, the RMSNorm in
    fp32 (an autocast-off island) cast to the compute dtype, SiTU-GLU from its formula, the GEMMs
    under the caller's autocast."""

    def __init__(self, d=64, f=128, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(d, generator=gen))
        self.gate, self.up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)
        for lin in (self.gate, self.up, self.down):
            lin.weight.data = torch.randn(lin.weight.shape, generator=gen) / lin.in_features**0.5
        self.requires_grad_(False)

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        h = h.to(x.dtype)
        g, u = self.gate(h).float(), self.up(h).float()
        a = 3.0 * torch.tanh(g / 3.0) * torch.sigmoid(g) * (5.0 * torch.tanh(u / 5.0))
        return x + self.down(a.to(x.dtype))


def _fused(compiled) -> dict:
    (records,) = compiled.observer.records.values()
    return {str(op): n for op, n in records[-1].ops_after.items() if str(op).startswith("k3.")}


def _steps(options):
    torch._dynamo.reset()
    model, eager = AutocastMLP(), AutocastMLP()
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "weight_cast": True, **options})
    return model, eager, step


def _autocast():
    return torch.autocast(device_type="cpu", dtype=bf16)


def test_autocast_mlp_fuses_its_gemms_and_sees_weight_updates():
    model, eager, step = _steps({})
    x = torch.randn(2, 64, dtype=bf16)
    tol = TOL["bfloat16"]
    with torch.no_grad(), _autocast():
        got = step(x)
        assert got.dtype == bf16 and rel_err(got, eager(x)) <= tol
        fused = _fused(k3be.last_compiled())
        assert fused.get("k3.situ_gate_up") == 1 and fused.get("k3.linear") == 1, fused
        notes = next(iter(k3be.last_compiled().observer.notes.values()))
        assert len(notes["weight_cast"].taken) == 3, notes["weight_cast"]  # gate, up, down
        assert len(notes["pack"].packed) == 1, notes["pack"]  # the copies of gate|up
        compiles = len(k3be._compiled)
        new = AutocastMLP(seed=1).state_dict()
        model.gate.weight.copy_(new["gate.weight"])
        eager.gate.weight.copy_(new["gate.weight"])
        assert rel_err(step(x), eager(x)) <= tol
        model.load_state_dict(new)
        eager.load_state_dict(new)
        assert rel_err(step(x), eager(x)) <= tol
        model.down.weight.data = 2 * new["down.weight"]
        eager.down.weight.data = 2 * new["down.weight"]
        assert rel_err(step(x), eager(x)) <= tol
        assert len(k3be._compiled) == compiles, "weight updates recompile nothing"
    assert model.gate.weight.dtype == torch.float32, "the masters stay fp32"


def _weight_reads(compiled) -> list[str]:
    """The fused GEMMs' weight arguments, by target: placeholders, or what computes them."""
    (graph,) = compiled.observer.graphs.values()
    reads = []
    for node in graph.nodes:
        if node.target in (torch.ops.k3.linear.default, torch.ops.k3.situ_gate_up.default):
            weights = node.args[1:3] if node.target is torch.ops.k3.situ_gate_up.default \
                else node.args[1:2]
            reads += [w.op if w.op == "placeholder" else str(w.target) for w in weights]
    return reads


def test_autocast_mlp_without_the_stage_reads_each_weight_through_its_cast():
    """K3_WEIGHT_CAST=0 (the default): the graph reads each master through its cast every step:
    down's GEMM does not fuse, gate|up's fuses on the casts' outputs (a weight computed per step,
    which pack cannot pack: the CUDA path concatenates them per call); with the stage every
    fused GEMM reads a weight input. The values are the same."""
    reads = {}
    for on in (False, True):
        _, eager, step = _steps({"weight_cast": on})
        x = torch.randn(2, 64, dtype=bf16)
        with torch.no_grad(), _autocast():
            assert rel_err(step(x), eager(x)) <= TOL["bfloat16"]
        reads[on] = _weight_reads(k3be.last_compiled())
    assert reads == {False: ["prims.convert_element_type.default"] * 2,
                     True: ["placeholder"] * 3}, reads


def test_the_stage_off_says_once_where_it_would_take_weights(caplog, monkeypatch):
    """With the stage off a compile reading fp32 masters through casts warns once per process,
    counting the weights the stage would take (gate, up, down); with it on, nothing."""
    from k3compile.stages import weight_cast as stage

    monkeypatch.setattr(stage, "_HINTED", False)
    for on, want in ((True, []), (False, [3]), (False, [])):  # the third compile: warned already
        caplog.clear()
        _, eager, step = _steps({"weight_cast": on})
        x = torch.randn(2, 64, dtype=bf16)
        with torch.no_grad(), _autocast(), caplog.at_level(logging.WARNING, "k3compile"):
            assert rel_err(step(x), eager(x)) <= TOL["bfloat16"]
        got = [int(r.getMessage().split()[1]) for r in caplog.records
               if "K3_WEIGHT_CAST=1" in r.getMessage()]
        assert got == want, (on, got)


def test_flax_kernels_under_autocast_are_re_laid_then_copied():
    """[in, out] fp32 kernels read as `h @ W` under autocast: stage kernel_layout reads Wᵀ (its
    cast), this stage its copy; the first call re-lays W (a new address: the copy is made again),
    the compile after it finds W laid out so. Values as eager's, the GEMMs fused, updates seen."""
    from tests.stages.test_kernel_layout import FlaxMLP

    torch._dynamo.reset()
    model, eager = FlaxMLP(), FlaxMLP()
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "weight_cast": True})
    x = torch.randn(2, 64, dtype=bf16)
    with torch.no_grad(), _autocast():
        for _ in range(3):  # the second call compiles again: the first re-laid the kernels
            assert rel_err(step(x), eager(x)) <= TOL["bfloat16"]
        fused = _fused(k3be.last_compiled())
        assert fused.get("k3.situ_gate_up") == 1 and fused.get("k3.linear") == 1, fused
        assert all(w.t().is_contiguous() and w.dtype == torch.float32
                   for w in (model.gate, model.up, model.down))
        new = FlaxMLP(seed=1).state_dict()
        model.load_state_dict(new)
        eager.load_state_dict(new)
        assert rel_err(step(x), eager(x)) <= TOL["bfloat16"]


def test_a_stage_cache_hit_reads_the_copies_too(tmp_path, monkeypatch):
    """The stage runs before the cache's key, on every compile: a second compile of a fresh
    model (a new process's) loads the entry and reads its own copies; no direct link (the
    wrapper maps the inputs)."""
    from collections import Counter

    from k3compile import stage_cache

    monkeypatch.setattr(stage_cache, "root", lambda: tmp_path / "k3cache" / "stages")
    monkeypatch.setattr(stage_cache, "STATS", Counter())
    x = torch.randn(2, 64, dtype=bf16)
    outs, stats = [], []
    for _ in range(2):
        before = Counter(stage_cache.STATS)
        model, eager, step = _steps({"stage_cache": True})
        with torch.no_grad(), _autocast():
            outs.append(step(x))
            assert rel_err(outs[-1], eager(x)) <= TOL["bfloat16"]
            model.up.weight.mul_(2)
            eager.up.weight.mul_(2)
            assert rel_err(step(x), eager(x)) <= TOL["bfloat16"]
        stats.append(dict(Counter(stage_cache.STATS) - before))
        assert _weight_reads(k3be.last_compiled()) == ["placeholder"] * 3
    assert stats == [{"missed": 1, "stored": 1, "linked": 1}, {"loaded": 1, "linked": 1}], stats
    assert torch.equal(*outs)


def test_inductor_compiles_the_graph_on_the_copies():
    """Executor inductor: the graph compiled for the copies' example values (bf16 inputs), its
    fused GEMMs reading them; an in-place update and a rebind reach the next call (measured on
    the CPU: equal to eager's bitwise)."""
    model, eager, step = _steps({"executor": "inductor"})
    x = torch.randn(2, 64, dtype=bf16)
    with torch.no_grad(), _autocast():
        assert rel_err(step(x), eager(x)) <= TOL["bfloat16"]
        assert _weight_reads(k3be.last_compiled()) == ["placeholder"] * 3
        for m in (model, eager):
            m.up.weight.mul_(2)
            m.down.weight.data = 2 * m.down.weight.detach().clone()
        assert rel_err(step(x), eager(x)) <= TOL["bfloat16"]
