"""addcmul_split: `addcmul(S, a, b)` (spell11's rank-1 state write `S.addcmul_(k[..., None],
u[..., None, :])`) becomes `S + a * b`, in fp32 within one rounding of the product (CPU's
addcmul is a fused multiply-add); a scaled addcmul and a half-precision
one (rounded once where the split rounds twice) stay. Slow: spell11 compiled with only that idiom
of its KDA blind fuses the KDA step."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import addcmul_split
from tests.canonical.rule_checks import assert_same, rewrite, targets, trace
from tests.conftest import TOL
from tests.spellings import foreign

B, H, K, V = 2, 4, 16, 8

_rewrite = functools.partial(rewrite, addcmul_split)


def _args(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in ((B, H, K, V), (B, H, K, 1),
                                                            (B, H, 1, V))]


def assert_within_one_rounding(got, want, S, a, b):
    """|got - want| <= 2^-24 (|a b| + 2 |S + a b|): the product's rounding and the sum's."""
    assert got.dtype == want.dtype and got.shape == want.shape
    exact = S.double() + a.double() * b.double()
    bound = 2.0 ** -24 * ((a.double() * b.double()).abs() + 2 * exact.abs())
    assert ((got.double() - want.double()).abs() <= bound).all()
    assert ((got.double() - exact).abs() <= bound).all()


def _rank1(S, k, u):
    return S.clone().addcmul_(k, u)


@pytest.mark.parametrize("fn", [torch.addcmul, _rank1], ids=["addcmul", "in_place"])
def test_addcmul_is_the_add_of_the_product(fn):
    """`addcmul_` on a fresh tensor as the backend sees it: functionalised, an `addcmul`."""
    args = _args()
    before, after = trace(fn, args), trace(fn, args)
    n = addcmul_split.apply(after.graph)
    after.graph.eliminate_dead_code()
    after.recompile()
    assert n == 1
    assert "aten.addcmul.default" not in targets(after)
    assert {"aten.mul.Tensor", "aten.add.Tensor"} <= set(targets(after))
    assert_within_one_rounding(after(*args), before(*args), *args)


def test_a_conv_tap_addcmul_is_split_too():
    """The short conv's last tap, `addcmul(acc [B, C], x [B, C], taps[:, -1] [C])` (broadcast)."""
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(2, 32, generator=g), torch.randn(2, 32, generator=g),
            torch.randn(32, generator=g)]
    before, after, n = _rewrite(torch.addcmul, *args)
    assert n == 1
    assert_within_one_rounding(after(*args), before(*args), *args)


def test_scaled_addcmul_stays():
    args = _args()
    before, after, n = _rewrite(functools.partial(torch.addcmul, value=0.5), *args)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), before(*args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_addcmul_stays(dtype):
    """addcmul rounds S + a * b once (fp32 inside); the split would round the product first."""
    args = _args(dtype)
    before, after, n = _rewrite(torch.addcmul, *args)
    assert n == 0
    assert "aten.addcmul.default" in targets(after)
    assert_same(after(*args), before(*args))


@pytest.mark.slow
def test_spell11_kda_fuses_with_only_its_addcmul_write():
    """spell11 with its other two KDA idioms switched (probes conv_window, state_einsum): the
    rank-1 write `S.addcmul_` alone, which fused nothing before this rule."""
    from tests.models.spell11_k3 import from_builtin

    builtin = foreign.builtin(torch.float32)
    model, eager = (from_builtin(builtin).set_probe("conv_window", "state_einsum")
                    for _ in range(2))
    assert foreign.steps(foreign.compile_k3(model), eager, n=1) <= TOL["aten_cpu"]
    got = foreign.per_layer(foreign.last_compiled())
    for layer in (0, 1):
        assert got[layer]["fb_kda_decode"] == 1 and got[layer]["linear_concat"] == 1, \
            (layer, dict(got[layer]))
