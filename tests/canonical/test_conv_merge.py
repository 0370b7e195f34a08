"""conv_merge: per-projection depthwise short convs over slices of one conv state (fla's
`ShortConvolution` per q, k, v, as Moonshot's KDA layer runs them) become the one q|k|v conv of
the canonical form, with its tail applied once and split, and one state write of the merged
window; values equal to the unrewritten graph, dtype and shape included. Look-alikes stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.adapt.fla import short_convolution
from k3compile.canonical import conv_merge as rule

from .rule_checks import assert_same, trace

B, S, TAPS = 2, 4, 4
CONV = "aten.convolution.default"


class _Conv(torch.nn.Module):
    """What fla's stand-in reads of a ShortConvolution: weight [C, 1, taps], bias, activation."""

    def __init__(self, weight, activation="silu", bias=None):
        super().__init__()
        self.weight, self.bias, self.activation = weight, bias, activation


def _conv(x, past, w, act="silu"):
    """One projection's conv as fla's stand-in computes it: y [B, T, C], new state."""
    return short_convolution(_Conv(w, act), x, cache=past, output_final_state=True)


def _biased(xs, state, slots, ws):
    """Convs with a bias each (the channel's first tap doubles as its bias)."""
    pasts = state[slots].chunk(3, dim=1)
    outs = [short_convolution(_Conv(w, "silu", w[:, 0, 0]), x, cache=p, output_final_state=True)
            for x, p, w in zip(xs, pasts, ws)]
    new_state = torch.index_put(state, (slots,), torch.cat([s for _, s in outs], dim=1))
    return new_state, *(y for y, _ in outs)


def _chunked(xs, state, slots, ws, acts=("silu",) * 3):
    """The adapter's layout: state [S, ΣC, taps-1], pieces by chunk/split along dim 1."""
    pasts = state[slots].split([w.shape[0] for w in ws], dim=1)
    outs = [_conv(x, p, w, a) for x, p, w, a in zip(xs, pasts, ws, acts)]
    new_state = torch.index_put(state, (slots,), torch.cat([s for _, s in outs], dim=1))
    return new_state, *(y for y, _ in outs)


def _narrowed(xs, state, slots, ws):
    """Pieces by slicing `state[slots][:, a:b]`, the write by three slice assignments."""
    gathered, outs, start = state[slots], [], 0
    for x, w in zip(xs, ws):
        outs.append(_conv(x, gathered[:, start:start + w.shape[0]], w))
        start += w.shape[0]
    return torch.index_put(state, (slots,), torch.cat([s for _, s in outs], 1)), \
        *(y for y, _ in outs)


def _inputs(widths=(16, 16, 16), T=1, dtype=torch.float32, seed=0, taps=(TAPS,) * 3):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, T, c, generator=g).to(dtype) for c in widths]
    ws = [torch.randn(c, 1, t, generator=g).to(dtype) for c, t in zip(widths, taps)]
    state = torch.randn(S, sum(widths), TAPS - 1, generator=g).to(dtype)
    return xs, state, torch.tensor([3, 1]), ws


def _rewrite(fn, xs, state, slots, ws):
    args = [*xs, state, slots, *ws]
    n = len(xs)

    def flat(*a):
        return fn(list(a[:n]), a[n], a[n + 1], list(a[n + 2:]))

    before, gm = trace(flat, args), trace(flat, args)
    count = rule.apply(gm.graph)
    gm.recompile()
    return gm, count, before(*args), gm(*args)


def _convs(gm):
    return [n for n in gm.graph.nodes if str(n.target) == CONV]


