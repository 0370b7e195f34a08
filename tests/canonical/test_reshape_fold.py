"""reshape_fold: a reshape undone across elementwise ops (fla's T=1 short conv step: the conv
output as [B, C], SiLU, unsqueeze(1)) becomes the ops on the unreshaped value, with the size-1
dim moved by a permute (`F.silu(conv).to(dtype).transpose(1, 2)`, the canonical form), bit for
bit; reshapes that stay reshapes, and chains with no op between them, stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import reshape_fold
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite
from tests.fusions.pattern_checks import graph

B, C = 3, 24
RESHAPES = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze.dim", "squeeze.dims"}


def _conv_out(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, C, 1, generator=g).to(dtype),)


def canonical(conv):  # k3compile/models/k3.py's T=1 conv epilogue
    return F.silu(conv).to(torch.bfloat16).transpose(1, 2)


SPELLINGS = {  # name: (fn(conv [B, C, 1]) -> [B, 1, C] or [B, C, 1], the canonical form)
    "fla_step": (lambda y: F.silu(y.view(B, C)).to(torch.bfloat16).unsqueeze(1), canonical),
    "squeeze_written_out": (lambda y: (y.squeeze(-1) * torch.sigmoid(y.squeeze(-1))).to(
        torch.bfloat16).unsqueeze(1),
        lambda y: (y * torch.sigmoid(y)).to(torch.bfloat16).transpose(1, 2)),
    "stack_of_one": (lambda y: F.silu(torch.stack([y.view(B, C)], -1)).to(torch.bfloat16),
                     lambda y: F.silu(y).to(torch.bfloat16)),
    "scaled_back": (lambda y: (y.reshape(B * C) * 2 + 1).view(B, C, 1), lambda y: y * 2 + 1),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_becomes_the_canonical_form(name):
    fn, want_fn = SPELLINGS[name]
    args = _conv_out()
    before, after, n = rewrite(reshape_fold, fn, *args)
    assert n == 1
    assert not RESHAPES & set(ops(after))
    assert ops(after) == ops(graph(want_fn, *args))
    assert_same(before, after, args)
    torch.testing.assert_close(after(*args), want_fn(*args), rtol=0, atol=0)


def test_bf16_conv_output_keeps_its_dtype():
    fn = lambda y: F.silu(y.float().view(B, C)).to(torch.bfloat16).unsqueeze(1)
    args = _conv_out(torch.bfloat16)
    before, after, n = rewrite(reshape_fold, fn, *args)
    assert n == 1 and "permute" in ops(after)
    assert_same(before, after, args)


LOOK_ALIKES = {
    # a reshape chain with no op between (F.linear of F.linear: [R, N] -> [B, T, N] -> [R, N])
    "no_op_between": lambda y: torch.mm(y.view(B, C, 1).view(B, C), torch.ones(C, 2)),
    # back to another shape: a reshape still, no closer to a canonical form
    "other_shape": lambda y: F.silu(y.view(B, C)).reshape(C, B),
    # the reshaped value also read outside the ops (a norm's x in x * rsqrt(...))
    "read_outside": lambda y: (F.silu(y.view(B, C)).unsqueeze(-1), y.view(B, C).sum(-1)),
    # a broadcast operand from outside: the op is not on y alone
    "broadcast_operand": lambda y: (y.view(B, C) * torch.arange(C.__int__())).unsqueeze(-1),
    # an op that is not elementwise between the reshapes
    "reduction_between": lambda y: torch.softmax(y.view(B, C), -1).unsqueeze(-1),
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alike_stays(name):
    args = _conv_out(seed=1)
    before, after, n = rewrite(reshape_fold, LOOK_ALIKES[name], *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)
