"""SiTU-GLU kernel and `situ_gate_up`'s CUDA path (GEMM over [W_g; W_u] + the kernel)
against the torch reference, at the TP16 shared-expert width for every bucket, plus odd widths;
with K3_GEMV_FUSED on (`settings.KERNELS.gemv_fused`) the op at one row is gemv's SiTU-epilogue variant, equal to
the two launches (tests/kernels/test_gemv.py tests the variant itself)."""

import logging

import pytest
import torch
from k3compile.kernels import situ_gate_up as kernel
from k3compile.kernels.common import gemv

from k3compile import settings
from k3compile.math import situ as situ_ref
from k3compile.ops.situ_gate_up import situ_gate_up_ref
from tests.kernel_checks import BUCKETS, TOL, assert_written, poisoned, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

SHARED, HIDDEN, BETA, LINEAR_BETA = 384, 7168, 4.0, 25.0


def model(gate_up, beta, linear_beta):
    g, u = gate_up.double().split(gate_up.shape[-1] // 2, dim=-1)
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (act * linear_beta * torch.tanh(u / linear_beta)).bfloat16()


def check(gate_up):
    n, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = poisoned(n, width)
    assert kernel.situ_cuda(gate_up, BETA, LINEAR_BETA, out=out) is out, "fallback ran"
    assert_written(out)
    torch.testing.assert_close(out.float(), model(gate_up, BETA, LINEAR_BETA).float(),
                               **TOL["bf16"])
    g, u = gate_up.split(width, dim=-1)
    assert rel_err(out, situ_ref(g, u, BETA, LINEAR_BETA)) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("n", BUCKETS)
def test_shared_expert_width(gen, n):
    check((torch.randn(n, 2 * SHARED, generator=gen, device="cuda") * 6).bfloat16())


@pytest.mark.parametrize("width", [8, 1000, 4096])
def test_other_widths(gen, width):
    for n in (1, 37):
        check((torch.randn(n, 2 * width, generator=gen, device="cuda") * 6).bfloat16())


@pytest.mark.parametrize("n", [1, 8])  # 1: the skinny GEMM, 8: cuBLAS
def test_situ_gate_up_op(gen, n):
    x = torch.randn(n, HIDDEN, generator=gen, device="cuda").bfloat16()
    wg, wu = (torch.randn(SHARED, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5
              ).bfloat16(), (torch.randn(SHARED, HIDDEN, generator=gen, device="cuda")
                             * HIDDEN**-0.5).bfloat16()
    got = torch.ops.k3.situ_gate_up(x, wg, wu, BETA, LINEAR_BETA)
    assert rel_err(got, situ_gate_up_ref(x, wg, wu, BETA, LINEAR_BETA)) < TOL["bf16_rel_norm"]


def test_refused_input_falls_back(gen, caplog):
    gate_up = torch.randn(4, 2 * 12, generator=gen, device="cuda").bfloat16()  # 12 % 8 != 0
    assert not kernel.can_implement(gate_up)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        y = kernel.situ_cuda(gate_up, BETA, LINEAR_BETA)
    g, u = gate_up.split(12, dim=-1)
    assert torch.equal(y, situ_ref(g, u, BETA, LINEAR_BETA))


@pytest.mark.parametrize("n", BUCKETS)
@pytest.mark.parametrize("width", [SHARED, 2112])  # shared experts, dense layer 0 (per rank)
def test_situ_gate_up_fused(gen, monkeypatch, n, width):
    x = torch.randn(n, HIDDEN, generator=gen, device="cuda").bfloat16()
    wg, wu = ((torch.randn(width, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5)
              .bfloat16() for _ in range(2))
    calls, real = [], gemv.gemv_situ_cuda
    monkeypatch.setattr(gemv, "gemv_situ_cuda", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = {}
    for flag in (False, True):
        monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset({"situ"} if flag else ()))
        got[flag] = torch.ops.k3.situ_gate_up(x, wg, wu, BETA, LINEAR_BETA)
    assert len(calls) == (n <= gemv.GEMV_MAX_M), "the one-launch variant at gemv's rows only"
    assert_written(got[True])
    for want in (got[False], situ_gate_up_ref(x, wg, wu, BETA, LINEAR_BETA)):
        torch.testing.assert_close(got[True].float(), want.float(), **TOL["bf16"])
        assert rel_err(got[True], want) < TOL["bf16_rel_norm"]
