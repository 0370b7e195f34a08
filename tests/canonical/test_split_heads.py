"""split_heads: the heads of one view cut by a `split` (spell13's q|k|v after the short conv)
become a `split` of the last dim, each piece viewed into heads, bit for bit; look-alikes stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import split_heads
from tests.models.spell13_k3 import PROBES, from_builtin
from tests.spellings import foreign

from .rule_checks import assert_same, rewrite, targets

aten = torch.ops.aten
_rewrite = functools.partial(rewrite, split_heads)
H, K = 4, 16


def spell13_qkv(x):
    """tests/models/spell13_k3.py's KDA cut of the conv output"""
    q, k, v = x.unflatten(-1, (3 * H, K)).split(H, -2)
    return q * 2, k + 1, v.sigmoid()


def listed_sizes(x):
    a, b = x.unflatten(-1, (3 * H, K)).split([H, 2 * H], -2)
    return a * 2, b + 1


@pytest.mark.parametrize("fn", [spell13_qkv, listed_sizes])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_heads_are_cut_on_the_last_dim(fn, dtype):
    x = torch.randn(1, 2, 3 * H * K).to(dtype)
    before, after, n = _rewrite(fn, x)
    assert n == 1
    cuts = [n for n in after.graph.nodes
            if n.target in (aten.split.Tensor, aten.split_with_sizes.default)]
    assert cuts and all(c.args[0].op == "placeholder" for c in cuts)
    assert_same(after(x), before(x))


def split_of_the_head_dim(x):
    a, b = x.unflatten(-1, (3 * H, K)).split(K // 2, -1)
    return a * 2, b + 1


def split_of_tokens(x):
    a, b = x.unflatten(-1, (3 * H, K)).split(1, 0)
    return a * 2, b + 1


def leading_reshaped(x):
    a, b, c = x.reshape(2, 3 * H, K).split(H, -2)
    return a * 2, b + 1, c


@pytest.mark.parametrize("fn", [split_of_the_head_dim, split_of_tokens, leading_reshaped])
def test_look_alikes_stay(fn):
    x = torch.randn(2, 1, 3 * H * K)
    before, after, n = _rewrite(fn, x)
    assert n == 0
    assert targets(after) == targets(before)


# ---- on the spelling the rule was written for (slow: compiles tests/models/spell13_k3.py) ----


@pytest.mark.slow
def test_split_heads_takes_the_stacked_conv_head_cut():
    """All probes on but KDA's head views (`heads`, `qkv_heads`, `decay_heads`): fb_kda_decode
    (0, 1) fuses with rule split_heads and is lost without it (q|k|v cut after one head view of
    the stacked conv output; the decay's add before its head view costs nothing) (fp32)."""
    probes = tuple(p for p in PROBES if p not in ("heads", "qkv_heads", "decay_heads"))
    for rules, want in (((), 1), (("split_heads",), 0)):
        got = foreign.plan_with_rules_off(from_builtin, rules, probes)
        assert got[0]["fb_kda_decode"] == got[1]["fb_kda_decode"] == want, (rules, got[0])
