"""Issue 18, item 1: a matcher that cannot mis-fuse. The engine refuses a replacement whose
outputs differ in dtype, shape or device from what the matched nodes' `meta["val"]` say (a near
miss naming the reason), and applies one that agrees; verify mode compares dtype and shape as
well as values and reverts what fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import moe_front

import k3compile.ops  # noqa: F401
from k3compile.rewrite import Pattern, apply_patterns, inductor, verify_rewrites


def _graph(fn, *args):
    return inductor.fwd_only_fake(fn, list(args))  # one fake mode for all meta, as in Inductor


def _variant(name: str) -> Pattern:
    return next(p for p in moe_front.patterns() if p.name == name)


def _gate_and_q_a(x, g_w, q_a_w):
    """Two GEMMs on one bf16 input, the first under a sigmoid, no fp32 casts (a bf16 model): what
    moe_front[float32] took for a router (issue 18: MLA's output gate and q_a). Here the sigmoid
    also feeds a top-k, so moe_front's own anchor (scores that choose) holds and only the
    engine's guard stands between the fp32 variant and this bf16 site."""
    scores = torch.sigmoid(F.linear(x, g_w))
    return scores, F.linear(x, q_a_w), torch.topk(scores, 4, dim=-1)[1]


@pytest.fixture
def bf16_site():
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 64, generator=g).bfloat16(), torch.randn(16, 64, generator=g).bfloat16(),
            torch.randn(32, 64, generator=g).bfloat16()]
    return _graph(_gate_and_q_a, *args), args


@pytest.mark.parametrize("check", [True, False], ids=["with_check", "without_check"])
def test_fp32_moe_front_is_refused_at_a_bf16_site(bf16_site, check):
    """The bug from issue 18: the fp32 variant's search has no casts, so it matches the bf16 gate
    + q_a pair; its replacement returns fp32 logits where the graph says bf16. Refused by the
    engine itself, whatever the pattern's own check says."""
    gm, args = bf16_site
    want = gm(*args)
    pattern = _variant("moe_front[float32]")
    if not check:
        pattern = dataclasses.replace(pattern, check=None)
    assert inductor.match(pattern.expr, _anchor(gm)), "the fp32 search must match (the bug's premise)"
    report = apply_patterns(gm.graph, [pattern])
    gm.recompile()
    assert not report.hits and not report.rewrites
    (miss,) = [nm for nm in report.near_misses if nm.pattern == "moe_front[float32]"]
    assert "replacement refused" in miss.reason
    assert "float32" in miss.reason and "bfloat16" in miss.reason, miss.reason
    assert not any("k3." in str(n.target) for n in gm.graph.nodes)
    for g, w in zip(gm(*args), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_all_moe_front_variants_leave_the_bf16_site(bf16_site):
    gm, _ = bf16_site
    report = apply_patterns(gm.graph, moe_front.patterns())
    assert not report.hits


def _anchor(gm):
    return next(n for n in gm.graph.nodes if n.target is torch.ops.aten.sigmoid.default)


# ---- hand-built graphs: a replacement that changes what the site is, and one that does not ------

def _search(x, w):
    return torch.relu(x @ w)


def _pattern(replace, name="toy") -> Pattern:
    return Pattern(name=name, search=_search, replace=replace, op="k3.toy",
                   example_inputs=lambda: [torch.randn(4, 8), torch.randn(8, 16)])


def _site():
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    gm = _graph(lambda x, w: torch.relu(x @ w) * 2, x, w)
    return gm, [x, w]


@pytest.mark.parametrize("replace,words", [
    (lambda x, w: torch.relu(x @ w).double(), ("float64", "float32")),  # dtype
    (lambda x, w: torch.relu(x @ w)[:2], ("[2, 16]", "[4, 16]")),  # shape
    (lambda x, w: torch.relu(x @ w).t().contiguous(), ("[16, 4]", "[4, 16]")),  # shape
], ids=["dtype", "rows", "transposed"])
def test_replacement_differing_from_the_site_meta_is_refused(replace, words):
    gm, args = _site()
    want = gm(*args)
    report = apply_patterns(gm.graph, [_pattern(replace)])
    gm.recompile()
    assert not report.hits
    (miss,) = report.near_misses
    assert miss.pattern == "toy" and miss.reason.startswith("replacement refused")
    assert all(w in miss.reason for w in words), miss.reason
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)


def test_replacement_raising_on_the_site_meta_is_refused():
    def broken(x, w):
        raise NotImplementedError("no such kernel")

    gm, _ = _site()
    report = apply_patterns(gm.graph, [_pattern(broken)])
    assert not report.hits
    assert "NotImplementedError" in report.near_misses[0].reason


