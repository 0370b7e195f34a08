"""Rule `expert_combine`: the routed experts' weighted finalize written as an einsum / bmm / matmul
becomes `(w.unsqueeze(-1) * y).sum(1)`, op for op the form `math.mxfp4_experts` has, equal to the
original to fp32 summation order; products that are not the expert combine stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import expert_combine as rule
from k3compile.math import e2m1_table
from k3compile.math import mxfp4_dequant as dequant

from .rule_checks import targets, trace

E, INTER, LATENT, K = 5, 64, 96, 2


def _inputs(rows, dtype=torch.float32):
    """weights [N, k] fp32, act [N, k, I], FC2 experts (packed, scale), ids [N, k], table."""
    return [torch.rand(rows, K), torch.randn(rows, K, INTER).to(dtype),
            torch.randint(0, 255, (E, LATENT, INTER // 2), dtype=torch.uint8),
            torch.randint(120, 130, (E, LATENT, INTER // 32), dtype=torch.uint8),
            torch.randint(0, E, (rows, K)), e2m1_table(dtype=dtype)]


def _fc2(act, p, s, ids, lut):
    return torch.einsum("nki,nkli->nkl", act, dequant(p[ids], s[ids], lut))


def _spelled(combine):
    return lambda w, act, p, s, ids, lut: combine(w, _fc2(act, p, s, ids, lut).float())


def _canonical(w, act, p, s, ids, lut):
    return (w.unsqueeze(-1) * _fc2(act, p, s, ids, lut).float()).sum(1)


SPELLINGS = {
    "einsum": lambda w, y: torch.einsum("bk,bkl->bl", w, y),
    "bmm": lambda w, y: torch.bmm(w.unsqueeze(1), y).squeeze(1),
    "matmul": lambda w, y: (w[:, None] @ y)[:, 0],
    "y_first": lambda w, y: torch.bmm(y.transpose(1, 2), w.unsqueeze(-1)).squeeze(-1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_weighted_finalize_becomes_the_weighted_sum(spelling, rows, dtype):
    args, fn = _inputs(rows, dtype), _spelled(SPELLINGS[spelling])
    gm = trace(fn, args)
    assert rule.apply(gm.graph) == 1
    gm.recompile()
    assert sorted(targets(gm)) == sorted(targets(trace(_canonical, args)))
    got, want = gm(*args), fn(*args)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max())


def _mix(w, act, p, s, ids, lut):  # AttnRes-like: the same shapes, the sources not expert outputs
    return torch.einsum("bk,bkl->bl", w, act.float() * 2)


LOOK_ALIKES = {
    "not_expert_outputs": _mix,
    # the sum in bf16 (y not upcast): not the fp32 finalize
    "bf16_sum": lambda w, act, p, s, ids, lut: torch.einsum(
        "bk,bkl->bl", w.to(act.dtype), _fc2(act, p, s, ids, lut)),
    # N == k: the weights transposed fit the shapes but not the values
    "weights_transposed": lambda w, act, p, s, ids, lut: torch.einsum(
        "bk,bkl->bl", w.t(), _fc2(act, p, s, ids, lut).float()),
    # a sum over the latent dim, not over k
    "sum_over_latent": lambda w, act, p, s, ids, lut: torch.bmm(
        _fc2(act, p, s, ids, lut).float(), torch.ones(w.shape[0], LATENT, 1)).squeeze(-1),
}


@pytest.mark.parametrize("case", sorted(LOOK_ALIKES))
def test_look_alikes_are_left_alone(case):
    dtype = torch.bfloat16 if case == "bf16_sum" else torch.float32
    args, fn = _inputs(K, dtype), LOOK_ALIKES[case]
    gm = trace(fn, args)
    assert rule.apply(gm.graph) == 0
    gm.recompile()
    torch.testing.assert_close(gm(*args), fn(*args), rtol=0, atol=0)
