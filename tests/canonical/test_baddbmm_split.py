"""baddbmm_split: `baddbmm(S, a, c)` (the rank-1 write of spell6's and spell7's batch-merged
delta rule) becomes `S + bmm(a, c)`, equal values; a scaled baddbmm stays."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import baddbmm_split
from tests.canonical.rule_checks import rewrite, targets
from tests.conftest import rel_err

N, V, K = 8, 16, 16

_rewrite = functools.partial(rewrite, baddbmm_split)


def _args():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in ((N, V, K), (N, V, 1), (N, 1, K))]


@pytest.mark.parametrize("inner", [1, 4])
def test_baddbmm_is_the_add_of_the_product(inner):
    S, a, c = _args()
    a, c = a.expand(N, V, inner).contiguous(), c.expand(N, inner, K).contiguous()
    before, after, n = _rewrite(torch.baddbmm, S, a, c)
    assert n == 1
    assert sorted(targets(after)) == ["aten.add.Tensor", "aten.bmm.default"]
    got, want = after(S, a, c), before(S, a, c)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 1e-6


def test_scaled_baddbmm_stays():
    args = _args()
    fn = functools.partial(torch.baddbmm, beta=0.5, alpha=2.0)
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
    torch.testing.assert_close(after(*args), before(*args), rtol=0, atol=0)
