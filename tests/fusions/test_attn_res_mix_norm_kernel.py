"""k3::attn_res_mix_norm kernel against a float64 model of its math and against the op's
reference, at the TP16-rank shape (hidden 7168, up to 9 sources) for every batch bucket; with
`scores_fp32` (Moonshot's scores, the kernel's own math) against that reference variant."""

import logging
import math

import pytest
import torch
from k3compile.kernels import attn_res_mix_norm as kernel

from k3compile.ops.attn_res_mix_norm import attn_res_mix_norm_ref
from tests.kernel_checks import BUCKETS, TOL, assert_written, no_fallback, poisoned, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

HIDDEN = 7168
EPS = 1e-5
# Element-wise against the float64 model: three bf16 roundings in a chain (h, the normalised row,
# the weighted output). Where the kernel's fp32 mix lands h on the other side of a rounding
# boundary than float64 does (1 ulp, <= 2^-7 relative), the two later roundings add up to half
# an ulp each: 2^-7 + 2 * 2^-8 relative (session 12: 1 element of 458,752 was 0.047 off at
# |x| ~ 3.5, over TOL["bf16"]'s 0.045). The norm-wise bound below stays TOL["bf16_rel_norm"].
TOL_CHAIN = {"rtol": 2**-7 + 2 * 2**-8, "atol": TOL["bf16"]["atol"]}


def make_inputs(gen, n, dim, n_blocks, has_delta, bank=True):
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    # Blocks as the model holds them: views of one bank [N, 8, D] (row stride 8·D), each slot
    # at its own scale so the per-source rms differ.
    scales = torch.linspace(0.5, 3.0, 8, device="cuda").view(1, 8, 1)
    if bank:
        store = (randn(n, 8, dim) * scales).bfloat16()
        blocks = [store[:, j] for j in range(n_blocks)]
    else:
        blocks = [(randn(n, dim) * scales[0, j]).bfloat16() for j in range(n_blocks)]
    return {
        "prefix": randn(n, dim, scale=2.0).bfloat16(),
        "delta": randn(n, dim, scale=0.5).bfloat16() if has_delta else None,
        "blocks": blocks,
        "mix_norm_weight": (1 + randn(dim, scale=0.2)).bfloat16(),
        "mix_proj_weight": randn(1, dim, scale=3 / math.sqrt(dim)).bfloat16(),  # scores ~ N(0, 9)
        "norm_weight": (1 + randn(dim, scale=0.2)).bfloat16(),
        "mix_eps": EPS, "norm_eps": EPS,
    }


def kernel_args(inputs):
    return [inputs[k] for k in ("prefix", "delta", "blocks", "mix_norm_weight", "mix_proj_weight",
                                "norm_weight")]


def mixed(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, mix_eps):
    """(prefix_out, h) of the kernel's documented math in float64, rounded to bf16."""
    p = prefix if delta is None else (prefix.float() + delta.float()).bfloat16()
    if not blocks:
        return p, p
    v = torch.stack([*blocks, p]).double()
    rstd = torch.rsqrt(v.pow(2).mean(-1) + mix_eps)
    w = mix_norm_weight.double() * mix_proj_weight.double().view(-1)
    alpha = torch.softmax((v * w).sum(-1) * rstd, dim=0)
    return p, (alpha.unsqueeze(-1) * v).sum(0).bfloat16()


def model(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight, mix_eps,
          norm_eps):
    """The kernel's documented math in float64, rounding to bf16 where the model does."""
    p, h = mixed(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, mix_eps)
    hd = h.double()
    xn = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + norm_eps)).bfloat16()
    return p, (xn.double() * norm_weight.double()).bfloat16()


def run_kernel(inputs, scores_fp32=False):
    n, dim = inputs["prefix"].shape
    out = (poisoned(n, dim), poisoned(n, dim))
    got = kernel.attn_res_mix_norm_cuda(**inputs, scores_fp32=scores_fp32, out=out)
    assert got[0] is out[0] and got[1] is out[1], "the kernel did not run (fallback)"
    assert_written(*out)
    return out


