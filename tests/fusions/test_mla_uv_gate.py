"""mla_uv_gate: Gated MLA's W_UV up-projection (absorbed form) and sigmoid output gate as one op."""

from __future__ import annotations

import itertools

import pytest
import torch
from k3compile.patterns import mla_uv_gate

from k3compile import settings
from k3compile.rewrite import apply_patterns

from .pattern_checks import (
    assert_near_miss,
    assert_rewritten_equal,
    rewrite,
    targets,
    with_kernel_limits,
)

H, N, V, C, L = 4, 32, 32, 64, 24


def _attend(p, kv_lat, w_kvb):
    """The attention's value einsum (o_lat as the model has it) and W_UV cut from kv_b."""
    o_lat = torch.einsum("bthl,blc->bthc", p, kv_lat)
    _, w_uv = w_kvb.view(H, N + V, C).split([N, V], dim=1)
    return o_lat, w_uv


def uv_gate(p, kv_lat, w_kvb, g):
    """GatedMLA.forward after the attention."""
    B, T = p.shape[:2]
    o_lat, w_uv = _attend(p, kv_lat, w_kvb)
    o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * V)
    return o * torch.sigmoid(g)


def _args(batch, tokens, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(batch * 10 + tokens)
    return [torch.softmax(torch.randn(batch, tokens, H, L, generator=gen), -1).to(dtype),
            torch.randn(batch, L, C, generator=gen).to(dtype),
            (torch.randn(H * (N + V), C, generator=gen) * C**-0.5).to(dtype),
            torch.randn(batch, tokens, H * V, generator=gen).to(dtype)]


@pytest.mark.parametrize("batch,tokens,dtype", [(1, 1, torch.bfloat16), (1, 8, torch.bfloat16),
                                                (3, 1, torch.bfloat16), (3, 8, torch.bfloat16),
                                                (1, 1, torch.float32)])
def test_rewrites(batch, tokens, dtype):
    args = _args(batch, tokens, dtype)
    gm, report = rewrite(uv_gate, args, mla_uv_gate.patterns(), joint=True)
    assert_rewritten_equal(gm, report, uv_gate, args, "k3.mla_uv_gate")


def test_two_variants_cover_every_batch_tokens_and_dtype():
    shipped = mla_uv_gate.patterns()
    for (b, t), dtype in itertools.product([(1, 1), (1, 3), (2, 1), (2, 3)],
                                           [torch.bfloat16, torch.float32]):
        probe = mla_uv_gate._variant(b, t, dtype)
        assert any(p.expr.pattern_eq(probe.expr) for p in shipped), (b, t, dtype)


def test_escaping_ungated_output_is_a_near_miss():
    def leaky(p, kv_lat, w_kvb, g):
        B, T = p.shape[:2]
        o_lat, w_uv = _attend(p, kv_lat, w_kvb)
        o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * V)
        return o * torch.sigmoid(g), o + 1

    _, report = rewrite(leaky, _args(3, 8), mla_uv_gate.patterns(), joint=True)
    assert_near_miss(report, "mla_uv_gate", "users")


def test_heads_first_value_einsum_is_not_bound_as_tokens_first():
    """spell14 (gpt-fast style): SDPA's o_lat [B, H, 1, C] up-projected by
    `einsum("bhtc,hdc->bthd")`. At T = 1 its permute orders the dims longer than 1 as the
    pattern's does, so the matcher took it, binding o_lat heads-first where the op reads
    [B, T, H, C]: the reference returned [B, H, H·V] (a crash in the next op; at H = 1 a silent
    wrong answer). The check refuses it, by name, and the graph keeps its values."""
    def heads_first(p, kv_lat, w_kvb, g):
        B, T = p.shape[:2]
        o_lat = torch.einsum("bthl,blc->bhtc", p, kv_lat)  # [B, H, T, C]
        _, w_uv = w_kvb.view(H, N + V, C).split([N, V], dim=1)
        o = torch.einsum("bhtc,hdc->bthd", o_lat, w_uv).reshape(B, T, H * V)
        return o * torch.sigmoid(g)

    for dtype in (torch.bfloat16, torch.float32):
        args = _args(3, 1, dtype)
        gm, report = rewrite(heads_first, args, mla_uv_gate.patterns(), joint=True)
        got, want = gm(*args), heads_first(*args)
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
        if "k3.mla_uv_gate" not in targets(gm):
            assert_near_miss(report, "mla_uv_gate", "check refused", "not [B, T, H, C]")


