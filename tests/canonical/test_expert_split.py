"""Rule `expert_split`: one FC1 over concatenated w13 experts (vLLM's layout), split after the GEMM,
becomes one FC1 per piece over row slices of packed and scale, op for op the form
`math.mxfp4_experts` has with w1 / w3 slices of w13, equal to the original (fp32 to the GEMM's
summation order); look-alikes stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import expert_split as rule
from k3compile.math import e2m1_table
from k3compile.math import mxfp4_dequant as dequant

from .rule_checks import targets, trace

E, INTER, LATENT = 5, 64, 96
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def _inputs(rows, dtype):
    return [torch.randn(rows, LATENT).to(dtype),
            torch.randint(0, 255, (E, 2 * INTER, LATENT // 2), dtype=torch.uint8),
            torch.randint(120, 130, (E, 2 * INTER, LATENT // 32), dtype=torch.uint8),
            torch.randint(0, E, (rows, 2)), e2m1_table(dtype=dtype)]


def _fc1(z, p, s, ids, lut):
    return torch.einsum("nl,nkil->nki", z, dequant(p[ids], s[ids], lut))


def _canonical(z, p, s, ids, lut):
    return (_fc1(z, p[:, :INTER], s[:, :INTER], ids, lut),
            _fc1(z, p[:, INTER:], s[:, INTER:], ids, lut))


def _halves(h):
    return h[..., :INTER], h[..., INTER:]


def _and_whole(h):
    return (*_halves(h), h)


SPELLINGS = {
    "chunk": lambda *a: _fc1(*a).chunk(2, dim=-1),
    "split": lambda *a: torch.split(_fc1(*a), INTER, dim=2),
    "slices": lambda *a: _halves(_fc1(*a)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_split_fc1_becomes_one_fc1_per_piece(spelling, rows, dtype):
    args, fn = _inputs(rows, dtype), SPELLINGS[spelling]
    gm = trace(fn, args)
    assert rule.apply(gm.graph) == 1
    gm.recompile()
    assert sorted(targets(gm)) == sorted(targets(trace(_canonical, args)))
    for got, want in zip(gm(*args), fn(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype] * want.abs().max())


LOOK_ALIKES = {
    "also_read_whole": lambda *a: _and_whole(_fc1(*a)),
    "split_over_k": lambda *a: _fc1(*a).chunk(2, dim=1),
    # a weight not gathered by the routed ids (z times a [N, k, 2I, L] input)
    "ungathered": lambda z, p, s, ids, lut: torch.einsum(
        "nl,nkil->nki", z, dequant(p[:2].expand(z.shape[0], 2, -1, -1),
                                   s[:2].expand(z.shape[0], 2, -1, -1), lut)).chunk(2, -1),
    # FC2-shaped: a per-expert x [N, k, L], not the token broadcast
    "fc2": lambda z, p, s, ids, lut: torch.einsum(
        "nkl,nkil->nki", z.unsqueeze(1).expand(-1, 2, -1) * 2,
        dequant(p[ids], s[ids], lut)).chunk(2, -1),
}


@pytest.mark.parametrize("case", sorted(LOOK_ALIKES))
def test_look_alikes_are_left_alone(case):
    args, fn = _inputs(3, torch.float32), LOOK_ALIKES[case]
    gm = trace(fn, args)
    assert rule.apply(gm.graph) == 0
    gm.recompile()
    for got, want in zip(gm(*args), fn(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
