"""situ_forms: SiTU's product in another order or with reciprocal multiplies (spell6's
`situ`, hand-written orders) becomes `k3compile.math.situ`'s canonical form, within a few ulp in
fp32, and then fuses into `k3.situ_gate_up`; other scalars, a sigmoid of another tensor, an extra
leaf, a factor read outside, half-precision products stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import situ_forms
from k3compile.math import situ
from tests.canonical.rule_checks import rewrite, targets
from tests.conftest import rel_err
from tests.models import spell6_k3

ULP32 = 2.0**-23
B1, B2 = 4.0, 25.0


def _gu(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 64, generator=gen) * 6).to(dtype) for _ in range(2)]


def _canonical(g, u):
    return situ(g, u, B1, B2)


SPELLED = {
    "spell6": lambda g, u: spell6_k3.situ(g, u, B1, B2),
    "reciprocal_canonical_order": lambda g, u: (
        B1 * torch.tanh(g * (1 / B1)) * torch.sigmoid(g) * (B2 * torch.tanh(u * (1 / B2)))),
    "divided_sigmoid_first": lambda g, u: (
        torch.sigmoid(g) * (B1 * torch.tanh(g / B1)) * (torch.tanh(u / B2) * B2)),
    "flat_product": lambda g, u: (
        torch.tanh(u / B2) * torch.sigmoid(g) * B2 * torch.tanh(g / B1) * B1),
    # a SiTU times something else: the SiTU subtree is taken, the factor stays
    "times_a_weight": lambda g, u: (
        torch.sigmoid(g) * torch.tanh(g / B1) * B1 * (torch.tanh(u / B2) * B2) * 0.5),
}


def _read_outside(g, u):
    t = torch.tanh(g / B1)
    return B1 * t * torch.sigmoid(g) * (B2 * torch.tanh(u / B2)), t * 2


LOOKALIKES = {
    "other_scalar": lambda g, u: (
        5.0 * torch.tanh(g / B1) * torch.sigmoid(g) * (B2 * torch.tanh(u / B2))),
    "sigmoid_of_another": lambda g, u: (
        torch.sigmoid(2 * g) * torch.tanh(g / B1) * B1 * (torch.tanh(u / B2) * B2)),
    "not_a_reciprocal": lambda g, u: (
        torch.sigmoid(g) * torch.tanh(g * 0.3) * B1 * (torch.tanh(u / B2) * B2)),
    "extra_leaf": lambda g, u: (
        torch.sigmoid(g) * u * torch.tanh(g / B1) * B1 * (torch.tanh(u / B2) * B2)),
    "read_outside": _read_outside,
}


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_spelled_situ_is_the_canonical_form(name):
    g, u = _gu()
    before, after, n = rewrite(situ_forms.RULE, SPELLED[name], g, u, joint=True)
    canonical, _, _ = rewrite(situ_forms.RULE, _canonical, g, u, joint=True)  # no site
    assert n == 1
    if name != "times_a_weight":
        assert targets(after) == targets(canonical)  # the form the pattern searches for
    got, want = after(g, u), before(g, u)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 8 * ULP32
    scale = 0.5 if name == "times_a_weight" else 1.0
    assert rel_err(got, _canonical(g, u) * scale) <= 8 * ULP32


def test_canonical_form_is_no_site():
    g, u = _gu()
    before, after, n = rewrite(situ_forms.RULE, _canonical, g, u, joint=True)
    assert n == 0 and targets(after) == targets(before)


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_stay(name):
    g, u = _gu()
    before, after, n = rewrite(situ_forms.RULE, LOOKALIKES[name], g, u, joint=True)
    assert n == 0 and targets(after) == targets(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_products_stay(dtype):
    """each product rounds to 8 / 11 bits, in its own order: other values"""
    g, u = _gu(dtype)
    _, _, n = rewrite(situ_forms.RULE, SPELLED["divided_sigmoid_first"], g, u, joint=True)
    assert n == 0


def _gate_up(x, wg, wu):
    return spell6_k3.situ(F.linear(x, wg), F.linear(x, wu), B1, B2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuses_into_situ_gate_up_under_the_backend(dtype):
    """spell6's SiTU on two GEMMs (the SiTU in fp32, bf16 in and out) becomes k3.situ_gate_up."""
    import k3compile.backend as k3be

    gen = torch.Generator().manual_seed(1)
    x, wg, wu = (torch.randn(*s, generator=gen).to(dtype) for s in ((2, 64), (32, 64), (32, 64)))
    torch._dynamo.reset()
    step = torch.compile(_gate_up, backend="k3", fullgraph=True, options={"executor": "aten"})
    got, want = step(x, wg, wu), _gate_up(x, wg, wu)
    (graph,) = k3be.last_compiled().observer.graphs.values()
    assert "k3.situ_gate_up.default" in targets(torch.fx.GraphModule({}, graph))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= (8 * ULP32 if dtype == torch.float32 else 1e-2)