def check(inputs):
    p, x = run_kernel(inputs)
    want_p, want_x = model(**inputs)
    assert torch.equal(p, want_p), "prefix_out is not the bf16 sum"
    torch.testing.assert_close(x.float(), want_x.float(), **TOL_CHAIN)
    assert rel_err(x, want_x) < TOL["bf16_rel_norm"]
    _, ref_x = attn_res_mix_norm_ref(**inputs)
    assert rel_err(x, ref_x) < TOL["vs_reference_rel_norm"]


@pytest.mark.parametrize("n", BUCKETS)
@pytest.mark.parametrize("n_blocks", [8, 4, 1, 0])
@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "no_delta"])
def test_tp16_shapes(gen, n, n_blocks, has_delta):
    check(make_inputs(gen, n, HIDDEN, n_blocks, has_delta))


@pytest.mark.parametrize("dim,n_blocks", [(256, 8), (1024, 3), (1032, 8), (4104, 2), (5120, 8),
                                           (3104, 4)])
def test_small_and_odd_widths(gen, dim, n_blocks):
    """tiny/small configs, and widths whose vector count does not split evenly over the threads
    (predicates), with clusters of 4 and 2 CTAs per row (5120, 3104)."""
    for n in (1, 8, 37):
        check(make_inputs(gen, n, dim, n_blocks, True))


@pytest.mark.parametrize("n", [1, 8, 64])
@pytest.mark.parametrize("n_blocks", [8, 1])
@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "no_delta"])
def test_scores_fp32(gen, n, n_blocks, has_delta):
    """Moonshot's fp32 scores: the same build, now within the kernel tolerances of its reference
    variant (the default reference is up to ~6e-3 away: its bf16 score roundings), and through
    the op's dispatch too."""
    inputs = make_inputs(gen, n, HIDDEN, n_blocks, has_delta)
    p, x = run_kernel(inputs, scores_fp32=True)
    want_p, want_x = attn_res_mix_norm_ref(**inputs, scores_fp32=True)
    assert torch.equal(p, want_p)
    torch.testing.assert_close(x.float(), want_x.float(), **TOL["bf16"])
    assert rel_err(x, want_x) < TOL["bf16_rel_norm"]
    _, built_in = attn_res_mix_norm_ref(**inputs)
    assert 4 * rel_err(x, want_x) < rel_err(x, built_in)
    with no_fallback():
        p, x = torch.ops.k3.attn_res_mix_norm(**inputs, scores_fp32=True)
    assert torch.equal(p, want_p) and rel_err(x, want_x) < TOL["bf16_rel_norm"]


def test_contiguous_blocks_and_op_dispatch(gen):
    inputs = make_inputs(gen, 8, HIDDEN, 8, True, bank=False)
    p, x = torch.ops.k3.attn_res_mix_norm(**inputs)
    want_p, want_x = model(**inputs)
    assert torch.equal(p, want_p)
    torch.testing.assert_close(x.float(), want_x.float(), **TOL["bf16"])


def test_no_delta_output_is_a_copy(gen):
    inputs = make_inputs(gen, 4, HIDDEN, 2, False)
    p, _ = torch.ops.k3.attn_res_mix_norm(**inputs)
    assert torch.equal(p, inputs["prefix"]) and p.data_ptr() != inputs["prefix"].data_ptr()


def test_cuda_graph_replay(gen):
    inputs = make_inputs(gen, 8, HIDDEN, 8, True)
    torch.ops.k3.attn_res_mix_norm(**inputs)  # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p, x = torch.ops.k3.attn_res_mix_norm(**inputs)
    for _ in range(3):
        fresh = make_inputs(gen, 8, HIDDEN, 8, True)
        for key in ("prefix", "delta", "mix_norm_weight", "mix_proj_weight", "norm_weight"):
            inputs[key].copy_(fresh[key])
        for b, fb in zip(inputs["blocks"], fresh["blocks"], strict=True):
            b.copy_(fb)
        graph.replay()
        want_p, want_x = model(**inputs)
        assert torch.equal(p, want_p)
        torch.testing.assert_close(x.float(), want_x.float(), **TOL["bf16"])