def test_replacement_matching_the_site_meta_is_applied():
    gm, args = _site()
    want = gm(*args)
    # another spelling of the same value: the same dtype, shape and device as the site
    report = apply_patterns(gm.graph, [_pattern(lambda x, w: torch.clamp_min(torch.mm(x, w), 0))])
    gm.recompile()
    assert report.counts == {"toy": 1} and not report.near_misses
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.relu.default not in targets
    assert torch.ops.aten.clamp_min.default in targets
    torch.testing.assert_close(gm(*args), want)
    (rw,) = report.rewrites
    assert [tuple(v.shape) for v in rw.site] == [(4, 16)] and rw.outputs[0] in rw.nodes
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")


# ---- verify mode: dtype and shape, against the pattern and the site -------------------------------

def test_verify_keeps_a_correct_rewrite():
    gm, args = _site()
    report = apply_patterns(gm.graph, [_pattern(lambda x, w: torch.clamp_min(torch.mm(x, w), 0))])
    verify_rewrites(gm.graph, report)
    assert report.verified == 1 and not report.reverted and report.hits


def test_verify_reverts_a_wrong_value_and_splices_the_search_back():
    gm, args = _site()
    want = gm(*args)
    report = apply_patterns(gm.graph, [_pattern(lambda x, w: torch.relu(x @ w) + 1)])
    assert report.hits
    verify_rewrites(gm.graph, report)
    gm.recompile()
    assert not report.hits and report.verified == 0
    (rev,) = report.reverted
    assert "relative error" in rev.error
    assert torch.ops.aten.relu.default in {n.target for n in gm.graph.nodes}
    assert all(n.meta.get("k3_reverted") == "toy" for n in gm.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten.relu.default)
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")


def test_verify_compares_dtype_against_the_site():
    """A rewrite whose recorded site metadata differs from what the replacement computes (the
    engine's refusal bypassed: a graph whose meta a later edit changed) fails verification on
    dtype, though search and replacement agree with each other."""
    gm, args = _site()
    report = apply_patterns(gm.graph, [_pattern(lambda x, w: torch.clamp_min(torch.mm(x, w), 0))])
    (rw,) = report.rewrites
    rw.site = [rw.site[0].to(torch.bfloat16)]
    verify_rewrites(gm.graph, report)
    (rev,) = report.reverted
    assert "site's metadata" in rev.error and "bfloat16" in rev.error, rev.error


def test_verify_compares_dtype_between_search_and_replacement():
    from k3compile.rewrite import verify_site

    values = {"x": torch.randn(4, 8), "w": torch.randn(8, 16)}
    assert verify_site(_pattern(lambda x, w: torch.relu(x @ w)), values) is None
    error = verify_site(_pattern(lambda x, w: torch.relu(x @ w).half()), values)
    assert error is not None and "float16" in error and "float32" in error
    error = verify_site(_pattern(lambda x, w: torch.relu(x @ w)[:, :8]), values)
    assert error is not None and "[4, 8]" in error


# ---- a replacement that would read its own result -------------------------------------------------

def _two_outputs(x, y):
    e = torch.exp(x)
    return e, e * y


def _one_node(x, y):  # both outputs from one node, as a fused op returns them
    both = torch.stack([torch.exp(x), torch.exp(x) * y])
    return both[0], both[1]


def _reading_its_output(x):
    """y, the second input of the site exp(x), exp(x) * y, is computed from the site's exp
    (spell11: the AttnRes block sliced out of a bank that holds the prefix the site adds)."""
    e = torch.exp(x)
    return e * e.sum(-1, keepdim=True)


def _pair_pattern() -> Pattern:
    return Pattern(name="pair", search=_two_outputs, replace=_one_node, op="k3.pair",
                   example_inputs=lambda: [torch.randn(4, 8), torch.randn(4, 1)])


def test_replacement_reading_its_own_output_is_refused():
    x = torch.randn(4, 8)
    gm = _graph(_reading_its_output, x)
    want = gm(x)
    report = apply_patterns(gm.graph, [_pair_pattern()])
    gm.recompile()
    assert not report.hits
    (miss,) = report.near_misses
    assert miss.reason.startswith("replacement refused: its input") and "exp" in miss.reason, \
        miss.reason
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)


def test_replacement_of_an_independent_site_is_applied():
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    gm = _graph(lambda x, y: _two_outputs(x, y), x, y)
    want = gm(x, y)
    report = apply_patterns(gm.graph, [_pair_pattern()])
    gm.recompile()
    assert report.counts == {"pair": 1}
    assert {n.target for n in gm.graph.nodes} & {torch.ops.aten.stack.default,
                                                  torch.ops.aten.cat.default}
    for g, w in zip(gm(x, y), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
