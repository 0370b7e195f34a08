"""logsigmoid_exp: exp(logsigmoid(x)) (spell10's KDA β `F.logsigmoid(b).exp()`) becomes
aten.sigmoid in fp32 / fp64, a few ulp from the written form; a logsigmoid not followed by exp,
exp(-logsigmoid(x)), forms read in their middle and half precision stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import logsigmoid_exp
from tests.canonical.rule_checks import rewrite, targets
from tests.canonical.spell10_kda import assert_kda_fuses_with_only
from tests.conftest import rel_err

SIGMOID = "aten.sigmoid.default"
ULP32 = 2.0**-23


def _x(dtype=torch.float32):
    return (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 6).to(dtype)


def _read_inside(x):
    ls = F.logsigmoid(x)
    return ls.exp(), ls * 2


SPELLED = {
    "method": lambda x: F.logsigmoid(x).exp(),  # spell10
    "function": lambda x: torch.exp(torch.nn.LogSigmoid()(x * 2)),
}
LOOKALIKES = {
    "log_space": lambda x: F.logsigmoid(x) * 2,
    "negated": lambda x: torch.exp(-F.logsigmoid(x)),
    "read_inside": _read_inside,
    "softplus": lambda x: torch.exp(F.softplus(x)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(SPELLED))
def test_exp_of_logsigmoid_is_sigmoid(name, dtype):
    x = _x(dtype)
    before, after, n = rewrite(logsigmoid_exp.RULE, SPELLED[name], x, joint=True)
    assert n == 1
    assert SIGMOID in targets(after) and "aten.log1p.default" not in targets(after)
    got, want = after(x), before(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= (8 * ULP32 if dtype == torch.float32 else 1e-14)


def test_ulp_distance_in_fp32():
    """the op's one rounding against the written form's four (exp, log1p, sub, exp): within 8
    ulp of the value, elementwise, over [-30, 30] (measured: at most 5.0 ulp, 5.9e-7)"""
    x = torch.linspace(-30, 30, 200_001)
    written, op = F.logsigmoid(x).exp(), torch.sigmoid(x)
    ulps = ((written - op).abs() / (op.abs() * ULP32)).max()
    assert ulps <= 8, ulps


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_stay(name):
    x = _x()
    before, after, n = rewrite(logsigmoid_exp.RULE, LOOKALIKES[name], x, joint=True)
    assert n == 0 and targets(after) == targets(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays(dtype):
    x = _x(dtype)
    _, after, n = rewrite(logsigmoid_exp.RULE, SPELLED["method"], x, joint=True)
    assert n == 0 and SIGMOID not in targets(after)


@pytest.mark.slow
def test_spell10_kda_fuses_with_its_beta():
    """spell10 with β as `logsigmoid(b).exp()` and its other KDA idioms on the fused spellings"""
    assert_kda_fuses_with_only("beta_sigmoid")
