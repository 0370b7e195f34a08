"""token_view: a KDA front and output norm on flat [B*T, ...] tokens (spell7's), viewed to
[B, T, ...] late or flattened early, run on [B, T, ...] values, bit for bit; the q|k|v cut
`reshape(B*T, 3, H, d).unbind(1)` becomes a split of [B, T, 3W]. Look-alikes stay: a view whose
rows are not B·T tokens, an op over the tokens, a row read flat elsewhere, an unbind over the
heads, a [B*H] merge of heads, a graph with no short conv (out of the rule's scope)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import token_view
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.conftest import rel_err

H, D, TAPS = 2, 8, 4
W = H * D
aten = torch.ops.aten


def _args(B=2, T=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, 3 * W, TAPS - 1 + T, generator=g).to(dtype),
            torch.randn(3 * W, 1, TAPS, generator=g).to(dtype),
            torch.randn(B * T, W, generator=g).to(dtype), torch.randn(B * T, H, generator=g),
            torch.randn(W, generator=g), torch.randn(B * T, W, generator=g).to(dtype),
            torch.randn(D, generator=g), torch.randn(H, H, generator=g)]


def _conv(window, taps):
    return F.silu(F.conv1d(window, taps, groups=3 * W))  # [B, 3W, T]


def flat_front(window, taps, graw, b, dt_bias, gate, w_norm, w_b):
    """spell7: q, k, v cut from the conv output as flat [N, H, d]; the l2 norms, decay and β
    on the flat tokens, viewed [B, T, ...] last"""
    B, T = window.shape[0], window.shape[-1] - TAPS + 1
    q, k, v = _conv(window, taps).transpose(1, 2).reshape(B * T, 3, H, D).unbind(1)
    q, k, v = q.float(), k.float(), v.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    alpha = torch.exp(-5.0 * torch.sigmoid(graw.float().unflatten(-1, (H, D))
                                           + dt_bias.view(H, D)))
    beta = torch.sigmoid(F.linear(b, w_b))  # β of its projection (b's GEMM)
    return (*(t.view(B, T, H, D) for t in (q, k, v, alpha)), beta.view(B, T, H))


def flat_out(window, taps, graw, b, dt_bias, gate, w_norm, w_b):
    """spell7's output: the per-token outputs stacked on T, flattened to rows, normed and gated
    on the rows, then the o_proj input"""
    B, T = window.shape[0], window.shape[-1] - TAPS + 1
    o = _conv(window, taps).transpose(1, 2)[..., :W].reshape(B, T, H, D)
    o = torch.stack([o[:, t] * 2.0 for t in range(T)], dim=1).reshape(B * T, H, D)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w_norm
    o = o * torch.sigmoid(gate.float().reshape(-1, H, D))
    return o.reshape(-1, W) @ torch.ones(W, 3)


def per_request(window, taps, graw, b, dt_bias, gate, w_norm, w_b):
    """the same front on [B, T, ...] (spell7's probes `qkv_split` + `kda_per_request`)"""
    B, T = window.shape[0], window.shape[-1] - TAPS + 1
    q, k, v = (t.view(B, T, H, D) for t in _conv(window, taps).transpose(1, 2).split(W, -1))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * D**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    alpha = torch.exp(-5.0 * torch.sigmoid(graw.view(B, T, W).view(B, T, H, D)
                                           + dt_bias.view(H, D)))
    return q, k, v, alpha, torch.sigmoid(F.linear(b, w_b).view(B, T, H))


def _flat_ranks(gm, ops) -> list[int]:
    return [len(n.meta["val"].shape) for n in gm.graph.nodes
            if n.op == "call_function" and n.target in ops]


def _on_rows(gm, rows) -> list[str]:
    """the ops (views aside) that compute a flat [rows, H, ...] value"""
    return [n.name for n in gm.graph.nodes if n.op == "call_function"
            and n.target not in (aten.view.default, aten.reshape.default, aten.mm.default,
                                 aten.permute.default)
            and isinstance(n.meta.get("val"), torch.Tensor)
            and tuple(n.meta["val"].shape[:2]) in ((rows, H), (rows, 3))]


def _same(after, before, args, T):
    """bit for bit; at T > 1 up to the elementwise kernels' rounding on the conv output's
    layout: the reshape's copy of the transposed conv output is gone (the cut reads it as the
    canonical form does, `conv.transpose(1, 2).split(W, -1)`)"""
    if T == 1:
        assert_same(after(*args), before(*args))
        return
    for got, want in zip(after(*args), before(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= (1e-6 if got.dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("B,T", [(2, 1), (2, 3), (1, 1)])
def test_a_flat_front_runs_on_tokens(B, T):
    args = _args(B, T)
    before, after, n = rewrite(token_view, flat_front, *args)
    assert n > 0
    _same(after, before, args, T)
    assert "aten.unbind.int" not in targets(after)
    assert targets(after).count("aten.split.Tensor") == 1  # one cut of [B, T, 3W]
    assert _on_rows(before, B * T) and not _on_rows(after, B * T)  # norms, decay, β on [B, T]
    # the probes' spelling in eager (elementwise CPU kernels may round an ulp apart on other
    # layouts)
    for got, want in zip(after(*args), per_request(*args), strict=True):
        assert got.shape == want.shape and rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("B,T", [(2, 1), (2, 3)])
def test_a_flat_output_norm_runs_on_tokens(B, T):
    args = _args(B, T)
    before, after, n = rewrite(token_view, flat_out, *args)
    assert n > 0
    assert_same(after(*args), before(*args))
    assert _flat_ranks(after, {aten.rsqrt.default, aten.mean.dim}) == [4, 4]
    mm = next(x for x in after.graph.nodes if x.target is aten.mm.default)
    assert tuple(mm.args[0].args[0].meta["val"].shape) == (B, T, H, D)  # o viewed [N, W] once


def test_bf16_tokens_cast_on_the_way():
    for T in (1, 3):
        args = _args(2, T, torch.bfloat16)
        before, after, n = rewrite(token_view, flat_front, *args)
        assert n > 0
        _same(after, before, args, T)


def _stays(fn, args):
    before, after, n = rewrite(token_view, fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), before(*args))


def test_rows_that_are_not_tokens_stay():
    def mixed(window, taps, graw, b, *_):  # [N, W] viewed [B, T*W]: rows mixed with columns
        _conv(window, taps)
        return torch.sigmoid(graw).view(window.shape[0], -1)

    _stays(mixed, _args(2, 3))


def test_an_op_over_the_tokens_stays():
    def over_tokens(window, taps, graw, b, *_):  # a cumulative sum over the flat tokens
        _conv(window, taps)
        return torch.sigmoid(graw).cumsum(0).view(2, 3, H, D)

    _stays(over_tokens, _args(2, 3))


def test_a_row_read_flat_elsewhere_stays():
    def escapes(window, taps, graw, b, *_):  # β also returned as rows
        _conv(window, taps)
        beta = torch.sigmoid(b)
        return beta.view(2, 3, H), beta

    _stays(escapes, _args(2, 3))


def test_an_unbind_over_the_heads_stays():
    def heads(window, taps, graw, b, *_):  # [N, 3, H, d] unbound on H: no q|k|v cut
        c = _conv(window, taps).transpose(1, 2).reshape(6, 3, H, D)
        return [t.reshape(2, 3, 3, D) for t in c.unbind(2)]

    _stays(heads, _args(2, 3))


def test_no_short_conv_no_scope():
    def no_conv(window, taps, graw, b, *_):  # the same flat β, in a graph with no KDA conv
        return torch.sigmoid(b).view(2, 3, H)

    _stays(no_conv, _args(2, 3))


def test_a_merge_of_heads_stays():
    def heads(window, taps, graw, b, *_):  # [B, H, d] rows of heads (spell5's [B*H] state)
        c = _conv(window, taps)  # [B, 3W, T]: the tokens are (2, 1)
        rows = graw.view(2, H, D).reshape(2 * H, D)
        return c, torch.sigmoid(rows * 2.0).view(2, H, D)

    _stays(heads, _args(2, 1))


def bf16_projections(window, taps, graw, b, dt_bias, gate, w_norm, w_b):
    """spell7 in bf16: the decay's and the gate's GEMM outputs upcast on the flat rows and viewed
    [B, T, W] after the cast; β the sigmoid of its projection's upcast, viewed [B, T, H] last"""
    B, T = window.shape[0], window.shape[-1] - TAPS + 1
    c = _conv(window, taps)
    wb = w_b.to(b.dtype)
    g = F.linear(graw, torch.eye(W, dtype=graw.dtype)).float().view(B, T, W)
    beta = torch.sigmoid(F.linear(b, wb).float()).view(B, T, H)
    return c, g, beta


@pytest.mark.parametrize("T", [1, 3])
def test_bf16_projection_upcasts_view_first(T):
    """the views move above the upcasts to the GEMMs (the form kda_decode reads: `graw.float()`,
    `sigmoid(b.float())` of [B, T, ...] projections), bit for bit"""
    args = _args(2, T, torch.bfloat16)
    args[3] = args[3].bfloat16()
    before, after, n = rewrite(token_view, bf16_projections, *args)
    assert n > 0
    assert_same(after(*args), before(*args))
    gemms = [x for x in after.graph.nodes if x.target is aten.mm.default]
    assert len(gemms) == 2
    for mm in gemms:  # each GEMM's output viewed [B, T, ...], then upcast
        (view,) = mm.users
        assert view.target is aten.view.default
        assert tuple(view.meta["val"].shape[:2]) == (2, T)
        assert [u.target for u in view.users] == [torch.ops.prims.convert_element_type.default]


def test_an_upcast_read_flat_elsewhere_stays():
    def escapes(window, taps, graw, b, *_):  # the upcast also returned as rows
        c = _conv(window, taps)
        up = F.linear(graw, torch.eye(W, dtype=graw.dtype)).float()
        return c, up.view(2, 3, W), up

    _stays(escapes, _args(2, 3, torch.bfloat16))


def test_an_upcast_of_no_projection_stays():
    def computed(window, taps, graw, b, *_):  # β of a pointwise value's upcast, not a GEMM's
        c = _conv(window, taps)
        return c, torch.sigmoid((b.bfloat16() * 2.0).float()).view(2, 3, H)

    _stays(computed, _args(2, 3, torch.bfloat16))



class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, o):
        return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class _Conv(torch.nn.Module):
    def forward(self, window, taps):
        B, T = window.shape[0], window.shape[-1] - TAPS + 1
        o = _conv(window, taps).transpose(1, 2)[..., :W].reshape(B, T, H, D)
        return torch.stack([o[:, t] * 2.0 for t in range(T)], dim=1).reshape(B * T, H, D)


class _Attention(torch.nn.Module):
    """spell10's output: the gated head norm a submodule (`o_norm`) of the module running the
    conv, on the flat [N, H, d] rows; `sibling`: the conv in a submodule of its own, the norm
    beside it (no module of a conv encloses the norm)"""

    def __init__(self, sibling: bool):
        super().__init__()
        self.o_norm = _Norm()
        self.conv = _Conv() if sibling else None

    def forward(self, window, taps, gate, w_o):
        o = self.conv(window, taps) if self.conv else _Conv.forward(self, window, taps)
        o = self.o_norm(o) * torch.sigmoid(gate.reshape(o.shape))
        return F.linear(o.reshape(o.shape[0], W), w_o)


def _attention(sibling: bool):
    from tests.canonical.compiled import canonicalize

    model = _Attention(sibling)
    args = _args(2, 3)
    inputs = {"window": args[0], "taps": args[1], "gate": args[5], "w_o": torch.randn(3, W)}
    return canonicalize(model, inputs, module=model)


def test_a_norm_submodule_of_the_conv_module_is_in_scope():
    """the o_norm's ops carry the submodule's name; the conv's module encloses it (spell10)"""
    from tests.canonical.compiled import assert_same_values

    c = _attention(sibling=False)
    assert c.counts.get("token_view", 0) > 0
    assert _flat_ranks(c.after, {aten.rsqrt.default, aten.mean.dim}) == [4, 4]
    assert_same_values(c, rel=1e-6)


def test_a_norm_module_beside_the_conv_module_stays():
    from tests.canonical.compiled import assert_same_values

    c = _attention(sibling=True)
    assert _flat_ranks(c.after, {aten.rsqrt.default, aten.mean.dim}) == [3, 3]
    assert_same_values(c, rel=1e-6)


@pytest.mark.slow
def test_spell10_kda_fuses_with_its_flat_output_norm():
    """spell10 with its gated head norm (an `o_norm` module) on [N, H, d] and its other KDA
    idioms on the fused spellings"""
    from tests.canonical.spell10_kda import assert_kda_fuses_with_only

    assert_kda_fuses_with_only("kda_o_rows")
