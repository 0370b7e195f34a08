"""l2_norm: x / sqrt(sum(x*x, -1) + eps) in its spellings becomes math.l2norm's
x * rsqrt(x.pow(2).sum(-1) + eps) (fp32, to rounding); other normalisations stay."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import l2_norm
from k3compile.math import l2norm
from tests.canonical.rule_checks import rewrite
from tests.conftest import rel_err
from tests.fusions.pattern_checks import graph, targets

_rewrite = functools.partial(rewrite, l2_norm, joint=True)


SPELLINGS = {
    "mul": lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) * 0.25,
    "pow": lambda x: x / torch.sqrt(x.pow(2).sum(dim=-1, keepdim=True) + 1e-6),
    "square": lambda x: x / (torch.square(x).sum(-1, keepdim=True) + 1e-6).sqrt(),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spellings_become_the_canonical_l2norm(name):
    x = torch.randn(2, 1, 2, 32)
    before, after, n = _rewrite(SPELLINGS[name], x)
    assert n == 1
    assert "aten.sqrt.default" not in targets(after) and "aten.rsqrt.default" in targets(after)
    canonical = graph(lambda x: l2norm(x, 1e-6), x, joint=True)
    assert set(targets(canonical)) <= set(targets(after))
    got, want = after(x), before(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 1e-6


LOOK_ALIKES = {
    "F.normalize (eps outside the root)": lambda x: F.normalize(x, dim=-1, eps=1e-6),
    "eps after the root": lambda x: x / (torch.sqrt((x * x).sum(-1, keepdim=True)) + 1e-6),
    "another dim": lambda x: x / torch.sqrt((x * x).sum(1, keepdim=True) + 1e-6),
    "another tensor squared": lambda x: x / torch.sqrt(((x + 1) * (x + 1)).sum(-1, True) + 1e-6),
    "bf16": None,
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alikes_stay(name):
    fn, x = LOOK_ALIKES[name], torch.randn(2, 1, 2, 32)
    if fn is None:
        fn, x = SPELLINGS["mul"], x.bfloat16()
    before, after, n = _rewrite(fn, x)
    assert n == 0
    assert targets(after) == targets(before)
