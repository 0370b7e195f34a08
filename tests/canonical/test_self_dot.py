"""self_dot: a sum of squares spelled as a self-contraction `einsum("...d,...d->...", x, x)`
(spell13's RMSNorm, l2 norm and AttnRes source norms) becomes `sum(x * x, [-1])`, to rounding;
look-alikes stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import self_dot
from tests.models.spell13_k3 import from_builtin
from tests.spellings import foreign

from .rule_checks import assert_same, rewrite, targets

aten = torch.ops.aten
_rewrite = functools.partial(rewrite, self_dot)


def dot_self(x):
    """tests/models/spell13_k3.py's dot_self"""
    return torch.einsum("...d,...d->...", x, x)


def rms(x):
    """spell13's rmsnorm: the mean square through the self-dot, unsqueezed"""
    return x * torch.rsqrt(dot_self(x)[..., None] / x.shape[-1] + 1e-5)


def named_dims(x):
    return torch.einsum("tbd,tbd->tb", x, x)


def _sums(gm):
    return [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]


@pytest.mark.parametrize("fn,lead", [(dot_self, (2,)), (dot_self, (1, 2)), (dot_self, (3, 1, 2)),
                                     (rms, (2,)), (rms, (1, 2)), (rms, (3, 1, 2)),
                                     (named_dims, (1, 2)), (named_dims, (3, 2))])
def test_the_self_contraction_becomes_a_sum_of_squares(fn, lead):
    x = torch.randn(*lead, 256) * 3
    before, after, n = _rewrite(fn, x)
    assert n == 1
    assert "aten.bmm.default" not in targets(after)
    (total,) = _sums(after)
    assert total.args[1] == [-1]
    got, want = after(x), before(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the same 256 non-negative squares summed in another order: at most 255 ulps apart
    torch.testing.assert_close(got, want, rtol=256 * 2.0 ** -24, atol=0)
    exact = fn(x.double()).float()
    slack = 256 * 2.0 ** -24 * exact.abs().max()
    assert (got - exact).abs().max() <= (want - exact).abs().max() + slack


def two_tensors(x):
    return torch.einsum("...d,...d->...", x, x.flip(-1))


def other_dim(x):
    return torch.einsum("...dk,...dk->...k", x.unflatten(-1, (16, 16)), x.unflatten(-1, (16, 16)))


def scaled(x):
    return torch.einsum("...d,...d->...", x * 2.0, x)


def outer(x):
    return torch.einsum("...d,...e->...de", x, x)


@pytest.mark.parametrize("fn", [two_tensors, other_dim, scaled, outer])
def test_look_alikes_stay(fn):
    x = torch.randn(1, 2, 256)
    before, after, n = _rewrite(fn, x)
    assert n == 0
    assert targets(after) == targets(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays(dtype):
    x = torch.randn(1, 2, 256).to(dtype)
    before, after, n = _rewrite(rms, x)
    assert n == 0
    assert_same(after(x), before(x))


def mean_square(x):
    """the division by d is `layout`'s scalar multiple, not a view: it stays"""
    return dot_self(x) / x.shape[-1]


def test_a_scaled_read_of_the_sum_keeps_its_scale():
    x = torch.randn(1, 2, 256)
    before, after, n = _rewrite(mean_square, x)
    assert n == 1
    assert "aten.div.Tensor" in targets(after)
    torch.testing.assert_close(after(x), before(x), rtol=256 * 2.0 ** -24, atol=0)


def sliced_rows(x):
    """spell13's MLA kv_a norm: the self-dot of a slice of the projection"""
    return rms(x[..., :64])


def test_a_slice_is_dotted_with_itself():
    x = torch.randn(1, 2, 80)
    before, after, n = _rewrite(sliced_rows, x)
    assert n == 1
    (total,) = _sums(after)
    assert val_shape(total.args[0]) == (1, 2, 64)
    torch.testing.assert_close(after(x), before(x), rtol=64 * 2.0 ** -24, atol=0)


def slice_and_whole(x):
    return torch.einsum("...d,...d->...", x[..., :40], x[..., 40:])


def test_two_slices_of_one_tensor_stay():
    x = torch.randn(1, 2, 80)
    before, after, n = _rewrite(slice_and_whole, x)
    assert n == 0
    assert targets(after) == targets(before)


def val_shape(node):
    return tuple(node.meta["val"].shape)


# ---- on the spelling the rule was written for (slow: compiles tests/models/spell13_k3.py) ----

@pytest.mark.slow
def test_self_dot_closes_the_norms():
    """With rule self_dot off, rms_norm (0) is lost too; with probe `flat` on, also norm_linear
    (1-3) and mla_lowrank_norm / linear_concat (2, 3), which probe `norm` (x.pow(2).mean)
    restores: the self-dot einsum was their cause (fp32)."""
    got = foreign.plan_with_rules_off(from_builtin, ("self_dot",))
    assert got[0]["rms_norm"] == 0, dict(got[0])
    flat = foreign.plan_with_rules_off(from_builtin, ("self_dot",), ("flat",))
    assert all(flat[layer]["norm_linear"] == 0 for layer in (1, 2, 3))
    assert all(flat[layer]["mla_lowrank_norm"] == 0 for layer in (2, 3))
    normed = foreign.plan_with_rules_off(from_builtin, ("self_dot",), ("flat", "norm"))
    assert all(normed[layer]["norm_linear"] == 1 for layer in (1, 2, 3))
    assert all(normed[layer]["mla_lowrank_norm"] == 1 for layer in (2, 3))
