"""sigmoid: the logistic function written out, 1 / (1 + exp(-x)) (the red-team spelling's KDA
decay `exp(bound / (1 + exp(-z)))`), becomes aten.sigmoid in fp32 / fp64, a few ulp from the
written-out ops; the same ops in bf16, σ(-x) (no negation), other constants, SiLU's x / (1 +
exp(-x)) and forms read in their middle stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import sigmoid
from tests.canonical.rule_checks import rewrite, targets
from tests.conftest import rel_err

SIGMOID = "aten.sigmoid.default"
ULP32 = 2.0**-23


def _x(dtype=torch.float32, seed=0):
    return (torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype)


def _read_inside(e):
    return 1 / (1 + e), e * 2


SPELLED = {
    "reciprocal": lambda x: 1 / (1 + torch.exp(-x)),
    "one_after": lambda x: 1.0 / (torch.exp(-x) + 1.0),
    "decay": lambda x: torch.exp(-5.0 / (1.0 + torch.exp(-x))),  # redteam_k3.KDA
    "reciprocal_op": lambda x: torch.reciprocal(torch.exp(x.neg()) + 1),
}
LOOKALIKES = {
    "no_negation": lambda x: 1 / (1 + torch.exp(x)),  # σ(-x)
    "two": lambda x: 1 / (2 + torch.exp(-x)),
    "silu": lambda x: x / (1 + torch.exp(-x)),
    "numerator_exp": lambda x: torch.exp(-x) / (1 + torch.exp(-x)),
    "read_inside": lambda x: _read_inside(torch.exp(-x)),
    "alpha": lambda x: 1 / torch.add(1, torch.exp(-x), alpha=2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(SPELLED))
def test_written_out_sigmoid_is_the_op(name, dtype):
    x = _x(dtype)
    before, after, n = rewrite(sigmoid.RULE, SPELLED[name], x, joint=True)
    assert n == 1
    assert SIGMOID in targets(after) and "aten.reciprocal.default" not in targets(after)
    got, want = after(x), before(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= (8 * ULP32 if dtype == torch.float32 else 1e-14)


def test_ulp_distance_in_fp32():
    """The rewrite's one rounding against the written-out form's (exp, add, reciprocal): within
    4 ulp of the value, elementwise, over a wide range (measured: at most 2)."""
    x = torch.linspace(-30, 30, 200_001)
    written, op = 1 / (1 + torch.exp(-x)), torch.sigmoid(x)
    ulps = ((written - op).abs() / (op.abs() * ULP32)).max()
    assert ulps <= 4, ulps


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_stay(name):
    x = _x()
    before, after, n = rewrite(sigmoid.RULE, LOOKALIKES[name], x, joint=True)
    assert n == 0 and targets(after) == targets(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays(dtype):
    """each op of the written-out form rounds to 8 / 11 bits, sigmoid once: other values"""
    x = _x(dtype)
    _, after, n = rewrite(sigmoid.RULE, SPELLED["reciprocal"], x, joint=True)
    assert n == 0 and SIGMOID not in targets(after)
