"""Session 35: a matched node's literals are the pattern's. Inductor's `fx_to_pattern` leaves
every int, float, list, dtype and device of a search graph free (`Ignored`), so a site that
reduced over another dim or raised to another power matched, and the rewrite computed another
value: `mean(-2)` for an RMSNorm's `mean(-1)`, `pow(4)` for its `pow(2)`, its fp32 math done in
fp16, a depth mix's softmax over the batch for its softmax over the sources. The engine's match
context refuses such a node by name (`inductor.disagreement`): a number the pattern does not
capture must be the pattern's, a reduction's, softmax's, cat's, gather's or top-k's `dim` must
be the pattern's, counted from the end where the pattern counts from the end, and where the
pattern computes in fp32 the site computes in fp32 or fp64 (not fp16). Sizes, reshapes' dims
and other dtypes stay free (they follow the site's shapes and dtype; the engine compares the
replacement's outputs). Session 36 (below): a shape op's or a range's choice of elements (a
select's index, a slice's bounds, a permute's and an unsqueeze's dims, an iota's start and
step) and keyword literals are compared too; a site's trailing argument at the op's default
(`topk(x, k, 1)` of 2-D logits) and a reduction's `dtype=` of its own float input fuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.math import rms_norm
from k3compile.rewrite import apply_patterns, inductor
from patterns import attn_res_mix_norm, kda_decode, linear, mla_decode, moe_route
from patterns import rms_norm as rms_norm_pattern
from tests.fusions.attention_checks import family
from tests.fusions.pattern_checks import (
    assert_near_miss,
    assert_rewritten_equal,
    graph,
    rewrite,
)


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

    pattern = inductor.gen_pattern_and_search_gm(search, [torch.randn(2, 16), 1.5],
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


# ---- Session 36: a shape op's or a range's choice of elements, unread arguments, defaults ----
# Inductor's `fx_to_pattern` leaves a select's index, a slice's bounds, a permute's and an
# unsqueeze's dims and an iota's start / step free too, and `literal_args` kept only positional
# literals: a site that picks other elements of the same shape matched. Graphs edited in one
# literal each (the look-alike), compared with the edited graph's own eager values.

def _edit(target, k: int, i: int, value):
    """An edit setting argument i (an int: positional; a str: a keyword) of the k-th node of
    `target` to `value`."""
    def edit(gm):
        node = [n for n in gm.graph.nodes if n.target is target][k]
        if isinstance(i, str):
            node.kwargs = {**node.kwargs, i: value}
        else:
            node.args = (*node.args[:i], value, *node.args[i + 1:])
    return edit


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _edited_rewrite(fn, args, patterns, *edits):
    """(report, the edited graph's eager outputs, its outputs after the patterns)."""
    gm = graph(fn, *args, joint=True)
    for edit in edits:
        edit(gm)
    gm.recompile()
    gm = graph(gm, *args)  # traced again: meta as the edited graph computes it
    want = gm(*_clone(args))
    report = apply_patterns(gm.graph, patterns)
    gm.recompile()
    return report, torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(
        gm(*_clone(args)))


def _assert_refused(fn, args, patterns, edits, *words):
    report, want, got = _edited_rewrite(fn, args, patterns, *edits)
    misses = assert_near_miss(report, patterns[0].name.split("[")[0], *words)
    assert any(m.kind.startswith(("literal_mismatch: a ", "keyword_mismatch: a "))
               for m in misses), misses
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _assert_fused(fn, args, patterns, edits, op):
    report, want, got = _edited_rewrite(fn, args, patterns, *edits)
    assert [h.op for h in report.hits] == [op], report.near_misses
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _kda(tokens):
    """kda_decode's bf16 batch-2 site of T tokens: (function, arguments, patterns)."""
    variant = next(p for p in family("kda_decode")
                   if p.name == f"kda_decode[T={tokens},B=n,bfloat16]")
    args = variant.example_inputs()
    state = kda_decode.NAMES.index("recurrent_state")
    args[state] = args[state] * 0.05  # a decode-sized state
    args[kda_decode.NAMES.index("q_scale")] = args[state].shape[-1] ** -0.5
    return kda_decode.kda_step, args, family("kda_decode")


_SELECT, _SLICE = torch.ops.aten.select.int, torch.ops.aten.slice.Tensor
_UNSQUEEZE = torch.ops.aten.unsqueeze.default


@pytest.mark.parametrize(("tokens", "edits", "words"), [
    (2, [_edit(_SELECT, 0, 2, 1)], ("select (select.int", "index=1", "has 0")),
    (2, [_edit(_SELECT, 0, 1, 2)], ("select (select.int", "dim=2", "has 1")),
    (1, [_edit(_SLICE, 0, 2, 0), _edit(_SLICE, 0, 3, 3)], ("slice", "start=0", "has 1")),
    (1, [_edit(_UNSQUEEZE, 0, 1, -2)], ("unsqueeze (unsqueeze", "dim=-2", "has -1")),
    (1, [_edit(_UNSQUEEZE, 3, 1, -2), _edit(_UNSQUEEZE, 4, 1, -1)], ("unsqueeze", "dim=-2")),
], ids=["token_1_for_0", "select_over_heads", "conv_state_head_for_tail", "decay_unsqueezed",
        "outer_product_transposed"])
def test_kda_step_choosing_other_elements_is_refused(tokens, edits, words):
    """The bug: each fused into k3.kda_decode (the pattern's tokens, taps and outer product);
    measured without the check (bf16, batch 2, H = T = 2, K = 8): token 1's q read as token 0's
    0.54 off eager at most, the select over the heads 0.15, the conv state written back from the
    window's head (`[..., :3]`) instead of its tail (`[..., 1:]`) 4.53, the decay unsqueezed at
    -2 (a [B, H, 1, K] factor, the state's columns decayed) 0.22, k ⊗ u as u ⊗ k 1.70."""
    fn, args, patterns = _kda(tokens)
    _assert_refused(fn, args, patterns, edits, "literal_mismatch", *words)


@pytest.mark.parametrize(("tokens", "edits"), [
    (2, [_edit(_SELECT, 1, 2, -2)]),  # token 0 of 2, counted from the end
    (1, [_edit(_SLICE, 0, 2, -3)]),  # the window's last taps - 1 = 3 of 4
    (1, [_edit(_SLICE, 0, 3, 4)]),  # to its end, written as its length
    (1, [_edit(_UNSQUEEZE, 0, 1, 3)]),  # -1 of the 4-D result, counted from the front
], ids=["token_from_the_end", "tail_from_the_end", "tail_to_its_length", "unsqueeze_from_front"])
def test_kda_step_choosing_the_same_elements_still_fuses(tokens, edits):
    fn, args, patterns = _kda(tokens)
    _assert_fused(fn, args, patterns, edits, "k3.kda_decode")


def test_linear_of_an_unpermuted_square_weight_is_refused():
    """The bug: `mm(x, permute(w, [0, 1]))` (x @ w) fused into k3.linear (x @ w.T) on a square
    weight: 29.2 off eager at most ([2, 32] @ [32, 32], fp32) without the check."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 32, generator=g), torch.randn(32, 32, generator=g)]
    _assert_refused(F.linear, args, linear.patterns(),
                    [_edit(torch.ops.aten.permute.default, 0, 1, [0, 1])],
                    "literal_mismatch: permute", "dims=[0, 1]", "[1, 0]")


_IOTA = torch.ops.prims.iota.default


@pytest.mark.parametrize(("edit", "words"), [
    (_edit(_IOTA, 0, "start", 1), ("iota", "start=1", "has 0")),
    (_edit(_IOTA, 1, "start", 1), ("iota_1", "start=1", "has 0")),
    (_edit(_IOTA, 1, "step", 2), ("iota_1", "step=2", "has 1")),
], ids=["positions_from_1", "cache_rows_from_1", "cache_rows_by_2"])
def test_mla_positions_ranged_otherwise_are_refused(edit, words):
    """The bug: `arange` as `prims.iota(n, start=, step=)`, both keywords, which the matcher
    left free: a site writing the cache at positions pos + 1.. or masking by rows counted from 1
    or by 2 fused into k3.mla_decode (fp32, B = T = 2: 3.99, 3.28 and 3.28 off eager at most)."""
    variant = next(p for p in family("mla_decode") if p.name == "mla_decode[B=n,T=n,float32]")
    _assert_refused(mla_decode.search, variant.example_inputs(), family("mla_decode"), [edit],
                    "literal_mismatch", *words)


def _route(dim=-1, **topk):
    def f(logits, bias):
        scores = torch.sigmoid(logits)
        _, ids = torch.topk(scores + bias, 4, dim, **topk)
        weights = scores.gather(-1, ids)
        return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * 2.5
    return f


def _logits(rows=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rows, 16, generator=g), 0.1 * torch.randn(16, generator=g)]


def test_top_k_over_dim_1_of_2_d_logits_fuses_moe_route():
    """`topk(x, k, 1)` on [N, E] logits is the pattern's `topk(x, k)` (dim -1): its extra
    argument is compared as the schema default, counted as the pattern counts it. Before, the
    argument count differed and the router stayed unfused (rule `topk_sorted` rewrites it in the
    pipeline; the engine no longer needs it to)."""
    args = _logits()
    site = _route(dim=1)
    gm, report = rewrite(site, args, moe_route.patterns())
    assert_rewritten_equal(gm, report, site, args, "k3.moe_route")


@pytest.mark.parametrize(("site", "words"), [
    (_route(dim=0), ("topk (topk", "dim=0", "(default: -1)")),
    (_route(largest=False), ("topk (topk", "largest=False", "(default: True)")),
], ids=["over_the_rows", "smallest"])
def test_top_k_with_another_default_is_refused_by_name(site, words):
    args = _logits(rows=16)  # square: the rows' top-k has the pattern's shapes
    gm, report = rewrite(site, args, moe_route.patterns())
    assert_near_miss(report, "moe_route", "keyword_mismatch", *words)
    for got, want in zip(gm(*args), site(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _norm_mean_in(dtype):
    def f(x, weight):
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True, dtype=dtype)
                                         + 1e-6)).to(x.dtype)
    return f


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mean_in_its_own_dtype_still_fuses(dtype):
    """`mean(h, -1, dtype=torch.float32)` of fp32 h is no cast, the pattern's mean: fused, equal
    to eager bit for bit (session 35 refused it: a keyword the pattern lacks, not its default)."""
    args = _inputs(2, 3, 64, dtype=dtype)
    site = _norm_mean_in(torch.float32)
    gm, report = rewrite(site, args, rms_norm_pattern.patterns())
    assert_rewritten_equal(gm, report, site, args, "k3.rms_norm")


def test_a_mean_in_another_dtype_is_refused():
    args = _inputs(2, 3, 64, dtype=torch.bfloat16)
    site = _norm_mean_in(torch.float64)
    gm, report = rewrite(site, args, rms_norm_pattern.patterns())
    assert_near_miss(report, "rms_norm", "keyword_mismatch", "dtype=torch.float64")
    torch.testing.assert_close(gm(*args), site(*args), rtol=0, atol=0)


def _one_op_match(search, site, x):
    """inductor.match of `search`'s pattern (one op on x, as the engine builds it) at the output
    of `site` traced on x: truthy, or the failure."""
    expr, search_gm = inductor.gen_pattern_and_search_gm(search, [x], inductor.fwd_only, {})
    inductor.literal_args(expr, search_gm)
    inductor.view_alike(expr)
    inductor.defaults_alike(expr)
    gm = inductor.fwd_only_fake(site, [x])
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return inductor.match(expr, out[0] if isinstance(out, (list, tuple)) else out)


@pytest.mark.parametrize(("search", "site", "same"), [
    (lambda x: x[:, 1:], lambda x: x[:, -7:], True),  # x [4, 8]: the same bounds
    (lambda x: x[:, 1:], lambda x: x[:, 1:8], True),
    (lambda x: x[:, 1:], lambda x: x[:, :7], False),
    (lambda x: x[:, 1:], lambda x: x[:, 1::2], False),
    (lambda x: x[:, 2], lambda x: x[:, -6], True),
    (lambda x: x[:, 2], lambda x: x[:, 3], False),
    (lambda x: x.permute(1, 0), lambda x: x.view(1, 4, 8).permute(0, 2, 1), True),
    (lambda x: x.permute(1, 0), lambda x: x.view(2, 2, 8).permute(1, 0, 2), False),
    (lambda x: x.unsqueeze(-1), lambda x: x.view(4, 8, 1), True),  # the view as an unsqueeze
    (lambda x: x.unsqueeze(-1), lambda x: x.view(4, 1, 8), False),
    (lambda x: x.split(4, -1)[1], lambda x: x.split(4, 1)[1], True),
    (lambda x: x.topk(2)[1], lambda x: x.topk(2, 1)[1], True),
    (lambda x: x.topk(2)[1], lambda x: x.topk(2, 1, False)[1], False),
], ids=["slice_from_the_end", "slice_to_its_length", "slice_head", "slice_step",
        "select_from_the_end", "select_other", "permute_of_a_leading_dim",
        "permute_moving_the_leading_dim", "unit_view", "unit_view_elsewhere", "split_dim",
        "topk_dim_1_of_2", "topk_smallest"])
def test_shape_ops_compare_their_choice_of_elements(search, site, same):
    """The rules on single ops of x [4, 8]: positions counted as the pattern counts them on the
    site's dim, a permute of a site with more dims keeping the extra leading ones in place, a
    unit view inserting the pattern's unsqueeze dim, a split's dim, a trailing argument at the
    op's default; the two spellings' values (a leading unit dim aside) are equal exactly where
    they match."""
    x = torch.randn(4, 8)
    m = _one_op_match(search, site, x)
    assert bool(m) == same, m
    want, got = search(x), site(x)
    got = got.squeeze(0) if got.dim() == want.dim() + 1 else got
    assert (want.shape == got.shape and torch.equal(want, got)) == same


@pytest.mark.parametrize(("search", "site", "same"), [
    (lambda x: x + torch.arange(8), lambda x: x + torch.arange(0, 8), True),
    (lambda x: x + torch.arange(8), lambda x: x + torch.arange(1, 9), False),
    (lambda x: x + torch.arange(8), lambda x: x + torch.arange(0, 16, 2), False),
    (lambda x: torch.add(x, x * 2, alpha=2), lambda x: torch.add(x, x * 2, alpha=2.0), True),
    (lambda x: torch.add(x, x * 2, alpha=2), lambda x: torch.add(x, x * 2, alpha=3), False),
    (lambda x: x.clamp(min=0.5), lambda x: x.clamp(min=0.25), False),
    (lambda x: torch.where(x > 0, x, 0.5), lambda x: torch.where(x > 0, x, 0.25), False),
    (lambda x: x + x.new_full((8,), 2.5), lambda x: x + x.new_full((8,), 2.0), False),
], ids=["arange_as_traced", "arange_from_1", "arange_by_2", "alpha_2.0", "alpha_3",
        "clamp_min", "where_scalar", "new_full"])
def test_keyword_and_fill_literals_are_compared(search, site, same):
    """An iota's start / step and a number the pattern passes as a keyword (`alpha=2`) were left
    free (keywords: `literal_args` kept positional literals only); a clamp's bound, a `where`
    scalar and a fill value trace to positional numbers (`clamp_min`, `scalar_tensor`, `full`),
    compared since session 35."""
    x = torch.randn(4, 8)
    m = _one_op_match(search, site, x)
    assert bool(m) == same, m
    if not same:
        assert "literal_mismatch" in m.format_string, m
    assert torch.equal(search(x), site(x)) == same