def test_refused_inputs_fall_back_to_the_reference(gen, caplog):
    inputs = make_inputs(gen, 4, 100, 2, True)  # hidden not a multiple of 8
    assert not kernel.can_implement(*kernel_args(inputs))
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        p, x = torch.ops.k3.attn_res_mix_norm(**inputs)
    want_p, want_x = attn_res_mix_norm_ref(**inputs)
    assert torch.equal(p, want_p) and torch.equal(x, want_x)
    assert "attn_res_mix_norm" in caplog.text


def test_can_implement_limits(gen):
    ok = make_inputs(gen, 2, 256, 8, True)
    assert kernel.can_implement(*kernel_args(ok))
    nine_blocks = {**ok, "blocks": ok["blocks"] + ok["blocks"][:1]}
    assert not kernel.can_implement(*kernel_args(nine_blocks))
    assert not kernel.can_implement(*kernel_args({**ok, "prefix": ok["prefix"].float()}))
    assert not kernel.can_implement(*kernel_args({**ok, "prefix": ok["prefix"][:, 1:255]}))


def model_fp32_weight(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, norm_weight,
                      mix_eps, norm_eps):
    """`model` with norm_weight_fp32's norm: h·rstd·wx rounded once (float64 here)."""
    p, h = mixed(prefix, delta, blocks, mix_norm_weight, mix_proj_weight, mix_eps)
    hd = h.double()
    xn = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + norm_eps)
    return p, (xn * norm_weight.double()).bfloat16()


@pytest.mark.parametrize("n", [1, 8, 64])
@pytest.mark.parametrize("n_blocks", [8, 1, 0])
@pytest.mark.parametrize("has_delta", [True, False], ids=["delta", "no_delta"])
def test_norm_weight_fp32(gen, n, n_blocks, has_delta):
    """The norm's weight multiplied in fp32 before the one rounding (spell9's norm; its own
    build): within two roundings of the float64 model of that math (h, then x), bit-equal to the
    op's reference variant but where the fp32 mix lands h on another side of a bf16 boundary,
    and nearer to it than to the default rounding; through the op's dispatch too."""
    inputs = make_inputs(gen, n, HIDDEN, n_blocks, has_delta)
    out = (poisoned(n, HIDDEN), poisoned(n, HIDDEN))
    got = kernel.attn_res_mix_norm_cuda(**inputs, scores_fp32=True, norm_weight_fp32=True,
                                        out=out)
    assert got[0] is out[0] and got[1] is out[1], "the kernel did not run (fallback)"
    assert_written(*out)
    p, x = out
    want_p, want_x = attn_res_mix_norm_ref(**inputs, scores_fp32=True, norm_weight_fp32=True)
    assert torch.equal(p, want_p)
    _, model_x = model_fp32_weight(**inputs)
    torch.testing.assert_close(x.float(), model_x.float(), rtol=2**-7 + 2**-8,
                               atol=TOL["bf16"]["atol"])
    assert rel_err(x, want_x) < TOL["bf16_rel_norm"]
    _, plain_x = attn_res_mix_norm_ref(**inputs, scores_fp32=True)
    off_flagged, off_plain = (x != want_x).float().mean(), (x != plain_x).float().mean()
    assert off_flagged < 0.5 * off_plain, (off_flagged, off_plain)
    with no_fallback():
        p, x2 = torch.ops.k3.attn_res_mix_norm(**inputs, scores_fp32=True, norm_weight_fp32=True)
    assert torch.equal(p, want_p) and torch.equal(x2, x)
