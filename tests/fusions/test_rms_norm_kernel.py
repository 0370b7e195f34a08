"""k3::rms_norm kernel at the routed-latent width (3584) for every batch bucket, plus odd widths."""

import logging

import pytest
import torch
from k3compile.kernels import rms_norm as kernel

from k3compile.ops.rms_norm import rms_norm_ref
from tests.kernel_checks import BUCKETS, TOL, assert_written, poisoned, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

LATENT, EPS = 3584, 1e-5


def make_inputs(gen, n, dim=LATENT):
    x = (torch.randn(n, dim, generator=gen, device="cuda") * 4).bfloat16()
    return x, (1 + 0.2 * torch.randn(dim, generator=gen, device="cuda")).bfloat16()


def model(x, w, eps):
    xd = x.double()
    xn = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()
    return (xn.double() * w.double()).bfloat16()


def check(x, w):
    out = poisoned(*x.shape)
    assert kernel.rms_norm_cuda(x, w, EPS, out=out) is out, "the kernel did not run (fallback)"
    assert_written(out)
    torch.testing.assert_close(out.float(), model(x, w, EPS).float(), **TOL["bf16"])
    assert rel_err(out, rms_norm_ref(x, w, EPS)) < TOL["bf16_rel_norm"]


@pytest.mark.parametrize("n", BUCKETS)
def test_routed_latent(gen, n):
    check(*make_inputs(gen, n))


@pytest.mark.parametrize("dim", [256, 1024, 1032, 7168, 32768])
def test_other_widths(gen, dim):
    for n in (1, 8, 37):
        check(*make_inputs(gen, n, dim))


def test_strided_rows_and_op_dispatch(gen):
    x, w = make_inputs(gen, 8, LATENT + 64)
    x, w = x[:, 64:], w[64:]
    torch.testing.assert_close(torch.ops.k3.rms_norm(x, w, EPS).float(),
                               model(x, w, EPS).float(), **TOL["bf16"])


def test_refused_inputs_fall_back_to_the_reference(gen, caplog):
    x, w = make_inputs(gen, 4)
    x = x.float()  # fp32 activations: refused
    assert not kernel.can_implement(x, w)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        y = torch.ops.k3.rms_norm(x, w, EPS)
    assert torch.equal(y, rms_norm_ref(x, w, EPS))
    assert "rms_norm" in caplog.text