def test_the_engine_refuses_the_heads_first_site_by_the_op_s_reference(monkeypatch):
    """Without the check's shape test, the engine's own: the op's fake takes its shape from g
    and agrees with the site, the reference run on the bound fakes gives [B, H, H·V]."""
    monkeypatch.setattr(mla_uv_gate, "check", lambda match: None)
    def heads_first(p, kv_lat, w_kvb, g):
        B, T = p.shape[:2]
        o_lat = torch.einsum("bthl,blc->bhtc", p, kv_lat)
        _, w_uv = w_kvb.view(H, N + V, C).split([N, V], dim=1)
        return torch.einsum("bhtc,hdc->bthd", o_lat, w_uv).reshape(B, T, H * V) * torch.sigmoid(g)

    args = _args(3, 1)
    gm, report = rewrite(heads_first, args, mla_uv_gate.patterns(), joint=True)
    assert "k3.mla_uv_gate" not in targets(gm)
    assert torch.equal(gm(*args), heads_first(*args))
    assert_near_miss(report, "mla_uv_gate", "reference", "[3, 4, 128]")
    gm, report = rewrite(uv_gate, args, mla_uv_gate.patterns(), joint=True)  # the faithful site
    assert_rewritten_equal(gm, report, uv_gate, args, "k3.mla_uv_gate")


def test_the_engine_refuses_the_heads_first_site_at_a_symbolic_batch(monkeypatch):
    """The same at a symbolic batch (every site under `mark_batch` has one): the reference check
    skipped such sites until session 38 and the site fused (measured: `k3.mla_uv_gate` in the
    graph); it now runs the reference at the batch's hint (3 here)."""
    monkeypatch.setattr(mla_uv_gate, "check", lambda match: None)

    class HeadsFirst(torch.nn.Module):
        def forward(self, p, kv_lat, w_kvb, g):
            B, T = p.shape[:2]
            o_lat = torch.einsum("bthl,blc->bhtc", p, kv_lat)
            _, w_uv = w_kvb.view(H, N + V, C).split([N, V], dim=1)
            o = torch.einsum("bhtc,hdc->bthd", o_lat, w_uv).reshape(B, T, H * V)
            return o * torch.sigmoid(g)

    args = _args(3, 1)
    batch = torch.export.Dim("batch", min=2, max=64)
    gm = torch.export.export(HeadsFirst(), tuple(args),
                             dynamic_shapes=({0: batch}, {0: batch}, None, {0: batch}))
    gm = gm.run_decompositions().module()
    assert any(not isinstance(n.meta["val"].shape[0], int)
               for n in gm.graph.nodes if n.op == "placeholder" and "val" in n.meta)
    report = apply_patterns(gm.graph, mla_uv_gate.patterns())
    gm.recompile()
    assert "k3.mla_uv_gate.default" not in targets(gm)
    assert_near_miss(report, "mla_uv_gate", "reference", "[3, 4, 128]", "=3")
    assert torch.equal(gm(*args), HeadsFirst()(*args))


