"""kda_decode: the whole KDA recurrent step (conv + SiLU with conv-state update, l2norm, decay, β,
delta rule on the fp32 state, gated per-head RMSNorm) as one op updating both states in place."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import kda_decode

from k3compile import canonical
from k3compile.graph import call
from k3compile.ops.kda_decode import KDAVariant
from k3compile.rewrite import apply_patterns, inductor
from k3compile.rewrite.near_miss import op_label
from k3compile.stages import canonicalize as canonicalize_stage
from tests.kernel_checks import assert_cuda_op_equals_cpu, kda_kernel_inputs

from .attention_checks import escape, family, one_thread, step_pair  # noqa: F401
from .kda_checks import clone
from .pattern_checks import assert_near_miss, graph


@pytest.mark.parametrize("dtype,batch,tokens", [(torch.bfloat16, 2, 8), (torch.bfloat16, 1, 1),
                                                (torch.float32, 1, 8)])
def test_model_block_rewrites_and_equals_eager(dtype, batch, tokens):
    want, got, s_want, s_got, report = step_pair("kda", dtype, batch, tokens, 3, "kda_decode")
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report.hits
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for name in s_want:  # conv and recurrent state, every slot
        torch.testing.assert_close(s_got[name], s_want[name], rtol=0, atol=0, msg=name)


def _site(tokens=1, **change):
    variant = next(p for p in family("kda_decode") if p.name.startswith(f"kda_decode[T={tokens},B=n"))
    args = variant.example_inputs()
    names = list(kda_decode.NAMES)
    for name, value in change.items():
        args[names.index(name)] = value
    return args


def test_escaping_beta_is_a_near_miss():
    gm = graph(kda_decode.kda_step, *_site(), joint=True)
    escape(gm, lambda n: n.target is torch.ops.aten.sigmoid.default)  # β = sigmoid(b) escapes
    report = apply_patterns(gm.graph, family("kda_decode"))
    assert_near_miss(report, "kda_decode", "users")


def test_check_refuses_a_shared_norm_weight():
    one = torch.ones(1, dtype=torch.bfloat16)  # broadcasts in the graph, the op wants [K]
    gm = graph(kda_decode.kda_step, *_site(o_norm_weight=one), joint=True)
    report = apply_patterns(gm.graph, family("kda_decode"))
    assert_near_miss(report, "kda_decode", "check refused", "o_norm_weight [1] != [8]")


def test_verify_width_without_a_variant_is_a_near_miss():
    args = _site(tokens=8)
    for name in ("q", "k", "v", "g", "graw", "b"):  # 3 tokens: no T=3 variant
        i = kda_decode.NAMES.index(name)
        args[i] = args[i][:, :3].contiguous()
    gm = graph(kda_decode.kda_step, *args, joint=True)
    report = apply_patterns(gm.graph, family("kda_decode"))
    assert_near_miss(report, "kda_decode")


def test_silu_written_out_is_the_same_step():
    """`conv * sigmoid(conv)` for F.silu: the written-out variant takes the site; the op computes
    torch's silu, an ulp or so from the written-out product."""
    def written_out(*args):
        return kda_decode._step(*args, silu_written_out=True)

    args = _site()
    state = args[kda_decode.NAMES.index("recurrent_state")]
    args[kda_decode.NAMES.index("recurrent_state")] = state * 0.05  # a decode-sized state
    args[kda_decode.NAMES.index("q_scale")] = state.shape[-1] ** -0.5  # the model's scale
    gm = graph(written_out, *args, joint=True)
    want = gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    report = apply_patterns(gm.graph, family("kda_decode"))
    gm.recompile()
    assert [h.pattern for h in report.hits] == ["kda_decode[T=1,B=n,bfloat16,silu_written_out]"]
    got = gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


FLA_NORM = KDAVariant(norm_fp32=True)


