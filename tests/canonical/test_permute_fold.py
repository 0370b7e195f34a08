"""permute_fold: a state read or written through a permute and its inverse (handed out
transposed and transposed back, as Moonshot's KDA layer and fla's V-first state layout do) loses
both permutes, with the same values; pairs elsewhere (einsum's lowering writes them inside the MLA
patterns' forms), pairs that do not cancel, single permutes and reads by the output stay."""

from __future__ import annotations

import torch

from k3compile.canonical import permute_fold
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 4, 5, generator=g), torch.tensor([2, 0])


def round_trip(buf, slots):  # cache hands out V-first, the kernel's stand-in takes it back
    state = buf[slots].transpose(-1, -2).transpose(-1, -2)
    return torch.index_put(buf, (slots,), (state * 0.5).transpose(2, 3).transpose(3, 2))


def as_is(buf, slots):
    return torch.index_put(buf, (slots,), buf[slots] * 0.5)


def test_transpose_round_trips_vanish():
    args = _inputs()
    before, after, n = rewrite(permute_fold, round_trip, *args)
    assert n == 2 and ops(before)["permute"] == 4 and "permute" not in ops(after)
    _, canonical, _ = rewrite(permute_fold, as_is, *args)
    assert ops(after) == ops(canonical)
    assert_same(before, after, args)
    torch.testing.assert_close(after(*args), as_is(*args), rtol=0, atol=0)


def test_a_write_through_a_view_at_batch_1_loses_its_round_trip():
    """`buf[slots] = value` at one slot views the value without its leading size-1 dim first."""
    def written(buf, slots):
        state = buf[slots] * 0.5
        return torch.index_put(buf, (slots,), state.transpose(-1, -2).transpose(-1, -2).view(
            state.shape[1:]))

    def plain(buf, slots):
        state = buf[slots] * 0.5
        return torch.index_put(buf, (slots,), state.view(state.shape[1:]))

    args = _inputs(3)[0], torch.tensor([1])
    before, after, n = rewrite(permute_fold, written, *args)
    assert n == 1 and ops(before)["permute"] == 2 and "permute" not in ops(after)
    assert_same(before, after, args)
    torch.testing.assert_close(after(*args), plain(*args), rtol=0, atol=0)


def test_pairs_away_from_state_and_pairs_that_do_not_cancel_stay():
    def fn(buf, slots):
        a = buf.transpose(-1, -2).transpose(-1, -2) * 2  # cancels, but no state read or write
        b = buf[slots].permute(1, 0, 3, 2).permute(0, 2, 3, 1)  # a state read, no identity
        return a, b

    args = _inputs(1)
    before, after, n = rewrite(permute_fold, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)


def test_single_permutes_and_output_reads_stay():
    def fn(buf, slots):
        state = buf[slots]
        return state.transpose(0, 1) * 2, state.transpose(-1, -2).transpose(-1, -2)

    args = _inputs(2)
    before, after, n = rewrite(permute_fold, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)


# ---- pointwise ops after a short conv's output permute -> before it (redteam_k3 silu_first) ----

def _conv_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(4)
    window, taps = torch.randn(2, 12, 4, generator=g), torch.randn(12, 1, 4, generator=g)
    return window.to(dtype), taps.to(dtype)


def silu_after(window, taps):
    y = torch.nn.functional.conv1d(window, taps, groups=12).transpose(1, 2)
    return torch.nn.functional.silu(y).split(4, -1)


def silu_first(window, taps):  # the canonical form (patterns/kda_decode.py)
    y = torch.nn.functional.conv1d(window, taps, groups=12)
    return torch.nn.functional.silu(y).transpose(1, 2).split(4, -1)


def cast_silu_after(window, taps):
    y = torch.nn.functional.conv1d(window, taps, groups=12).transpose(1, 2)
    return torch.nn.functional.silu(y.float()).split(4, -1)


def cast_silu_first(window, taps):
    y = torch.nn.functional.conv1d(window, taps, groups=12)
    return torch.nn.functional.silu(y.float()).transpose(1, 2).split(4, -1)


def test_silu_after_the_conv_permute_goes_before_it():
    args = _conv_inputs()
    before, after, n = rewrite(permute_fold, silu_after, *args)
    assert n == 1
    _, canonical, _ = rewrite(permute_fold, silu_first, *args)
    assert [str(n.target) for n in after.graph.nodes] == [
        str(n.target) for n in canonical.graph.nodes]
    assert_same(before, after, args)


def test_casts_move_with_it():
    args = _conv_inputs(torch.bfloat16)
    before, after, n = rewrite(permute_fold, cast_silu_after, *args)
    assert n == 1
    _, canonical, _ = rewrite(permute_fold, cast_silu_first, *args)
    assert [str(n.target) for n in after.graph.nodes] == [
        str(n.target) for n in canonical.graph.nodes]
    assert_same(before, after, args)


def test_other_permutes_and_tails_stay():
    def not_a_conv(window, taps):
        return torch.nn.functional.silu(window.transpose(1, 2))

    def gated(window, taps):  # the tail reads another tensor
        y = torch.nn.functional.conv1d(window, taps, groups=12).transpose(1, 2)
        return y * torch.sigmoid(window[..., :1].transpose(1, 2))

    def read_twice(window, taps):  # the permuted output is read by a non-pointwise op too
        y = torch.nn.functional.conv1d(window, taps, groups=12).transpose(1, 2)
        return torch.nn.functional.silu(y), y.sum(-1)

    args = _conv_inputs()
    for fn in (not_a_conv, gated, read_twice):
        before, after, n = rewrite(permute_fold, fn, *args)
        assert n == 0 and ops(after) == ops(before), fn.__name__
        assert_same(before, after, args)