def test_symbolic_sizes_take_their_hint_or_an_unbacked_batch_of_two():
    """engine._Sizes: a backed symbol at its hint, an unbacked one (`mark_batch`'s, >= 1) at 2,
    the same value wherever it appears."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from k3compile.rewrite.engine import _Sizes

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(5, torch._dynamo.source.ConstantSource("b")),
                                   hint=5)
    unbacked = env.create_unbacked_symint()
    torch._check(unbacked >= 1)
    sizes = _Sizes()
    assert [sizes.size(n) for n in (backed, unbacked, unbacked * 3 + backed, 7)] == [5, 2, 11, 7]


def test_check_refuses_float64():
    _, report = rewrite(uv_gate, _args(3, 8, torch.float64), mla_uv_gate.patterns(), joint=True)
    assert_near_miss(report, "mla_uv_gate", "check refused", "float64")


@pytest.mark.parametrize("gate_on,batch,fused", [(False, 1, False), (True, 1, True),
                                                 (True, 3, False)])
def test_gpu_graphs_fuse_only_what_the_gate_variant_takes(monkeypatch, gate_on, batch, fused):
    """Where only sites with a CUDA kernel fuse (GPU graphs): one row with gemv's gate variant
    switched on (K3_GEMV_FUSED "gate"); otherwise Inductor keeps the site, with the reason."""
    with_kernel_limits(monkeypatch, "mla_uv_gate")
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset({"gate"} if gate_on else ()))
    args = _args(batch, 1)
    gm, report = rewrite(uv_gate, args, mla_uv_gate.patterns(), joint=True, kernels_only=True)
    if fused:
        assert_rewritten_equal(gm, report, uv_gate, args, "k3.mla_uv_gate")
    else:
        assert not report.hits
        why = report.deferred["mla_uv_gate"]
        assert ("variant is off" if not gate_on else "3 rows") in why, why
        torch.testing.assert_close(gm(*args), uv_gate(*args), rtol=0, atol=0)


def test_b1_graph_hands_w_uv_to_the_kernel_in_place(monkeypatch):
    """Issue 21: the B1 graph feeds mla_uv_gate kv_b's weight through views only, and the op's
    CUDA route hands that view to gemv's gate variant as it is (no concatenation of the heads).
    The graph runs with `mla_uv_gate_cuda` in the op's place, gemv's launch faked on CPU."""
    from k3compile.kernels import mla_uv_gate as kernel
    from k3compile.kernels.common import gemv

    from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

    with_kernel_limits(monkeypatch, "mla_uv_gate")
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset({"gate"}))
    args = _args(1, 1)
    gm, report = rewrite(uv_gate, args, mla_uv_gate.patterns(), joint=True, kernels_only=True)
    assert len(report.hits) == 1, report
    (node,) = [n for n in gm.graph.nodes if n.target == torch.ops.k3.mla_uv_gate.default]
    copies = ("cat", "clone", "copy", "contiguous", "_to_copy", "stack")
    w, producers = node.args[1], []
    while w.op == "call_function":
        producers.append(getattr(w.target, "__name__", str(w.target)))
        w = w.args[0]
    assert w.op == "placeholder" and not [p for p in producers if p.split(".")[0] in copies], \
        producers

    handed = []
    monkeypatch.setattr(gemv, "fused_takes", lambda x, variant: True)
    monkeypatch.setattr(gemv, "gemv_gate_cuda", lambda x, w_uv, g: handed.append(w_uv) or (
        mla_uv_gate_ref(x.view(len(x), 1, H, C), w_uv, g.view(len(x), 1, H * V)).view(len(x), -1)))

    class CudaRoute(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target == torch.ops.k3.mla_uv_gate.default:
                return kernel.mla_uv_gate_cuda(*args, **kwargs)
            return super().call_function(target, args, kwargs)

    got = CudaRoute(gm).run(*args)
    torch.testing.assert_close(got, uv_gate(*args), rtol=0, atol=0)
    (w_uv,) = handed
    w_kvb = args[2]
    assert w_uv.data_ptr() == w_kvb.data_ptr() + N * C * w_kvb.element_size(), "not kv_b's view"
    assert w_uv.stride() == ((N + V) * C, C, 1)


# gate_fp32: the gate product in an fp32 island, one rounding (fp32 islands under autocast:
# tests/models/spell11_k3.py's `(o.float() * sigmoid(g.float())).to(bf16)`)


def uv_gate_fp32(p, kv_lat, w_kvb, g):
    B, T = p.shape[:2]
    o_lat, w_uv = _attend(p, kv_lat, w_kvb)
    o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * V)
    return (o.float() * torch.sigmoid(g.float())).to(o.dtype)


def uv_gate_kept_fp32(p, kv_lat, w_kvb, g):  # look-alike: the fp32 product never rounded back
    B, T = p.shape[:2]
    o_lat, w_uv = _attend(p, kv_lat, w_kvb)
    o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv).reshape(B, T, H * V)
    return o.float() * torch.sigmoid(g.float())


@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 1), (1, 8), (3, 8)])
def test_fp32_gate_fuses_as_its_variant(batch, tokens):
    """The gate product in fp32 with one rounding: its own variant takes the site and the op runs
    with gate_fp32=True, bit-equal to the unfused graph and not to K3's rounding of sigmoid(g)."""
    args = _args(batch, tokens)
    gm, report = rewrite(uv_gate_fp32, args, mla_uv_gate.patterns(), joint=True)
    assert_rewritten_equal(gm, report, uv_gate_fp32, args, "k3.mla_uv_gate")
    assert [h.pattern.endswith(",gate_fp32]") for h in report.hits] == [True], report.hits
    (node,) = [n for n in gm.graph.nodes if n.target == torch.ops.k3.mla_uv_gate.default]
    assert node.args[3:] == (True,)
    assert not torch.equal(gm(*args), uv_gate(*args))