CASES = {  # name: (fn, inputs kwargs)
    "chunk_fp32": (_chunked, {}),
    "chunk_bf16": (_chunked, {"dtype": torch.bfloat16}),
    "chunk_T3": (_chunked, {"T": 3}),
    "narrow_unequal_widths": (_narrowed, {"widths": (16, 16, 24)}),
    "two_projections": (_chunked, {"widths": (16, 8)}),
    "with_bias": (_biased, {}),
    "no_activation": (lambda xs, s, sl, ws: _chunked(xs, s, sl, ws, (None,) * 3), {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_projection_convs_become_one_conv(name):
    fn, kwargs = CASES[name]
    xs, state, slots, ws = _inputs(**kwargs)
    gm, count, want, got = _rewrite(fn, xs, state, slots, ws)
    assert count == 1
    (conv,) = _convs(gm)
    channels = sum(w.shape[0] for w in ws)
    assert conv.args[-1] == channels and tuple(conv.args[1].meta["val"].shape) == (channels, 1,
                                                                                      TAPS)
    # the canonical state write: index_put of the merged window's tail, no per-projection cat
    (write,) = [n for n in gm.graph.nodes if str(n.target) == "aten.index_put.default"]
    assert str(write.args[2].target) == "aten.slice.Tensor"
    assert write.args[2].args[0] is conv.args[0] or write.args[2].args[0] is conv.args[0].args[0]
    assert_same(got, want)  # each channel is convolved alone either way


def test_bf16_casts_stay_exact_upcasts_of_the_concatenation():
    xs, state, slots, ws = _inputs(dtype=torch.bfloat16)
    gm, count, want, got = _rewrite(_chunked, xs, state, slots, ws)
    (conv,) = _convs(gm)
    window, taps = conv.args[:2]
    assert count == 1 and "convert_element_type" in str(window.target) + str(taps.target)
    assert window.meta["val"].dtype == taps.meta["val"].dtype == torch.float32
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert_same(got, want)  # each channel is convolved alone either way


def _upcast_pieces(xs, state, slots, ws):
    """spell8 in bf16: each piece's conv + SiLU in bf16, transposed, then `.float()`"""
    new_state, *ys = _chunked(xs, state, slots, ws)
    return new_state, *(y.float() * 2 for y in ys)


def test_upcast_after_the_permute_stays_on_each_piece():
    """the pieces' upcasts stay after the split (where the canonical form casts q, k and v),
    not merged into one cast before it (session 26: kda_decode's bf16 variants then met a split
    of fp32 pieces)"""
    xs, state, slots, ws = _inputs(dtype=torch.bfloat16)
    gm, count, want, got = _rewrite(_upcast_pieces, xs, state, slots, ws)
    assert count == 1
    (split,) = [n for n in gm.graph.nodes if str(n.target) == "aten.split.Tensor"]
    assert split.meta["val"][0].dtype == torch.bfloat16
    assert str(split.args[0].target) == "aten.permute.default"
    pieces = [u for u in split.users]
    assert len(pieces) == 3 and all(
        "convert_element_type" in str(next(iter(p.users)).target) for p in pieces)
    assert_same(got, want)


# ---- look-alikes ---------------------------------------------------------------------------------


def _separate_buffers(xs, state, slots, ws):
    """Each conv has a state buffer of its own (three graph inputs): nothing to write the merged
    window to."""
    states = [state[:, :16].clone(), state[:, 16:32].clone(), state[:, 32:].clone()]
    outs = [_conv(x, st[slots], w) for x, st, w in zip(xs, states, ws)]
    return *(torch.index_put(st, (slots,), s) for st, (_, s) in zip(states, outs)), \
        *(y for y, _ in outs)


def _partial(xs, state, slots, ws):
    """The pieces cover only part of the state (a fourth piece is something else)."""
    pasts = state[slots].split(16, dim=1)
    outs = [_conv(x, p, w) for x, p, w in zip(xs, pasts[:3], ws)]
    return (*(y for y, _ in outs), pasts[3] * 2)


def _mixed_tails(xs, state, slots, ws):
    """v's conv has no activation: the tails differ, nothing to apply once."""
    return _chunked(xs, state, slots, ws, ("silu", "silu", None))


def _tail_read_inside(xs, state, slots, ws):
    """q's conv before its activation is read too: its tail is not closed."""
    pasts = state[slots].split(16, dim=1)
    windows = [torch.cat([p, x.transpose(1, 2)], -1) for p, x in zip(pasts, xs)]
    convs = [F.conv1d(win, w, groups=16) for win, w in zip(windows, ws)]
    new_state = torch.index_put(state, (slots,), torch.cat([w[..., 1:] for w in windows], 1))
    return new_state, *(F.silu(c).transpose(1, 2) for c in convs), convs[0]


LOOK_ALIKES = {
    "separate_buffers": (_separate_buffers, {}),
    "partial_cover": (_partial, {}),
    "mixed_tails": (_mixed_tails, {}),
    "different_taps": (_chunked, {"taps": (4, 4, 3)}),
    "tail_read_inside": (_tail_read_inside, {}),
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alikes_stay(name):
    fn, kwargs = LOOK_ALIKES[name]
    xs, state, slots, ws = _inputs(**kwargs)
    if name == "partial_cover":
        state = torch.randn(S, 64, TAPS - 1)
    gm, count, want, got = _rewrite(fn, xs, state, slots, ws)
    assert count == 0 and len(_convs(gm)) == len(xs)
    assert_same(got, want)