@pytest.mark.parametrize("batch", [1, 2])
def test_fla_gated_norm_fuses_as_the_fp32_norm_variant(batch):
    """fla's `FusedRMSNormGated` (Moonshot's KDA output norm: fp32 throughout, one rounding) is
    another bf16 computation than the built-in norm: its own variant takes the site, the op runs
    with its spec "norm_fp32" and equals the unfused graph bit for bit (states too)."""
    def fla_norm(*args):
        return kda_decode._step(*args, silu_written_out=False, variant=FLA_NORM)

    args = _site()
    if batch == 1:
        for name in ("q", "k", "v", "g", "graw", "b", "slots"):
            i = kda_decode.NAMES.index(name)
            args[i] = args[i][:1].contiguous()
    state = args[kda_decode.NAMES.index("recurrent_state")]
    args[kda_decode.NAMES.index("recurrent_state")] = state * 0.05
    args[kda_decode.NAMES.index("q_scale")] = state.shape[-1] ** -0.5
    gm = graph(fla_norm, *args, joint=True)
    want = gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    report = apply_patterns(gm.graph, family("kda_decode"))
    gm.recompile()
    B = "1" if batch == 1 else "n"
    assert [h.pattern for h in report.hits] == [f"kda_decode[T=1,B={B},bfloat16,norm_fp32]"]
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.k3.kda_decode.default]
    assert op.args[-1] == "norm_fp32"
    got = gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # the built-in norm rounds in between: the two differ in bf16
    plain = kda_decode.kda_step(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    assert not torch.equal(plain[-1], want[-1])


def _norm_rounded_again(x, weight, gate, eps):
    """fla's gated norm with the normalised o rounded to bf16 before the weight: once too often."""
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (h.to(x.dtype).float() * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def _gate_rounded(x, weight, gate, eps):
    """fla's gated norm with σ(g) rounded to bf16 (the built-in model's gate) before the product."""
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (h * torch.sigmoid(gate.float()).to(x.dtype).float()).to(x.dtype)


@pytest.mark.parametrize("norm", [_norm_rounded_again, _gate_rounded], ids=lambda f: f.__name__)
def test_fp32_norm_look_alike_is_neither_variant(norm, monkeypatch):
    """A gated norm one bf16 rounding away from fla's (and from the built-in norm) is another
    bf16 computation: no kda_decode variant takes it, the graph computes what it did."""
    args = _site()
    state = args[kda_decode.NAMES.index("recurrent_state")]
    args[kda_decode.NAMES.index("recurrent_state")] = state * 0.05
    args[kda_decode.NAMES.index("q_scale")] = state.shape[-1] ** -0.5  # what check() wants
    with monkeypatch.context() as patch:  # the look-alike only while this graph is traced
        patch.setattr(kda_decode, "rms_norm_gated_fp32", norm)
        gm = graph(lambda *a: kda_decode._step(*a, silu_written_out=False, variant=FLA_NORM),
                   *args, joint=True)
    want = gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    report = apply_patterns(gm.graph, family("kda_decode"))
    gm.recompile()
    assert_near_miss(report, "kda_decode")
    got = gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    fla = kda_decode._step(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args],
                           silu_written_out=False, variant=FLA_NORM)
    assert not torch.equal(fla[-1], want[-1])  # the spelling is not fla's in disguise


def _respell(gm, source, make) -> int:
    """Each `source` node that inserts one size-1 dim rewritten by make(graph, node, dim)."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.target is not source or not inductor._inserts_one_unit_dim(node):
            continue
        out, inp = list(node.meta["val"].shape), list(node.args[0].meta["val"].shape)
        dim = next(d for d in range(len(out)) if out[d] == 1 and out[:d] + out[d + 1:] == inp)
        with gm.graph.inserting_before(node):
            new = make(gm.graph, node, dim)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        n += 1
    gm.recompile()
    return n


@pytest.mark.parametrize("spelled", ["unsqueeze", "view"])
def test_unsqueeze_and_unit_view_are_one_op(spelled):
    """`A_log.exp()[:, None]` / `o.unsqueeze(1)` for the pattern's `.view(H, 1)` / stack-of-one
    view (tests/models/redteam_k3.py), and the pattern's unsqueezes written as views: the step
    fuses either way (k3compile.rewrite.inductor.view_alike), with the same values."""
    aten = torch.ops.aten
    args = _site()
    state = args[kda_decode.NAMES.index("recurrent_state")]
    args[kda_decode.NAMES.index("q_scale")] = state.shape[-1] ** -0.5  # the model's scale
    gm = graph(kda_decode.kda_step, *args, joint=True)
    if spelled == "unsqueeze":
        n = _respell(gm, aten.view.default,
                     lambda g, node, d: g.call_function(aten.unsqueeze.default, (node.args[0], d)))
    else:
        n = _respell(gm, aten.unsqueeze.default, lambda g, node, d: g.call_function(
            aten.view.default, (node.args[0], list(node.meta["val"].shape))))
    assert n >= 2
    copies = lambda: [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    want = gm(*copies())
    report = apply_patterns(gm.graph, family("kda_decode"))
    gm.recompile()
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report.near_misses[:3]
    for g, w in zip(gm(*copies()), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ---- a near miss names the op that differs (the built-in model's KDA block, one op changed) ----

def _sigmoid_written_out(graph: torch.fx.Graph) -> torch.fx.Node:
    """The decay's sigmoid as `1 / (1 + exp(-x))` traces (reciprocal(add(exp(neg)))), left as
    written (what rule `sigmoid`, switched off, leaves); returns the reciprocal."""
    aten = torch.ops.aten
    sig = next(n for n in graph.nodes if n.target is aten.sigmoid.default
               and any(isinstance(a, float) for u in n.users for a in u.args))  # lower_bound * σ
    x = sig.args[0]
    with graph.inserting_before(sig):
        e = call(graph, aten.exp.default, (call(graph, aten.neg.default, (x,), like=x),), like=x)
        new = call(graph, aten.reciprocal.default, (call(graph, aten.add.Tensor, (e, 1), like=x),),
                   like=sig)
    sig.replace_all_uses_with(new)
    graph.erase_node(sig)
    return new


def _rate_expanded(graph: torch.fx.Graph) -> torch.fx.Node:
    """exp(A_log).view(H, 1) broadcast by an explicit expand to [H, K] (the same product);
    returns the expand."""
    aten = torch.ops.aten
    view = next(n for n in graph.nodes if n.target is aten.view.default
                and n.args[0].target is aten.exp.default and len(n.meta["val"].shape) == 2)
    (mul,) = view.users
    K = next(a for a in mul.args if a is not view).meta["val"].shape[-1]
    with graph.inserting_after(view):
        new = call(graph, aten.expand.default, (view, [view.meta["val"].shape[0], K]), like=view)
    mul.replace_input_with(view, new)
    return new


@pytest.mark.parametrize("change", [_sigmoid_written_out, _rate_expanded],
                         ids=lambda f: f.__name__.strip("_"))
def test_near_miss_names_the_changed_op(change, monkeypatch):
    """The built-in KDA block under backend="k3" with one op of its step changed after the
    canonical rules: the step no longer fuses, the values hold, and the near miss of the variant
    of its batch names the changed node (not a shared intermediate met on the way, as the
    decayed state's user count was)."""
    changed = []

    def rules():
        return (*canonical.all_rules(),
                canonical.Rule("change", lambda g: changed.append(change(g)) or 1, "test"))

    monkeypatch.setattr(canonicalize_stage, "all_rules", rules)
    want, got, _, _, report = step_pair("kda", torch.bfloat16, 2, 1, 1, "kda_decode")
    assert not report.hits
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    (node,) = changed
    misses = [nm for nm in report.near_misses if nm.pattern.startswith("kda_decode[T=1,B=n,")]
    assert len(misses) == 6  # the batch's variants: fp32 / bf16, silu written out, fla's norm
    for miss in misses:
        assert miss.reason.startswith(f"function_mismatch: {node.name} ({op_label(node)} "), miss


# ---- gpt-fast's q|k|v cut and output gate (spell14), written here as a second spelling ----

def _gpt_fast_cut_step(q, k, v, g, graw, b, conv_state, recurrent_state, slots, q_conv_weight,
                       k_conv_weight, v_conv_weight, A_log, dt_bias, o_norm_weight, lower_bound,
                       l2_eps, q_scale, norm_eps):
    """The KDA step with a bf16 conv and SiLU, its output upcast before the transpose and the
    cut (`.float().mT.split(W)`), and the output gate's sigmoid on an upcast, rounded back; the
    rest as `kda_decode._step` (the state writes functional, the delta rule by k3compile.math)."""
    from k3compile.math import delta_rule_step, l2norm, rms_norm

    B, T, W = q.shape
    nh, hd = recurrent_state.shape[1], recurrent_state.shape[2]
    window = torch.cat([conv_state[slots], torch.cat([q, k, v], -1).transpose(1, 2)], -1)
    conv_state = kda_decode.setitem(conv_state, (slots,), window[..., T:])
    taps = torch.cat([q_conv_weight, k_conv_weight, v_conv_weight])
    conv = torch.nn.functional.silu(torch.nn.functional.conv1d(window, taps,
                                                               groups=taps.shape[0]))
    cq, ck, cv = (p.view(B, T, nh, hd) for p in conv.float().mT.split(W, -1))
    cq, ck = l2norm(cq, l2_eps) * q_scale, l2norm(ck, l2_eps)
    gate = torch.exp(A_log.float()).view(nh, 1) * (graw.float().view(B, T, nh, hd)
                                                    + dt_bias.view(nh, hd))
    decay = torch.exp(lower_bound * torch.sigmoid(gate))
    state, outs = recurrent_state[slots], []
    for t in range(T):
        state, o_t = delta_rule_step(state, cq, ck, cv, torch.sigmoid(b.float()), decay, t)
        outs.append(o_t)
    recurrent_state = kda_decode.setitem(recurrent_state, (slots,), state)
    o = torch.stack(outs, dim=1).to(q.dtype)
    out_gate = torch.sigmoid(g.view(B, T, nh, hd).float()).to(q.dtype)
    return recurrent_state, conv_state, rms_norm(o, o_norm_weight, norm_eps) * out_gate


def _gpt_fast_site(with_rules: bool):
    """(the gpt-fast step's graph, with rules `cast_pieces` and `sigmoid_round` applied where
    `with_rules`, its inputs, the unfused graph's outputs on them)."""
    from k3compile.canonical import cast_pieces, sigmoid_round

    args = _site()
    state = args[kda_decode.NAMES.index("recurrent_state")]
    args[kda_decode.NAMES.index("recurrent_state")] = state * 0.05
    args[kda_decode.NAMES.index("q_scale")] = state.shape[-1] ** -0.5
    gm = graph(_gpt_fast_cut_step, *clone(args), joint=True)
    want = gm(*clone(args))
    if with_rules:
        assert [r.apply(gm.graph) for r in (cast_pieces.RULE, sigmoid_round.RULE)] == [1, 1]
        gm.graph.eliminate_dead_code()
    return gm, args, want


@pytest.mark.parametrize("with_rules", [True, False], ids=["rules", "no_rules"])
def test_a_gpt_fast_cut_and_gate_fuse_as_the_rounded_conv(with_rules):
    """bf16: with rules `cast_pieces` (the upcast moved through the transpose to each piece of
    the cut) and `sigmoid_round` (the gate's sigmoid in bf16) the step is kda_decode's
    `conv_rounded` variant (the conv and SiLU rounded as torch rounds them in bf16), fused and
    equal to the unfused graph bit for bit, states too; without them no variant takes it."""
    gm, args, want = _gpt_fast_site(with_rules)
    report = apply_patterns(gm.graph, family("kda_decode"))
    gm.recompile()
    if not with_rules:
        assert not report.hits
        assert_near_miss(report, "kda_decode")
        return
    assert [h.pattern for h in report.hits] == ["kda_decode[T=1,B=n,bfloat16,conv_rounded]"]
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.k3.kda_decode.default]
    assert op.args[-1] == "conv_rounded"
    for g, w in zip(gm(*clone(args)), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_gpt_fast_site_fuses_on_gpu_graphs():
    """As on a GPU graph (`kernels_only`): `conv_rounded` is in GPU_TESTED_FLAGS, so the site
    fuses there too, not deferred, and the kernel's refusal (metadata) takes the build. The
    build alone (the built-in norm, channel-major conv state, K-major state) has no GPU test of
    its own yet: `test_cuda_op_equals_the_cpu_reference_conv_rounded` is it."""
    from k3compile.kernels import kda_decode as kernel

    gm, args, want = _gpt_fast_site(True)
    report = apply_patterns(gm.graph, family("kda_decode"), kernels_only=True)
    gm.recompile()
    assert [h.op for h in report.hits] == ["k3.kda_decode"] and not report.deferred, report
    for g, w in zip(gm(*clone(args)), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in kda_kernel_inputs(2, 1)]
    assert kernel.refusal(*meta, "conv_rounded") is None


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(2, 1), (3, 4)])
def test_cuda_op_equals_the_cpu_reference_conv_rounded(cuda_kernels, B, T):
    """on CUDA, at K3's head dim: the `conv_rounded` build with the built-in norm (spell14's
    bf16 KDA, spell10's probed one) against the CPU reference, states included, two steps"""
    states = (kda_decode.NAMES.index("conv_state"), kda_decode.NAMES.index("recurrent_state"))
    assert_cuda_op_equals_cpu(cuda_kernels, "kda_decode", kda_kernel_inputs(B, T), states,
                              ("conv_rounded",))