def test_fp32_gate_kept_in_fp32_is_left_alone():
    """Look-alike: the fp32 product never rounded back to bf16 (an fp32 output): no variant takes
    it, the graph computes as before."""
    args = _args(3, 1)
    gm, report = rewrite(uv_gate_kept_fp32, args, mla_uv_gate.patterns(), joint=True)
    assert not report.hits
    torch.testing.assert_close(gm(*args), uv_gate_kept_fp32(*args), rtol=0, atol=0)


def test_fp32_gate_stays_with_inductor_on_gpu_graphs(monkeypatch):
    """gemv's gate variant rounds sigmoid(g) to bf16 (no gate_fp32 build): a GPU graph leaves the
    site to Inductor with that reason, where the plain gate fuses at one row."""
    with_kernel_limits(monkeypatch, "mla_uv_gate")
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset({"gate"}))
    args = _args(1, 1)
    gm, report = rewrite(uv_gate_fp32, args, mla_uv_gate.patterns(), joint=True,
                         kernels_only=True)
    assert not report.hits and "gate_fp32" in report.deferred["mla_uv_gate"], report
    torch.testing.assert_close(gm(*args), uv_gate_fp32(*args), rtol=0, atol=0)
    _, report = rewrite(uv_gate, args, mla_uv_gate.patterns(), joint=True, kernels_only=True)
    assert [h.pattern for h in report.hits] == ["mla_uv_gate[B=1,T=1]"]


def test_the_cuda_route_of_an_fp32_gate_is_its_reference():
    """The op's CUDA implementation, handed gate_fp32, runs the reference (never gemv's gate
    variant, whose rounding is K3's); checked on CPU tensors, the kernel call not reached."""
    from k3compile.kernels import mla_uv_gate as kernel

    from k3compile.ops.mla_uv_gate import mla_uv_gate_ref

    p, kv_lat, w_kvb, g = _args(1, 1)
    o_lat, w_uv = _attend(p, kv_lat, w_kvb)
    want = mla_uv_gate_ref(o_lat, w_uv, g, True)
    torch.testing.assert_close(kernel.mla_uv_gate_cuda(o_lat, w_uv, g, True), want, rtol=0,
                               atol=0)
    assert kernel.refusal(o_lat, w_uv, g, gate_fp32=True).startswith("gate_fp32")
    torch.testing.assert_close(want, uv_gate_fp32(p, kv_lat, w_kvb, g), rtol=0, atol=0)
