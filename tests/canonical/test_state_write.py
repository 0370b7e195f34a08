"""Rule `state_write`: whole-row writes into a state buffer, however spelled, become
`index_put(buf, [slots], x)` + the copy_ write-back; the rewritten graph computes the same
outputs and the same new state as the unrewritten one (and as eager); partial writes and the
`buf[slots].copy_(x)` user bug (a write into a copy, lost in eager) are left as they are."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.canonical import state_write

from .compiled import assert_same_values, canonicalize, targets

S, C, L = 5, 6, 4  # state buffer [slots, channels, taps]
aten = torch.ops.aten


class State(nn.Module):
    """A step that writes `write(buf, x, slots)` into its state buffer and returns x·2."""

    def __init__(self, write, shape=(S, C, L)):
        super().__init__()
        self.register_buffer("buf", torch.randn(*shape, generator=torch.Generator().manual_seed(3)))
        self.write = write

    def forward(self, x, slots):
        self.write(self.buf, x, slots)
        return x * 2


def _step(write, shape=(S, C, L), x_shape=(2, C, L), slots=None):
    """Compile and run the step once; returns (Canonicalized, state after compiled, after eager)."""
    x = torch.randn(*x_shape, generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([3, 1]) if slots is None else slots
    compiled, eager = State(write, shape), State(write, shape)
    c = canonicalize(None, {"x": x, "slots": slots}, module=compiled)
    with torch.no_grad():
        eager(x, slots)
    assert torch.equal(c.output, x * 2)
    return c, compiled.buf, eager.buf


def _canonical_write(c) -> None:
    """One index_put(buf, [slots], x) into the buffer input, written back with copy_."""
    after = targets(c.after)
    assert after.count("aten.index_put.default") == 1
    assert not {"aten.slice_scatter.default", "aten.scatter.src"} & set(after)
    put = next(n for n in c.after.graph.nodes if n.target is aten.index_put.default)
    assert put.args[0].op == "placeholder" and len(put.args[1]) == 1
    assert any(u.target is aten.copy_.default for u in put.users)


SPELLINGS = {
    "whole_trailing_slice": lambda b, x, s: b.__setitem__((s, slice(None), slice(-L, None)), x),
    "whole_slices_of_two_dims": lambda b, x, s: b.__setitem__((s, slice(-C, None), slice(0, L)), x),
    "row_scatter": lambda b, x, s: b.scatter_(0, s.view(-1, 1, 1).expand_as(x), x),
    "row_scatter_unsqueezed": lambda b, x, s: b.scatter_(0, s[:, None, None].expand(-1, C, L), x),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_whole_row_writes_become_index_put(spelling):
    c, state, eager_state = _step(SPELLINGS[spelling])
    assert c.counts["state_write"] == 1
    _canonical_write(c)
    assert_same_values(c, rel=0)
    assert torch.equal(state, eager_state)


CANONICAL = {
    "setitem": lambda b, x, s: b.__setitem__(s, x),
    "index_put_": lambda b, x, s: b.index_put_((s,), x),
    "index_copy_": lambda b, x, s: b.index_copy_(0, s, x),
}


@pytest.mark.parametrize("spelling", list(CANONICAL))
def test_canonical_spellings_are_already_index_put(spelling):
    c, state, eager_state = _step(CANONICAL[spelling])
    assert c.counts["state_write"] == 0
    _canonical_write(c)
    assert torch.equal(state, eager_state)


def test_index_copy_that_survives_becomes_index_put():
    """A graph traced without decompositions keeps index_copy (AOT decomposes it to index_put)."""

    def write(buf, slots, x):
        return buf.copy_(torch.index_copy(buf, 0, slots, x))

    args = [torch.randn(S, C, L), torch.tensor([4, 0]), torch.randn(2, C, L)]
    gm = make_fx(write, tracing_mode="fake")(*args)
    before = [str(n.target) for n in gm.graph.nodes]
    assert "aten.index_copy.default" in before
    assert state_write.apply(gm.graph) == 1
    gm.recompile()
    after = [str(n.target) for n in gm.graph.nodes]
    assert "aten.index_copy.default" not in after and "aten.index_put.default" in after
    want, got = args[0].clone(), args[0].clone()
    write(want, *args[1:])
    gm(got, *args[1:])
    assert torch.equal(got, want)


def test_whole_buffer_copy_through_a_whole_slice_drops_the_scatter():
    c, state, eager_state = _step(lambda b, x, s: b[:, :, -L:].copy_(torch.cat([x, x, x[:1]])))
    assert c.counts["state_write"] == 1
    assert "aten.slice_scatter.default" not in targets(c.after)
    assert_same_values(c, rel=0)
    assert torch.equal(state, eager_state)


# ---- writes left alone ------------------------------------------------------------------------

PARTIAL = {
    "last_taps_only": lambda b, x, s: b.__setitem__((s, slice(None), slice(-2, None)), x[..., -2:]),
    "row_range": lambda b, x, s: b[0:2].copy_(x),
    "int_row": lambda b, x, s: b[1].copy_(x[0]),
    "scatter_along_channels": lambda b, x, s: b.scatter_(1, s.view(1, -1, 1).expand(S, -1, L),
                                                         x[:1].expand(S, -1, -1)[:, :2]),
    "scatter_index_varies_in_row": lambda b, x, s: b.scatter_(
        0, torch.stack([s, s.flip(0)], -1).view(2, 1, 2).expand(-1, C, -1).repeat(1, 1, L // 2),
        x),
}


@pytest.mark.parametrize("spelling", list(PARTIAL))
def test_partial_writes_are_left_alone(spelling):
    c, state, eager_state = _step(PARTIAL[spelling])
    assert c.counts["state_write"] == 0
    assert targets(c.after) == targets(c.before)
    assert torch.equal(state, eager_state)


def test_copy_into_an_advanced_index_writes_nothing_as_in_eager():
    """`buf[slots].copy_(x)` copies into a temporary (a user bug): the state stays as it was,
    compiled as in eager, and no rule turns it into a write."""
    c, state, eager_state = _step(lambda b, x, s: b[s].copy_(x))
    before = State(lambda *a: None).buf
    assert torch.equal(eager_state, before) and torch.equal(state, before)
    assert c.counts["state_write"] == 0
    assert not {"aten.index_put.default", "aten.copy_.default"} & set(targets(c.after))


# ---- batch 1: the value as Tensor.__setitem__ hands it over -----------------------------------


def _value_of_write(c) -> fx.Node:
    (put,) = [n for n in c.after.graph.nodes if n.target is aten.index_put.default]
    return put.args[2]


@pytest.mark.parametrize("spelling", ["index_put_", "index_copy_", "row_scatter"])
def test_batch_1_writes_drop_the_leading_size_1_dim(spelling):
    """At batch 1, `buf[slots] = x` writes view(x, [C, L]); the other spellings write x [1, C, L]
    itself: they get that view, and compute the same new state."""
    write = {**CANONICAL, **SPELLINGS}[spelling]
    c, state, eager_state = _step(write, x_shape=(1, C, L), slots=torch.tensor([3]))
    assert c.counts["state_write"] >= 1
    _canonical_write(c)
    assert tuple(_value_of_write(c).meta["val"].shape) == (C, L)
    assert_same_values(c, rel=0)
    assert torch.equal(state, eager_state)


def test_batch_1_setitem_is_already_canonical():
    c, state, eager_state = _step(CANONICAL["setitem"], x_shape=(1, C, L),
                                  slots=torch.tensor([3]))
    assert c.counts["state_write"] == 0
    assert tuple(_value_of_write(c).meta["val"].shape) == (C, L)
    assert torch.equal(state, eager_state)


def test_batch_1_index_put_that_writes_no_state_is_left_alone():
    """An out-of-place index_put returned as an output (no buffer written back) keeps its value."""
    args = {"z": torch.randn(S, C, L), "x": torch.randn(1, C, L), "slots": torch.tensor([3])}
    c = canonicalize(lambda z, x, slots: z.index_put((slots,), x), args)
    assert c.counts["state_write"] == 0
    assert targets(c.after) == targets(c.before)
    assert tuple(_value_of_write(c).meta["val"].shape) == (1, C, L)
    assert torch.equal(c.output, args["z"].index_put((args["slots"],), args["x"]))
