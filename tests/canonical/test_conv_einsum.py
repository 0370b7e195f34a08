"""conv_einsum and qkv_split: KDA's short conv as an einsum over an unfolded window becomes the
canonical depthwise convolution (SiLU before the transpose), and one q|k|v GEMM whose conv output
is split becomes three GEMMs on weight row slices with the taps as a cat of row slices (the form
linear_concat and kda_decode take); look-alikes stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import conv_einsum, qkv_split
from tests.conftest import rel_err
from tests.fusions.pattern_checks import graph, targets

B, T, W, D, TAPS = 2, 1, 16, 32, 4


def _rewrite(fn, args, rules=(conv_einsum, qkv_split)):
    before, after = graph(fn, *args, joint=True), graph(fn, *args, joint=True)
    counts = [rule.apply(after.graph) for rule in rules]
    after.recompile()
    return before, after, counts


def _blind(x, w, state, slots, taps):
    """tests/spellings/blind_k3.py's KDA front: one q|k|v Linear, unfold + einsum, SiLU, chunk."""
    hist = torch.cat([state[slots], F.linear(x, w).transpose(1, 2)], dim=-1)
    conv = torch.einsum("bctk,ck->btc", hist.unfold(-1, TAPS, 1), taps)
    conv = conv * torch.sigmoid(conv)
    q, k, v = conv.chunk(3, dim=-1)
    return q * 2, k + 1, v, hist[..., T:]


def _args(tokens=T, dtype=torch.float32, batch=B):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, tokens, D, generator=g).to(dtype),
            torch.randn(3 * W, D, generator=g).to(dtype),
            torch.randn(5, 3 * W, TAPS - 1, generator=g).to(dtype), torch.tensor([3, 1][:batch]),
            torch.randn(3 * W, TAPS, generator=g).to(dtype)]


