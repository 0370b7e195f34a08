"""Session 35: a matched node's literals are the pattern's. Inductor's `fx_to_pattern` leaves
every int, float, list, dtype and device of a search graph free (`Ignored`), so a site that
reduced over another dim or raised to another power matched, and the rewrite computed another
value: `mean(-2)` for an RMSNorm's `mean(-1)`, `pow(4)` for its `pow(2)`, its fp32 math done in
fp16, a depth mix's softmax over the batch for its softmax over the sources. The engine's match
context refuses such a node by name (`inductor.literal_mismatch`): a number the pattern does not
capture must be the pattern's, a reduction's, softmax's, cat's, gather's or top-k's `dim` must
be the pattern's, counted from the end where the pattern counts from the end, and where the
pattern computes in fp32 the site computes in fp32 or fp64 (not fp16). Sizes, view dims and
other dtypes stay free (they follow the site's shapes and dtype; the engine compares the
replacement's outputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.math import rms_norm
from k3compile.rewrite import inductor
from patterns import attn_res_mix_norm
from patterns import rms_norm as rms_norm_pattern
from tests.fusions.pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite


def _norm(power=2, dim=-1, eps=1e-6):
    def f(x, weight):
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(power).mean(dim, keepdim=True) + eps)).to(x.dtype)
    return f


def _inputs(*shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(dtype), torch.randn(shape[-1], generator=g).to(dtype)]


def _assert_eager_kept(fn, args, patterns, *words):
    """The site refused with a near miss naming the node and its literal, the graph eager's."""
    gm, report = rewrite(fn, args, patterns)
    misses = assert_near_miss(report, patterns[0].name.split("[")[0], "literal_mismatch", *words)
    assert any(m.kind.startswith("literal_mismatch: a ") for m in misses), misses
    for got, want in zip(torch.utils._pytree.tree_leaves(gm(*args)),
                         torch.utils._pytree.tree_leaves(fn(*args))):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # pow(3): rsqrt(<0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("site", "words"), [
    (_norm(dim=-2), ("mean (mean.dim", "dim=[-2]", "[-1]")),
    (_norm(dim=1), ("mean (mean.dim", "dim=[1]", "[-1]")),
    (_norm(power=4), ("pow_1 (pow.Tensor_Scalar", "exponent=4", "has 2")),
    (_norm(power=3), ("exponent=3",)),
], ids=["mean_dim_-2", "mean_dim_1_of_3", "pow_4", "pow_3"])
def test_rms_norm_over_another_dim_or_power_is_refused(site, words, dtype):
    """The bug: each fused into k3.rms_norm (normalising the last dim, squares), measured on
    [2, 3, 64] fp32 without the check: 2.25 off eager at most for mean(-2), 2.61 for pow(4)."""
    _assert_eager_kept(site, _inputs(2, 3, 64, dtype=dtype), rms_norm_pattern.patterns(), *words)


@pytest.mark.parametrize(("site", "shape"), [
    (_norm(), (2, 3, 64)),
    (_norm(dim=2), (2, 3, 64)),  # the last dim counted from the front
    (_norm(dim=1), (5, 64)),  # a site of another rank than the pattern's trace
    (_norm(power=2.0), (2, 3, 64)),  # 2.0 is 2
], ids=["as_traced", "dim_2_of_3", "dim_1_of_2", "pow_2.0"])
def test_rms_norm_spelled_alike_still_fuses(site, shape):
    args = _inputs(*shape)
    gm, report = rewrite(site, args, rms_norm_pattern.patterns())
    assert_rewritten_equal(gm, report, site, args, "k3.rms_norm")


def _norm_in(dtype):
    def f(x, weight):
        h = x.to(dtype)
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return f


def test_rms_norm_computed_in_fp16_is_refused():
    """The bug: a bf16 RMSNorm computed in fp16 (the pattern's upcast to fp32 a cast to fp16)
    fused into k3.rms_norm's fp32 math; where the squares overflow fp16 (|x| ~ 300), eager's
    rows are zeros: measured without the check, 6.66 off eager at most on [2, 3, 64]."""
    x, weight = _inputs(2, 3, 64)
    args = [(x * 300).bfloat16(), weight.bfloat16()]
    _assert_eager_kept(_norm_in(torch.float16), args, rms_norm_pattern.patterns(),
                       "convert_element_type (prims.convert_element_type float16",
                       "dtype=torch.float16", "torch.float32")


