"""oproj_attn_res_mix_norm: the attention's o_proj GEMM folded into the post-attention depth mix +
RMSNorm op (world size 1), with the prefix add and where a block starts, and with the mix's
scores in fp32 (Moonshot's, `scores_fp32`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import oproj_attn_res_mix_norm

from .pattern_checks import (
    assert_fused_on_gpu_graph,
    assert_near_miss,
    assert_rewritten_equal,
    rewrite,
)

D, EPS = 64, 1e-5


def _inputs(width=D, dtype=torch.bfloat16, n_blocks=2):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)
    o, w_o = rnd(3, 1, width), (torch.randn(D, width, generator=g) / width**0.5).to(dtype)
    acts = [rnd(3, 1, D) for _ in range(1 + n_blocks)]  # prefix, blocks
    weights = [(1 + 0.1 * torch.randn(D, generator=g)).to(dtype), rnd(1, D),
               (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)]
    return [o, w_o, *acts, *weights]


def post_mix(o, w_o, prefix, b0, b1, wmn, wmp, wn):  # the graph after attn_res_mix_norm
    a = F.linear(o, w_o)
    prefix_out, x = torch.ops.k3.attn_res_mix_norm(prefix, a, [b0, b1], wmn, wmp, wn, EPS, EPS)
    return x, prefix_out


def new_block(o, w_o, prefix, b0, b1, wmn, wmp, wn):  # a block starts: a is the next prefix
    a = F.linear(o, w_o)
    x = torch.ops.k3.attn_res_mix_norm(a, None, [b0, b1], wmn, wmp, wn, EPS, EPS)[1]
    return x, a * 2


@pytest.mark.parametrize("fn", [post_mix, new_block])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rewrites_and_equals_eager(fn, dtype):
    args = _inputs(dtype=dtype)
    gm, report = rewrite(fn, args, oproj_attn_res_mix_norm.patterns())
    assert_rewritten_equal(gm, report, fn, args, "k3.oproj_attn_res_mix_norm")
    assert not any("mm" in str(n.target) for n in gm.graph.nodes)


def post_mix_fp32(o, w_o, prefix, b0, b1, wmn, wmp, wn):  # the mix's scores in fp32
    a = F.linear(o, w_o)
    prefix_out, x = torch.ops.k3.attn_res_mix_norm(prefix, a, [b0, b1], wmn, wmp, wn, EPS, EPS,
                                                   True)
    return x, prefix_out


def new_block_fp32(o, w_o, prefix, b0, b1, wmn, wmp, wn):
    a = F.linear(o, w_o)
    x = torch.ops.k3.attn_res_mix_norm(a, None, [b0, b1], wmn, wmp, wn, EPS, EPS, True)[1]
    return x, a * 2


@pytest.mark.parametrize("fn", [post_mix, new_block])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flat_tokens_rewrite(fn, dtype):
    """Activations [N, D] (one row per token, vLLM's): o_proj is one mm, no views (`flat`)."""
    args = [a.view(-1, a.shape[-1]) if a.dim() == 3 else a for a in _inputs(dtype=dtype)]
    gm, report = rewrite(fn, args, oproj_attn_res_mix_norm.patterns())
    assert_rewritten_equal(gm, report, fn, args, "k3.oproj_attn_res_mix_norm")
    assert ",flat" in report.hits[0].pattern


@pytest.mark.parametrize("fn", [post_mix_fp32, new_block_fp32])
def test_fp32_scores_carry_over(fn):
    args = _inputs()
    gm, report = rewrite(fn, args, oproj_attn_res_mix_norm.patterns())
    assert_rewritten_equal(gm, report, fn, args, "k3.oproj_attn_res_mix_norm")
    assert report.hits[0].pattern.endswith(",scores_fp32]")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.oproj_attn_res_mix_norm.default")
    assert op.args[-3:] == (EPS, EPS, True)


def test_escaping_projection_is_a_near_miss():
    def escaped(o, w_o, prefix, b0, b1, wmn, wmp, wn):
        a = F.linear(o, w_o)  # also returned: the GEMM's output escapes the fusion
        p, x = torch.ops.k3.attn_res_mix_norm(prefix, a, [b0, b1], wmn, wmp, wn, EPS, EPS)
        return x, p, a

    _, report = rewrite(escaped, _inputs(), oproj_attn_res_mix_norm.patterns())
    assert_near_miss(report, "oproj_attn_res_mix_norm", "user")


def test_check_refuses_unaligned_width():
    _, report = rewrite(post_mix, _inputs(width=60), oproj_attn_res_mix_norm.patterns())
    assert_near_miss(report, "oproj_attn_res_mix_norm", "check refused", "multiples of 8")


def _state_step(state, slots, o_in):
    """The attention's output as an attention computes it: read from a state it writes."""
    new = state[slots] + o_in
    state.index_put_((slots,), new)
    return new.view(o_in.shape)


def test_attention_output_of_a_foreign_module_name_fuses():
    """o is read from a state the step writes: the attention's o_proj whatever its module is
    called (the blind spelling's `mixer.out`)."""

    def attn(state, slots, o, w_o, prefix, b0, b1, wmn, wmp, wn):
        a = F.linear(_state_step(state, slots, o), w_o)
        prefix_out, x = torch.ops.k3.attn_res_mix_norm(prefix, a, [b0, b1], wmn, wmp, wn, EPS, EPS)
        return x, prefix_out

    args = [torch.zeros(4, 1, D), torch.tensor([2, 0, 1]), *_inputs(dtype=torch.float32)]
    _, report = rewrite(attn, args, oproj_attn_res_mix_norm.patterns())
    assert [h.op for h in report.hits] == ["k3.oproj_attn_res_mix_norm"]


def test_mlp_down_projection_is_refused():
    """The dense MLP's down GEMM feeds the next mix as its delta; its input comes from the norm
    before the MLP and no state: a near miss that says so, not an o_proj fusion."""

    def mlp(x0, w_o, prefix, b0, b1, wmn, wmp, wn):
        _, x = torch.ops.k3.attn_res_mix_norm(prefix, x0, [b0, b1], wmn, wmp, wn, EPS, EPS)
        a = F.linear(torch.tanh(x), w_o)  # the MLP on the norm's output
        prefix_out, x2 = torch.ops.k3.attn_res_mix_norm(prefix, a, [b0, b1], wmn, wmp, wn, EPS,
                                                        EPS)
        return x2, prefix_out

    args = _inputs(dtype=torch.float32)
    _, report = rewrite(mlp, [args[2], *args[1:]], oproj_attn_res_mix_norm.patterns())
    assert_near_miss(report, "oproj_attn_res_mix_norm", "check refused", "reads no state",
                     "MLP")


def test_mlp_after_a_fused_o_proj_is_refused():
    """Where the post-attention mix already took the o_proj (k3.oproj_attn_res_mix_norm, as in
    Moonshot's dense layer 0), the MLP reads its x: the walk back from the MLP's activation stops
    there and never reaches the attention's state."""

    def layer(state, slots, o, w_o, prefix, b0, b1, wmn, wmp, wn):
        attn = _state_step(state, slots, o)
        p, x = torch.ops.k3.oproj_attn_res_mix_norm(attn, w_o, prefix, [b0, b1], wmn, wmp, wn,
                                                    EPS, EPS)
        a = F.linear(torch.tanh(x), w_o)  # the MLP on the norm's output
        prefix_out, x2 = torch.ops.k3.attn_res_mix_norm(p, a, [b0, b1], wmn, wmp, wn, EPS, EPS)
        return x2, prefix_out

    args = [torch.zeros(4, 1, D), torch.tensor([2, 0, 1]), *_inputs(dtype=torch.float32)]
    _, report = rewrite(layer, args, oproj_attn_res_mix_norm.patterns())
    assert_near_miss(report, "oproj_attn_res_mix_norm", "check refused", "reads no state")


def post_mix_fp32_weight(o, w_o, prefix, b0, b1, wmn, wmp, wn):  # the norm's weight in fp32 too
    a = F.linear(o, w_o)
    prefix_out, x = torch.ops.k3.attn_res_mix_norm(prefix, a, [b0, b1], wmn, wmp, wn, EPS, EPS,
                                                   True, True)
    return x, prefix_out


def new_block_fp32_weight(o, w_o, prefix, b0, b1, wmn, wmp, wn):
    a = F.linear(o, w_o)
    x = torch.ops.k3.attn_res_mix_norm(a, None, [b0, b1], wmn, wmp, wn, EPS, EPS, True, True)[1]
    return x, a * 2


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("fn", [post_mix_fp32_weight, new_block_fp32_weight])
def test_fp32_weight_norm_carries_over(fn, flat):
    """The mix's norm_weight_fp32 (spell9's norm: the weight multiplied in fp32 before the one
    rounding) stays on the fused op, bit-equal, on [B, T, D] and on flat rows."""
    args = _inputs()
    if flat:
        args = [a.view(-1, a.shape[-1]) if a.dim() == 3 else a for a in args]
    gm, report = rewrite(fn, args, oproj_attn_res_mix_norm.patterns())
    assert_rewritten_equal(gm, report, fn, args, "k3.oproj_attn_res_mix_norm")
    assert report.hits[0].pattern.endswith(f"{',flat' if flat else ''},scores_fp32,norm_weight_fp32]")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.oproj_attn_res_mix_norm.default")
    assert op.args[-4:] == (EPS, EPS, True, True)
    plain = post_mix_fp32 if fn is post_mix_fp32_weight else new_block_fp32
    assert not torch.equal(plain(*args)[0], gm(*args)[0])


def test_fp32_weight_norm_fuses_on_gpu_graphs(monkeypatch):
    """The mix kernel's norm_weight_fp32 build passed its GPU tests (H100, 2026-12-05; the two
    launches run it after o_proj), so a GPU graph fuses o_proj and the flagged mix."""
    from k3compile.ops import registry

    op = "oproj_attn_res_mix_norm"  # registered as kernels/oproj_attn_res_mix_norm.py does
    monkeypatch.setitem(registry._entries, op, registry.KernelEntry(op))
    args = _inputs()
    gm, report = rewrite(post_mix_fp32_weight, args, oproj_attn_res_mix_norm.patterns(),
                         kernels_only=True)
    assert_fused_on_gpu_graph(gm, report, post_mix_fp32_weight, args, op)


def test_flagless_variants_leave_the_flagged_call():
    """Look-alike for the variants without the flag (and so the TP form's, which has none): the
    flagged mix call is another site; no variant drops the flag."""
    pats = [p for p in oproj_attn_res_mix_norm.patterns() if "norm_weight_fp32" not in p.name]
    args = _inputs()
    gm, report = rewrite(post_mix_fp32_weight, args, pats)
    assert not report.hits
    for got, want in zip(gm(*args), post_mix_fp32_weight(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
