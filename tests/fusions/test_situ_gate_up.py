"""situ_gate_up: the gate and up GEMMs of a SiTU-GLU MLP with the SiTU epilogue (shared experts on
[N, D], the dense layer-0 MLP on [B, T, D])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import situ_gate_up

from k3compile.math import situ
from k3compile.ops.situ_gate_up import gate_up_weight

from .pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite


def _inputs(lead=(3,), d=64, inter=32, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*lead, d, generator=g).to(dtype),
            (torch.randn(inter, d, generator=g) / d**0.5).to(dtype),
            (torch.randn(inter, d, generator=g) / d**0.5).to(dtype)]


def mlp_gate_up(x, wg, wu):  # SiTUMLP.forward before its down GEMM
    return situ(F.linear(x, wg), F.linear(x, wu), 4.0, 25.0)


@pytest.mark.parametrize("lead,dtype", [((3,), torch.bfloat16), ((2, 4), torch.bfloat16),
                                        ((3,), torch.float32), ((1, 1), torch.float32)])
def test_rewrites(lead, dtype):
    args = _inputs(lead, dtype=dtype)
    gm, report = rewrite(mlp_gate_up, args, situ_gate_up.patterns())
    assert_rewritten_equal(gm, report, mlp_gate_up, args, "k3.situ_gate_up")


def test_reference_reads_weights_at_every_call():
    x, wg, wu = _inputs()
    want = situ(F.linear(x, wg), F.linear(x, wu), 4.0, 25.0)
    torch.testing.assert_close(torch.ops.k3.situ_gate_up(x, wg, wu, 4.0, 25.0), want, rtol=0, atol=0)
    wg.data.copy_(torch.randn_like(wg))  # no version bump: a cached [W_g; W_u] would be stale
    want = situ(F.linear(x, wg), F.linear(x, wu), 4.0, 25.0)
    torch.testing.assert_close(torch.ops.k3.situ_gate_up(x, wg, wu, 4.0, 25.0), want, rtol=0, atol=0)


def test_escaping_gate_is_a_near_miss():
    def escaped(x, wg, wu):
        gate = F.linear(x, wg)  # also returned: escapes the fusion
        return situ(gate, F.linear(x, wu), 4.0, 25.0), gate

    _, report = rewrite(escaped, _inputs(), situ_gate_up.patterns())
    assert_near_miss(report, "situ_gate_up", "user")


def test_check_refuses_unaligned_intermediate():
    _, report = rewrite(mlp_gate_up, _inputs(inter=36), situ_gate_up.patterns())
    assert_near_miss(report, "situ_gate_up", "check refused", "multiples of 8")
