"""attn_res_mix_norm: the Attention-Residual depth mix (stack, RMS-normalised scores against the
pseudo-query, softmax over sources, fp32 weighted sum) and the RMSNorm after it, with and without
the prefix add, per number of completed blocks and per dtype; in bf16 also with the scores in fp32
throughout (Moonshot's, `scores_fp32`: the kernel's own score math, fused on a GPU too)."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import attn_res_mix_norm

from k3compile.math import depth_mix_scores_fp32, depth_mix_weights, rms_norm

from .pattern_checks import (
    assert_fused_on_gpu_graph,
    assert_near_miss,
    assert_rewritten_equal,
    assert_variant_rewrite,
    rewrite,
    with_kernel_limits,
)

D, MIX_EPS, NORM_EPS = 64, 1e-6, 1e-5  # two eps, so the op's arguments show which was captured
PATTERNS = attn_res_mix_norm.patterns()  # traced once, on first use


def _inputs(n_blocks=2, with_delta=True, dtype=torch.bfloat16, norm_width=D):
    g = torch.Generator().manual_seed(n_blocks)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)
    acts = [rnd(3, 1, D) for _ in range(1 + with_delta + n_blocks)]  # prefix, [delta], blocks
    weights = [(1 + 0.1 * torch.randn(D, generator=g)).to(dtype), rnd(1, D),
               (1 + 0.1 * torch.randn(norm_width, generator=g)).to(dtype)]
    return [*acts, *weights]


def _model(with_delta, mix=depth_mix_weights):
    """The model's unfused spelling (k3compile.math, as models/k3.py calls it; `mix`
    depth_mix_scores_fp32: the canonical form of Moonshot's fp32 scores)."""
    def with_prefix_add(prefix, delta, *rest):
        *blocks, wmn, wmp, wn = rest
        prefix_out = prefix + delta
        h = mix(prefix_out, blocks, wmn, wmp, MIX_EPS)
        return rms_norm(h, wn, NORM_EPS), prefix_out

    def block_start(prefix, *rest):  # no delta: the prefix is the mix's own source
        *blocks, wmn, wmp, wn = rest
        return rms_norm(mix(prefix, blocks, wmn, wmp, MIX_EPS), wn, NORM_EPS)

    return with_prefix_add if with_delta else block_start


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("n_blocks", [1, 3, 8])
def test_rewrites_and_equals_eager(n_blocks, with_delta, dtype):
    fn, args = _model(with_delta), _inputs(n_blocks, with_delta, dtype)
    gm, report = rewrite(fn, args, PATTERNS)
    assert_rewritten_equal(gm, report, fn, args, "k3.attn_res_mix_norm")
    assert report.hits[0].pattern.startswith(f"attn_res_mix_norm[blocks={n_blocks},")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.attn_res_mix_norm.default")
    assert (op.args[1] is None) == (not with_delta)
    assert len(op.args[2]) == n_blocks
    assert op.args[-2:] == (MIX_EPS, NORM_EPS)  # the graph's eps, not the pattern's examples
    # the whole mix is gone: no softmax, stack or norm left beside the op
    assert not any(k in str(n.target) for n in gm.graph.nodes for k in ("amax", "rsqrt", "cat"))