def test_rms_norm_computed_in_fp64_still_fuses():
    """fp64 holds fp32: the op's fp32 math is its documented rounding (equal here in bf16)."""
    args = [x.bfloat16() for x in _inputs(2, 3, 64)]
    site = _norm_in(torch.float64)
    gm, report = rewrite(site, args, rms_norm_pattern.patterns())
    assert_rewritten_equal(gm, report, site, args, "k3.rms_norm")


def _mix(softmax_dim=0, sum_dim=0):
    """A depth mix of two blocks and the prefix, then the norm: attn_res_mix_norm's form."""
    def f(prefix, delta, b0, b1, w_mix_norm, w_mix_proj, w_norm):
        prefix_out = prefix + delta
        sources = torch.stack([b0, b1, prefix_out])
        scores = F.linear(rms_norm(sources, w_mix_norm, 1e-5), w_mix_proj).squeeze(-1).float()
        alpha = torch.softmax(scores, dim=softmax_dim)
        h = (alpha.unsqueeze(-1) * sources.float()).sum(sum_dim).to(prefix.dtype)
        return rms_norm(h, w_norm, 1e-6), prefix_out
    return f


def _mix_inputs(batch, dtype):
    g = torch.Generator().manual_seed(1)
    act = [torch.randn(batch, 1, 64, generator=g).to(dtype) for _ in range(4)]
    w = [torch.randn(64, generator=g), torch.randn(1, 64, generator=g), torch.randn(64, generator=g)]
    return act + [x.to(dtype) for x in w]


def _mix_patterns():
    return [p for p in attn_res_mix_norm.patterns() if p.name.startswith(
        "attn_res_mix_norm[blocks=2,delta")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("site", "batch"), [
    (_mix(softmax_dim=1), 2),
    (_mix(softmax_dim=1), 3),  # as many rows as sources: every shape is the pattern's
    (_mix(softmax_dim=1, sum_dim=1), 3),
], ids=["softmax_over_rows", "softmax_over_rows_b3", "softmax_and_sum_over_rows_b3"])
def test_depth_mix_softmax_over_another_dim_is_refused(site, batch, dtype):
    """The bug: a softmax over the rows (not the sources) fused into k3.attn_res_mix_norm;
    measured without the check, fp32: 2.84 off eager at most (batch 2), 6.78 with the sum over
    the rows too (batch 3, every shape the pattern's)."""
    _assert_eager_kept(site, _mix_inputs(batch, dtype), _mix_patterns(), "amax", "dim=[1]",
                       "[0]")


@pytest.mark.parametrize("site", [_mix(), _mix(softmax_dim=-3)], ids=["dim_0", "dim_-3"])
def test_depth_mix_softmax_over_the_sources_still_fuses(site):
    args = _mix_inputs(2, torch.float32)
    gm, report = rewrite(site, args, _mix_patterns())
    assert_rewritten_equal(gm, report, site, args, "k3.attn_res_mix_norm")


def test_literal_mismatch_reads_the_schema():
    """The rule itself, on single nodes of a traced search graph: a number and a reduction's dim
    compare; a view's sizes and a captured scalar stay free."""
    def search(x, eps):
        return (x.view(-1, 8).pow(2).sum(-1) + eps).sum(0)

    pattern = inductor.gen_pattern_and_search_gm(search, [torch.randn(4, 8), 1.5],
                                                 inductor.fwd_only, {"eps": 1.5})
    inductor.literal_args(*pattern)
    expr = pattern[0]

    def site(power, dim, size):
        gm = inductor.fwd_only_fake(
            lambda x: (x.view(size).pow(power).sum(dim) + 2.5).sum(0), [torch.randn(2, 16)])
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        return inductor.match(expr, out[0] if isinstance(out, (list, tuple)) else out)

    assert site(2, -1, [-1, 8])
    assert site(2, 1, [4, 8])  # the last dim of 2, counted from the front; another view
    for power, dim, words in [(3, -1, "exponent=3"), (2, 0, "dim=[0]")]:
        m = site(power, dim, [-1, 8])
        assert not m and "literal_mismatch" in str(m.format_string) and words in (
            m.format_string.format(*m.args, **m.kwargs)), m