# batch 1, T 1: the bmm is a batch of dot products, which Inductor decomposes on CPU to mul + sum
@pytest.mark.parametrize(("batch", "tokens"), [(2, 1), (2, 8), (1, 1), (1, 8)])
def test_blind_front_becomes_three_gemms_and_one_conv(batch, tokens):
    args = _args(tokens, batch=batch)
    before, after, counts = _rewrite(_blind, args)
    assert counts == [1, 1]
    t = targets(after)
    assert "aten.convolution.default" in t and "aten.unfold.default" not in t
    assert t.count("aten.mm.default") == 3 and "aten.bmm.default" not in t
    conv = next(n for n in after.graph.nodes if str(n.target) == "aten.convolution.default")
    assert str(conv.args[1].target) == "aten.cat.default"  # taps as q|k|v row slices
    assert str(next(iter(conv.users)).target) in ("aten.sigmoid.default", "aten.mul.Tensor")
    for got, want in zip(after(*args), before(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 1e-5


def _mixing(x, w, state, slots, taps):
    """channels mixed by the taps (not depthwise): not a short conv"""
    hist = torch.cat([state[slots], F.linear(x, w).transpose(1, 2)], dim=-1)
    return torch.einsum("bctk,dk->btd", hist.unfold(-1, TAPS, 1), taps[:TAPS])


def _whole_read(x, w, state, slots, taps):
    """the conv output read whole besides its pieces: the GEMM stays one"""
    hist = torch.cat([state[slots], F.linear(x, w).transpose(1, 2)], dim=-1)
    conv = F.silu(torch.einsum("bctk,ck->btc", hist.unfold(-1, TAPS, 1), taps))
    q, k, v = conv.chunk(3, dim=-1)
    return q * k * v, conv


# bf16 / fp16: the user's bmm rounds the conv, its SiLU rounds again; the canonical form rounds
# once after an fp32 conv + SiLU. The rule takes the pair to rounding (2 ulps of the largest value,
# checked on random values at compile time): the rewritten graph is as close to the fp32 math as
# the user's, or closer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("batch", "tokens"), [(2, 1), (1, 1), (2, 8)])
def test_low_precision_conv_and_silu_become_the_fp32_conv_rounded_once(dtype, batch, tokens):
    args = _args(tokens, dtype, batch)
    before, after, counts = _rewrite(_blind, args)
    assert counts == [1, 1]
    t = targets(after)
    assert "aten.unfold.default" not in t and t.count("aten.mm.default") == 3
    conv = next(n for n in after.graph.nodes if str(n.target) == "aten.convolution.default")
    assert conv.meta["val"].dtype == torch.float32
    exact = _blind(*[a.double() if a.is_floating_point() else a for a in args])
    eps = torch.finfo(dtype).eps
    for got, want, truth in zip(after(*args), before(*args), exact, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 2 * eps
        assert rel_err(got, truth) <= max(rel_err(want, truth), eps / 2)


def _silu_op(x, w, state, slots, taps):
    """spell8's conv: F.silu of the bf16 einsum, which the trace computes in fp32 between casts
    (`x / (1 + exp(-x))` on the upcast, then the cast back)"""
    hist = torch.cat([state[slots], F.linear(x, w).transpose(1, 2)], dim=-1)
    return F.silu(torch.einsum("bctk,ck->bct", hist.unfold(-1, TAPS, 1), taps)).transpose(1, 2)


def test_silu_computed_in_fp32_between_casts_is_taken():
    args = _args(dtype=torch.bfloat16)
    before, after, counts = _rewrite(_silu_op, args, (conv_einsum,))
    assert "prims.convert_element_type.default" in targets(before)  # the upcast SiLU
    assert counts == [1] and "aten.unfold.default" not in targets(after)
    conv = next(n for n in after.graph.nodes if str(n.target) == "aten.convolution.default")
    assert conv.meta["val"].dtype == torch.float32
    exact = _silu_op(*[a.double() if a.is_floating_point() else a for a in args])
    got, want = after(*args), before(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 2 * torch.finfo(torch.bfloat16).eps
    assert rel_err(got, exact) <= max(rel_err(want, exact), torch.finfo(torch.bfloat16).eps / 2)


def _conv_only(x, w, state, slots, taps):
    """a bf16 conv with no SiLU after it: the canonical form has one, so nothing to round with"""
    hist = torch.cat([state[slots], F.linear(x, w).transpose(1, 2)], dim=-1)
    return torch.einsum("bctk,ck->btc", hist.unfold(-1, TAPS, 1), taps).chunk(3, dim=-1)


def _tanh_tail(x, w, state, slots, taps):
    """a bf16 conv followed by another activation than SiLU: no rounding of the canonical form"""
    hist = torch.cat([state[slots], F.linear(x, w).transpose(1, 2)], dim=-1)
    conv = torch.einsum("bctk,ck->btc", hist.unfold(-1, TAPS, 1), taps)
    return torch.tanh(conv * 2).chunk(3, dim=-1)


@pytest.mark.parametrize(("fn", "dtype", "want"), [(_mixing, torch.float32, [0, 0]),
                                                   (_conv_only, torch.bfloat16, [0, 0]),
                                                   (_tanh_tail, torch.bfloat16, [0, 0]),
                                                   (_whole_read, torch.float32, [1, 0])])
def test_look_alikes_stay(fn, dtype, want):
    args = _args(dtype=dtype)
    before, after, counts = _rewrite(fn, args)
    assert counts == want
    assert targets(after).count("aten.mm.default") == 1
    for got, ref in zip(after(*args), before(*args), strict=True):
        assert rel_err(got, ref) <= 1e-5


# ---- a time-major window [B, L, C] (conv state [S, taps-1, C]: tests/models/spell5_k3.py) ----


def _time_major_canonical(x, w, state, slots, taps):
    """the form patterns/kda_decode.py's conv_time_major variants trace"""
    hist = torch.cat([state[slots], F.linear(x, w)], dim=1)
    conv = F.conv1d(hist.transpose(1, 2), taps.reshape(3 * W, 1, TAPS), groups=3 * W)
    return F.silu(conv).transpose(1, 2), hist[:, -(TAPS - 1):]


def _spell5(x, w, state, slots, taps):
    """spell5: unfold on dim 1, times the [C, taps] taps, summed over the taps"""
    hist = torch.cat([state[slots], F.linear(x, w)], dim=1)
    return F.silu((hist.unfold(1, TAPS, 1) * taps).sum(-1)), hist[:, -(TAPS - 1):]


def _einsum_time_major(x, w, state, slots, taps):
    """an einsum over the dim-1 unfold (a bmm), the SiLU written out"""
    hist = torch.cat([state[slots], F.linear(x, w)], dim=1)
    conv = torch.einsum("btck,ck->btc", hist.unfold(1, TAPS, 1), taps)
    return conv * torch.sigmoid(conv), hist[:, -(TAPS - 1):]


def _args_tm(tokens=T, batch=B):
    args = _args(tokens, batch=batch)
    args[2] = args[2].transpose(1, 2).contiguous()  # [S, taps-1, 3W]
    return args


@pytest.mark.parametrize("fn", [_spell5, _einsum_time_major])
@pytest.mark.parametrize(("batch", "tokens"), [(2, 1), (2, 3), (1, 1)])
def test_time_major_window_becomes_the_conv_of_its_transpose(fn, batch, tokens):
    args = _args_tm(tokens, batch)
    before, after, (n,) = _rewrite(fn, args, rules=(conv_einsum,))
    assert n == 1
    t = targets(after)
    assert "aten.unfold.default" not in t and t.count("aten.convolution.default") == 1
    conv = next(x for x in after.graph.nodes if str(x.target) == "aten.convolution.default")
    assert str(conv.args[0].target) in ("aten.permute.default", "aten.transpose.int")
    if fn is _spell5:
        want = graph(_time_major_canonical, *args, joint=True)
        assert sorted(t) == sorted(targets(want))
    for got, ref in zip(after(*args), before(*args), strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-5


def _time_major_strided(x, w, state, slots, taps):
    """windows two rows apart (unfold step 2): a strided conv, not the short conv"""
    hist = torch.cat([state[slots], F.linear(x, w)], dim=1)
    return (hist.unfold(1, TAPS, 2) * taps).sum(-1)


def _time_major_summed_over_channels(x, w, state, slots, taps):
    """the dim-1 unfold's product summed over the channels, not the taps"""
    hist = torch.cat([state[slots], F.linear(x, w)], dim=1)
    return (hist.unfold(1, TAPS, 1) * taps).sum(-2)


@pytest.mark.parametrize("fn", [_time_major_strided, _time_major_summed_over_channels])
def test_time_major_look_alikes_stay(fn):
    args = _args_tm(3)
    before, after, (n,) = _rewrite(fn, args, rules=(conv_einsum,))
    assert n == 0
    assert sorted(targets(after)) == sorted(targets(before))
    torch.testing.assert_close(after(*args), before(*args), rtol=0, atol=0)


def _spell5_three(x, w, state, slots, taps):
    """spell5's front whole: three Linears cat'ed, the taps one [3W, taps] tensor"""
    new = torch.cat([F.linear(x, piece) for piece in w.split(W)], dim=-1)
    hist = torch.cat([state[slots], new], dim=1)
    return F.silu((hist.unfold(1, TAPS, 1) * taps).sum(-1)), hist[:, -(TAPS - 1):]


@pytest.mark.parametrize("tokens", [1, 3])
def test_time_major_taps_become_row_slices(tokens):
    """qkv_split's one-tensor taps case on the transposed time-major window"""
    args = _args_tm(tokens)
    before, after, counts = _rewrite(_spell5_three, args)
    assert counts == [1, 1]
    conv = next(x for x in after.graph.nodes if str(x.target) == "aten.convolution.default")
    assert str(conv.args[1].target) == "aten.cat.default"
    for got, ref in zip(after(*args), before(*args), strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-5


@pytest.mark.parametrize(("batch", "tokens"), [(2, 1), (1, 1), (2, 3)])
def test_spell5_bf16_products_are_taken_to_rounding(batch, tokens):
    """spell5 in bf16: each window x tap product rounds to bf16, then the sum, then the SiLU
    (computed in fp32 between casts); within the rule's 2 ulps of the largest value of the
    canonical fp32 conv + SiLU rounded once, and nearer the fp32 math than the user's (session
    26: the SiLU tail was not found before, so this was never taken)"""
    args = [a.to(torch.bfloat16) if a.is_floating_point() else a for a in _args_tm(tokens, batch)]
    before, after, (n,) = _rewrite(_spell5, args, rules=(conv_einsum,))
    assert n == 1 and "aten.unfold.default" not in targets(after)
    conv = next(x for x in after.graph.nodes if str(x.target) == "aten.convolution.default")
    assert conv.meta["val"].dtype == torch.float32
    exact = _spell5(*[a.double() if a.is_floating_point() else a for a in args])
    eps = torch.finfo(torch.bfloat16).eps
    for got, want, truth in zip(after(*args), before(*args), exact, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 2 * eps
        assert rel_err(got, truth) <= max(rel_err(want, truth), eps / 2)