def test_escaping_softmax_is_a_near_miss():
    def leaky(prefix, delta, b0, b1, wmn, wmp, wn):
        prefix_out = prefix + delta
        sources = torch.stack([b0, b1, prefix_out])
        normed = rms_norm(sources, wmn, MIX_EPS)
        scores = torch.nn.functional.linear(normed, wmp).squeeze(-1).float()
        alpha = torch.softmax(scores, dim=0)  # also returned: the mix weights escape the fusion
        h = (alpha.unsqueeze(-1) * sources.float()).sum(0).to(prefix.dtype)
        return rms_norm(h, wn, NORM_EPS), prefix_out, alpha

    args = _inputs()
    gm, report = rewrite(leaky, args, PATTERNS)
    assert_near_miss(report, "attn_res_mix_norm[blocks=2", "multiple_users: div")  # softmax's div
    for got, want in zip(gm(*args), leaky(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_check_refuses_a_tensor_eps():
    """torch.compile(dynamic=True) makes a float attribute a graph input: the norm's eps is then
    a node, which the op's float argument cannot hold."""
    def eps_input(prefix, delta, b0, b1, wmn, wmp, wn, norm_eps):
        prefix_out = prefix + delta
        h = depth_mix_weights(prefix_out, [b0, b1], wmn, wmp, MIX_EPS)
        return rms_norm(h, wn, norm_eps), prefix_out

    args = [*_inputs(), torch.tensor(NORM_EPS)]
    _, report = rewrite(eps_input, args, PATTERNS)
    assert_near_miss(report, "attn_res_mix_norm[blocks=2", "check refused",
                     "norm_eps is not a compile-time float")


def test_check_refuses_a_broadcast_norm_weight():
    _, report = rewrite(_model(True), _inputs(norm_width=1), PATTERNS)
    assert_near_miss(report, "attn_res_mix_norm[blocks=2", "check refused",
                     "w_norm shape [1] is not [hidden=64]")


@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_fp32_scores_fuse_as_their_variant(n_blocks, with_delta):
    """bf16 scores in fp32 throughout are another computation than the built-in ones: their own
    variant takes the site and the op runs with scores_fp32=True, bit-equal to the unfused graph."""
    fn, args = _model(with_delta, depth_mix_scores_fp32), _inputs(n_blocks, with_delta)
    gm, report = rewrite(fn, args, PATTERNS)
    assert_rewritten_equal(gm, report, fn, args, "k3.attn_res_mix_norm")
    kind = "delta" if with_delta else "no_delta"
    name = f"attn_res_mix_norm[blocks={n_blocks},{kind},scores_fp32]"
    assert [h.pattern for h in report.hits] == [name]
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.attn_res_mix_norm.default")
    assert op.args[-3:] == (MIX_EPS, NORM_EPS, True)
    built_in = _model(with_delta)(*args)
    assert not torch.equal(built_in[0] if with_delta else built_in,
                           gm(*args)[0] if with_delta else gm(*args))


@pytest.mark.parametrize("mix", [depth_mix_scores_fp32, depth_mix_weights], ids=["fp32", "bf16"])
def test_both_score_variants_fuse_where_only_kernels_fuse(monkeypatch, mix):
    """On a GPU graph (the kernel's limits in the registry) each score variant fuses as itself,
    bit-equal to the unfused graph on the CPU."""
    with_kernel_limits(monkeypatch, "attn_res_mix_norm")
    args = _inputs(2, True)
    fn = _model(True, mix)
    gm, report = rewrite(fn, args, PATTERNS, kernels_only=True)
    assert_rewritten_equal(gm, report, fn, args, "k3.attn_res_mix_norm")
    assert [h.pattern.endswith(",scores_fp32]") for h in report.hits] == [
        mix is depth_mix_scores_fp32]


def test_kernel_takes_fp32_scores_whose_math_it_already_is():
    """The kernel refuses neither score variant (only what it cannot take), and its documented
    math (tests/fusions/test_attn_res_mix_norm_kernel.py `model`, float64) is the fp32-scores
    reference to the kernel tolerances, not the built-in one (its bf16 score roundings)."""
    from k3compile.kernels import attn_res_mix_norm as kernel

    from k3compile.ops.attn_res_mix_norm import attn_res_mix_norm_ref
    from tests.fusions.test_attn_res_mix_norm_kernel import model
    from tests.kernel_checks import TOL, rel_err

    prefix, delta, *blocks, wmn, wmp, wn = [a.view(-1, D) if a.dim() == 3 else a
                                            for a in _inputs(8, True)]
    for scores_fp32 in (False, True):
        assert kernel.refusal(prefix, delta, blocks, wmn, wmp, wn, MIX_EPS, NORM_EPS,
                              scores_fp32) is None
        why = kernel.refusal(prefix.float(), delta, blocks, wmn, wmp, wn, MIX_EPS, NORM_EPS,
                             scores_fp32)
        assert why.startswith("prefix")
    g = torch.Generator().manual_seed(0)
    prefix, delta, *blocks = [(torch.randn(64, 1024, generator=g) * (1 + i / 4)).bfloat16()
                              for i in range(10)]
    wmn = (1 + 0.2 * torch.randn(1024, generator=g)).bfloat16()
    wmp = (torch.randn(1, 1024, generator=g) * 3 / 32).bfloat16()  # scores ~ N(0, 9)
    args = (prefix, delta, blocks, wmn, wmp, wmn, MIX_EPS, NORM_EPS)
    _, x = model(*args)
    _, fp32 = attn_res_mix_norm_ref(*args, True)
    _, built_in = attn_res_mix_norm_ref(*args)
    torch.testing.assert_close(x.float(), fp32.float(), **TOL["bf16"])
    assert rel_err(x, fp32) < TOL["bf16_rel_norm"] and 4 * rel_err(x, fp32) < rel_err(x, built_in)


# norm_weight_fp32: the norm after the mix multiplies its weight in fp32 before the one rounding
# to bf16 (tests/models/spell9_k3.py's `rms_norm`, a JAX/Flax port), the mix's scores in fp32


def _flax_norm(h, wn, eps):  # spell9's rms_norm: x * rsqrt(mean(x²) + eps) * scale, one cast
    x = h.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wn.float()).to(h.dtype)


def _torch_norm(h, wn, eps):
    """`F.rms_norm(h.float(), (D,), wn.float(), eps).to(h.dtype)` as the compiled graph has it
    (torch's decomposition, functionalised: a mean over dim 2, eps float32-rounded)."""
    x = h.float()
    eps32 = torch.tensor(eps, dtype=torch.float32).item()
    r = torch.rsqrt(torch.mean(x.pow(2), [2], keepdim=True) + eps32)
    return (x * r * wn.float()).to(h.dtype)


def _weight_last(h, wn, eps):  # look-alike: rounded first, the weight multiplied in bf16
    x = h.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * wn


def _kept_fp32(h, wn, eps):  # look-alike: the product with the weight never rounded to bf16
    x = h.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wn.float()


def norm_eps(norm) -> float:
    return torch.tensor(NORM_EPS, dtype=torch.float32).item() if norm is _torch_norm else NORM_EPS


def _fp32_weight_model(with_delta, norm):
    def with_prefix_add(prefix, delta, *rest):
        *blocks, wmn, wmp, wn = rest
        prefix_out = prefix + delta
        h = depth_mix_scores_fp32(prefix_out, blocks, wmn, wmp, MIX_EPS)
        return norm(h, wn, NORM_EPS), prefix_out

    def block_start(prefix, *rest):
        *blocks, wmn, wmp, wn = rest
        return norm(depth_mix_scores_fp32(prefix, blocks, wmn, wmp, MIX_EPS), wn, NORM_EPS)

    return with_prefix_add if with_delta else block_start


@pytest.mark.parametrize("norm", [_flax_norm, _torch_norm], ids=["flax", "F.rms_norm"])
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("n_blocks", [1, 3, 8])
def test_fp32_weight_norm_fuses_as_its_variant(n_blocks, with_delta, norm):
    """The norm's weight multiplied in fp32 before the one cast: its own variant takes the site
    and the op runs with norm_weight_fp32=True, bit-equal to the unfused graph and not to the
    built-in rounding."""
    fn, args = _fp32_weight_model(with_delta, norm), _inputs(n_blocks, with_delta)
    gm, report = rewrite(fn, args, PATTERNS)
    kind = "delta" if with_delta else "no_delta"
    assert_variant_rewrite(
        gm, report, fn, args, "k3.attn_res_mix_norm",
        f"attn_res_mix_norm[blocks={n_blocks},{kind},scores_fp32,norm_weight_fp32]",
        (MIX_EPS, norm_eps(norm), True, True))
    x = gm(*args)[0] if with_delta else gm(*args)
    built_in = _fp32_weight_model(with_delta, _weight_last)(*args)
    assert not torch.equal(x, built_in[0] if with_delta else built_in)


def test_weight_multiplied_after_the_cast_takes_the_plain_op():
    """Look-alike: the normalised row rounded to bf16 first, the weight multiplied in bf16 (the
    built-in order): the flag-less scores_fp32 variant, no norm_weight_fp32."""
    fn, args = _fp32_weight_model(True, _weight_last), _inputs(2, True)
    gm, report = rewrite(fn, args, PATTERNS)
    assert_rewritten_equal(gm, report, fn, args, "k3.attn_res_mix_norm")
    assert [h.pattern for h in report.hits] == ["attn_res_mix_norm[blocks=2,delta,scores_fp32]"]
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.attn_res_mix_norm.default")
    assert op.args[-3:] == (MIX_EPS, NORM_EPS, True)


def test_fp32_weight_norm_kept_in_fp32_is_left_alone():
    """Look-alike: the weighted norm never rounded to bf16 (an fp32 x): no variant takes it, the
    graph computes as before."""
    fn, args = _fp32_weight_model(True, _kept_fp32), _inputs(2, True)
    gm, report = rewrite(fn, args, PATTERNS)
    assert not report.hits
    assert "rsqrt" in " ".join(str(n.target) for n in gm.graph.nodes)
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fp32_weight_norm_fuses_on_gpu_graphs(monkeypatch):
    """The kernel's norm_weight_fp32 build passed its GPU tests (H100, 2026-12-05,
    test_attn_res_mix_norm_kernel.py::test_norm_weight_fp32), so a GPU graph fuses the site as the
    CPU graph does."""
    with_kernel_limits(monkeypatch, "attn_res_mix_norm")
    fn, args = _fp32_weight_model(True, _flax_norm), _inputs(2, True)
    gm, report = rewrite(fn, args, PATTERNS, kernels_only=True)
    assert_fused_on_gpu_graph(gm, report, fn, args, "attn_res_mix_norm")

# mix_weights_fp32: bf16 sources, the mix's weights fp32 masters read as they are (spell11: fp32
# master weights under torch.autocast, the mix in an fp32 island); the fold of the fp32 values


def _fp32_mix_weights(args):
    """`_inputs`' args with fp32 mix weights that bf16 cannot hold (so a rounding would show)."""
    *acts, wmn, wmp, wn = args
    g = torch.Generator().manual_seed(1)
    finer = [w.float() * (1 + 1e-2 * torch.randn(w.shape, generator=g)) for w in (wmn, wmp)]
    return [*acts, *finer, wn]


@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("n_blocks", [1, 3, 8])
def test_fp32_mix_weights_fuse_as_their_variant(n_blocks, with_delta):
    """fp32 mix weights beside bf16 sources (the scores in fp32): their own variant takes the
    site, the op reads the fp32 weights as they are, bit-equal to the unfused graph."""
    fn = _model(with_delta, depth_mix_scores_fp32)
    args = _fp32_mix_weights(_inputs(n_blocks, with_delta))
    gm, report = rewrite(fn, args, PATTERNS)
    kind = "delta" if with_delta else "no_delta"
    op = assert_variant_rewrite(
        gm, report, fn, args, "k3.attn_res_mix_norm",
        f"attn_res_mix_norm[blocks={n_blocks},{kind},scores_fp32,mix_weights_fp32]",
        (MIX_EPS, NORM_EPS, True))
    assert [a.meta["val"].dtype for a in op.args[3:5]] == [torch.float32] * 2
    assert not any(k in str(n.target) for n in gm.graph.nodes for k in ("amax", "rsqrt", "cat"))
    # the fold of the fp32 values, not of their bf16 roundings
    rounded = fn(*args[:-3], *(w.bfloat16() for w in args[-3:-1]), args[-1])
    x = gm(*args)[0] if with_delta else gm(*args)
    assert not torch.equal(x, rounded[0] if with_delta else rounded)


def test_bf16_mix_weights_promoted_into_fp32_scores_are_left_alone():
    """Look-alike: the same graph with bf16 mix weights multiplied into the fp32 scores by type
    promotion (their fold rounded in bf16): the check refuses it (a near miss naming the
    dtypes), the graph computes as before."""
    def promoted(prefix, delta, *rest):
        *blocks, wmn, wmp, wn = rest
        prefix_out = prefix + delta
        sources = torch.stack([*blocks, prefix_out]).float()
        h = sources * torch.rsqrt(sources.pow(2).mean(-1, keepdim=True) + MIX_EPS)
        alpha = torch.softmax((h * (wmn * wmp.view(-1))).sum(-1), dim=0)
        mixed = (alpha.unsqueeze(-1) * sources).sum(0).to(prefix.dtype)
        return rms_norm(mixed, wn, NORM_EPS), prefix_out

    args = _inputs(2, True)
    gm, report = rewrite(promoted, args, PATTERNS)
    assert_near_miss(report, "attn_res_mix_norm[blocks=2,delta,scores_fp32,mix_weights_fp32]",
                     "mix weights [torch.bfloat16, torch.bfloat16]")
    for got, want in zip(gm(*args), promoted(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fp32_mix_weights_stay_with_inductor_on_gpu_graphs(monkeypatch):
    """The kernel reads bf16 mix weights only (its refusal names them): a GPU graph defers the
    site instead of running the reference op by op; bf16 mix weights still fuse there."""
    with_kernel_limits(monkeypatch, "attn_res_mix_norm")
    fn = _model(True, depth_mix_scores_fp32)
    args = _fp32_mix_weights(_inputs(2, True))
    gm, report = rewrite(fn, args, PATTERNS, kernels_only=True)
    assert not report.hits and "attn_res_mix_norm" in report.deferred, report
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    gm, report = rewrite(fn, _inputs(2, True), PATTERNS, kernels_only=True)
    assert [h.pattern for h in report.hits] == ["attn_res_mix_norm[blocks=2,delta,scores_fp32]"]
