"""rms_forms: an fp32 RMS normalisation over the last dim in its algebraic spellings (vLLM-style
x·sqrt(d) / sqrt(Σx² + d·eps), x / sqrt(mean + eps), Σ / d, ...) becomes math.rms_norm's
x * rsqrt(mean(x², -1, keepdim) + eps) (to a few fp32 ulps, eps included); look-alikes stay."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import rms_forms
from k3compile.math import rms_norm
from tests.canonical.rule_checks import rewrite
from tests.conftest import rel_err
from tests.fusions.pattern_checks import graph, targets

_rewrite = functools.partial(rewrite, rms_forms, joint=True)
D, EPS = 48, 1e-5


def _rows():
    x = torch.randn(2, 1, 3, D, generator=torch.Generator().manual_seed(0))
    x[0, 0, 0] *= 1e-3  # a small row: eps matters
    return x


SPELLINGS = {
    # tests/models/redteam_k3.py's GatedMLA._norm (vLLM-like)
    "sqrt_d_over_root_sum": lambda x: x * math.sqrt(x.shape[-1]) / torch.sqrt(
        x.square().sum(-1, keepdim=True) + x.shape[-1] * EPS),
    "div_root_mean": lambda x: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS),
    "rsqrt_sum_div_d": lambda x: x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) / D + EPS),
    "rsqrt_sum_times_inv_d": lambda x: torch.rsqrt(x.pow(2).sum(-1, True) * (1 / D) + EPS) * x,
    "factor_outside": lambda x: x / torch.sqrt(x.pow(2).sum(-1, True) + D * EPS) * D ** 0.5,
    "factor_first": lambda x: D ** 0.5 * x / (x.pow(2).sum(-1, True) + D * EPS).sqrt(),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spellings_become_the_canonical_rms_norm(name):
    x = _rows()
    before, after, n = _rewrite(SPELLINGS[name], x)
    assert n == 1
    assert "aten.sqrt.default" not in targets(after) and "aten.sum.dim_IntList" not in targets(
        after)
    canonical = graph(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS), x,
                      joint=True)
    assert sorted(targets(canonical)) == sorted(targets(after))
    (add,) = [n for n in after.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert torch.tensor(add.args[1], dtype=torch.float32) == torch.tensor(EPS)  # eps, fp32
    got, want = after(x), before(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 1e-6  # a few fp32 ulps
    ulps = ((got - want).abs() / torch.finfo(torch.float32).eps / want.abs().clamp_min(1e-30))
    assert ulps.max() <= 4, ulps.max()


def test_the_norm_then_matches_math_rms_norm():
    """Cast back to bf16 and times the weight after, as the red-team MLA norm: the same
    function as math.rms_norm on the bf16 row, bit for bit on these rows."""
    x, w = _rows().bfloat16(), (1 + 0.1 * torch.randn(D)).bfloat16()

    def red(x, w):
        return SPELLINGS["sqrt_d_over_root_sum"](x.float()).to(x.dtype) * w

    before, after, n = _rewrite(red, x, w)
    assert n == 1
    torch.testing.assert_close(after(x, w), rms_norm(x, w, EPS), rtol=0, atol=0)
    torch.testing.assert_close(before(x, w), rms_norm(x, w, EPS), rtol=0, atol=0)


LOOK_ALIKES = {
    "canonical already": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS),
    "l2 norm (no sqrt(d))": lambda x: x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + EPS),
    "another factor": lambda x: x * 7.0 / torch.sqrt(x.pow(2).sum(-1, True) + D * EPS),
    "eps outside the root": lambda x: x * math.sqrt(D) / (
        torch.sqrt(x.pow(2).sum(-1, keepdim=True)) + EPS),
    "norm (eps added after)": lambda x: x / (x.norm(dim=-1, keepdim=True) + EPS) * math.sqrt(D),
    "F.normalize": lambda x: F.normalize(x, dim=-1) * math.sqrt(D),
    "another dim": lambda x: x / torch.sqrt(x.pow(2).mean(2, keepdim=True) + EPS),
    "not kept": lambda x: x / torch.sqrt(x.pow(2).mean(-1) + EPS)[..., None],
    "another tensor squared": lambda x: x / torch.sqrt((x + 1).pow(2).mean(-1, True) + EPS),
    "bf16": None,
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alikes_stay(name):
    fn, x = LOOK_ALIKES[name], _rows()
    if fn is None:
        fn, x = SPELLINGS["sqrt_d_over_root_sum"], x.bfloat16()
    before, after, n = _rewrite(fn, x)
    assert n == 0
    assert targets(after) == targets(before)
