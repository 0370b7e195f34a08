"""The rewrite engine on hand-built graphs: a pattern rewrites what it should, refuses sites where
an intermediate escapes or the check says no, and says why (near misses)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import attn_res_mix_norm as arm

import k3compile.ops  # noqa: F401
from k3compile.math import rms_norm
from k3compile.rewrite import apply_patterns, inductor, verify_rewrites


def _graph(fn, *args):
    return inductor.fwd_only_fake(fn, list(args))  # one fake mode for all meta, as in Inductor


def _mix(prefix, delta, block, wn, wp, w, eps=1e-5):
    return arm.mix_norm(prefix, delta, [block], wn, wp, w, eps, eps)


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    act = [torch.randn(3, 1, 32, generator=g).bfloat16() for _ in range(3)]
    return [*act, torch.randn(32, generator=g).bfloat16(), torch.randn(1, 32, generator=g).bfloat16(),
            torch.randn(32, generator=g).bfloat16()]


def _variant(n=1, delta=True):
    return next(p for p in arm.patterns() if p.name == f"attn_res_mix_norm[blocks={n},{'delta' if delta else 'no_delta'}]")


def test_rewrites_and_keeps_values(inputs):
    gm = _graph(lambda *a: _mix(*a), *inputs)
    want = gm(*inputs)
    report = apply_patterns(gm.graph, [_variant()])
    gm.recompile()
    assert report.counts == {"attn_res_mix_norm[blocks=1,delta]": 1}
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "k3.attn_res_mix_norm.default" in targets
    assert not any("amax" in t or "rsqrt" in t for t in targets)
    got = gm(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")


def test_escaping_intermediate_is_a_near_miss(inputs):
    def escaped(prefix, delta, block, wn, wp, w):
        prefix_out = prefix + delta
        sources = torch.stack([block, prefix_out])
        scores = F.linear(rms_norm(sources, wn, 1e-5), wp).squeeze(-1).float()
        alpha = torch.softmax(scores, dim=0)  # also returned: escapes the pattern
        h = (alpha.unsqueeze(-1) * sources.float()).sum(0).to(prefix_out.dtype)
        return prefix_out, rms_norm(h, w, 1e-5), alpha

    gm = _graph(escaped, *inputs)
    report = apply_patterns(gm.graph, [_variant()])
    assert not report.hits
    assert report.near_misses, "the resembling site must be reported"
    reasons = " ".join(nm.reason for nm in report.near_misses)
    assert "user" in reasons.lower() or "mismatch" in reasons.lower()


def test_check_refusal_is_a_near_miss(inputs):
    per_row = list(inputs)
    per_row[5] = torch.randn(1, 32).bfloat16()  # a [1, D] norm weight broadcasts, the kernel refuses
    gm = _graph(lambda *a: _mix(*a), *per_row)
    report = apply_patterns(gm.graph, [_variant()])
    assert not report.hits
    assert any("check refused" in nm.reason and "w_norm" in nm.reason for nm in report.near_misses)


def test_wrong_dtype_is_refused_by_check(inputs):
    double = [x.double() for x in inputs]
    gm = _graph(lambda *a: _mix(*a), *double)
    report = apply_patterns(gm.graph, [_variant()])
    assert not report.hits
    assert any("dtype" in nm.reason for nm in report.near_misses)


def test_verify_reverts_a_wrong_replacement(inputs):
    broken = _variant()
    wrong = type(broken)(**{**broken.__dict__, "name": "broken"})
    wrong.replace = lambda *a: tuple(t * 1.5 for t in broken.replace(*a))  # a buggy kernel
    gm = _graph(lambda *a: _mix(*a), *inputs)
    want = gm(*inputs)
    report = apply_patterns(gm.graph, [wrong])
    assert report.hits and len(report.rewrites) == 1
    verify_rewrites(gm.graph, report)  # what stage `verify` does
    gm.recompile()
    assert not report.hits and len(report.reverted) == 1 and report.verified == 0
    assert not any("k3." in str(n.target) for n in gm.graph.nodes)
    assert "relative error" in report.reverted[0].error
    for g, w in zip(gm(*inputs), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_bucket_range_restricts_a_pattern(inputs):
    restricted = _variant()
    only_big = type(restricted)(**{**restricted.__dict__, "buckets": (16, 64)})
    gm = _graph(lambda *a: _mix(*a), *inputs)
    assert not apply_patterns(gm.graph, [only_big], batch=4).hits
    assert apply_patterns(gm.graph, [only_big], batch=16).hits


def test_deferred_pattern_is_skipped_and_recorded(inputs):
    gm = _graph(lambda *a: _mix(*a), *inputs)
    want = gm(*inputs)
    report = apply_patterns(gm.graph, [_variant()], deferred=lambda p: "no kernel here")
    gm.recompile()
    assert not report.hits
    assert report.deferred == {"attn_res_mix_norm": "no kernel here"}
    assert not any("k3." in str(n.target) for n in gm.graph.nodes)
    for g, w in zip(gm(*inputs), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # a pattern the callback lets through still fires
    assert apply_patterns(gm.graph, [_variant()], deferred=lambda p: None).hits


def test_cpu_graphs_defer_nothing(inputs):
    from k3compile.settings import Options
    from k3compile.stages.fuse import deferral

    gm = _graph(lambda *a: _mix(*a), *inputs)
    assert deferral(gm.graph, Options()) is None  # CPU: the references are the kernels


def test_contract_counts_the_fused_collective_as_either_mix():
    import collections

    from k3compile.stages.contract import PLANS, _stand_in

    # TP2, the layer after a dense one: both mixes follow an all-reduce and take its fused form
    ops = collections.Counter({"allreduce_attn_res_mix_norm": 2, "fb_kda_decode": 1})
    counted = _stand_in(ops, PLANS["kda_moe"])
    assert counted == {"oproj_attn_res_mix_norm": 1, "attn_res_mix_norm": 1, "fb_kda_decode": 1}
    # the usual case: the post-attention mix only; a surplus counts as the first target
    assert _stand_in(collections.Counter({"allreduce_attn_res_mix_norm": 1}),
                     PLANS["kda_moe"]) == {"oproj_attn_res_mix_norm": 1}
    assert _stand_in(collections.Counter({"allreduce_attn_res_mix_norm": 3}),
                     PLANS["dense"]) == {"oproj_attn_res_mix_norm": 3}


def test_contract_does_not_count_deferred_ops_as_missing():
    import collections

    from k3compile.stages.contract import LayerReport

    lr = LayerReport(1, "kda_moe", {"kda_decode": 1, "rms_norm": 1},
                     collections.Counter({"rms_norm": 1}), collections.Counter())
    assert lr.shortfall == {"kda_decode": 1}
    deferred = LayerReport(1, "kda_moe", {"kda_decode": 1, "rms_norm": 1},
                           collections.Counter({"rms_norm": 1}), collections.Counter(),
                           deferred=frozenset({"kda_decode"}))
    assert deferred.shortfall == {}


def test_the_graph_is_sorted_only_where_a_replacement_reads_a_later_node(inputs, monkeypatch):
    """A sort is O(graph) (tens of thousands of placeholders with per-expert parameters): the
    engine sorts after a replacement only where one of its nodes reads a node defined after it
    (mla_q_absorb: W_UK is cut from kv_b after q is split), and the values stay."""
    from k3compile.patterns import mla_q_absorb
    from tests.fusions import test_mla_q_absorb as absorb_case
    from tests.fusions.pattern_checks import assert_rewritten_equal, rewrite

    sorts = []
    sort = inductor.stable_topological_sort
    monkeypatch.setattr(inductor, "stable_topological_sort",
                        lambda graph: sorts.append(graph) or sort(graph))
    gm = _graph(lambda *a: _mix(*a), *inputs)
    want = gm(*inputs)
    report = apply_patterns(gm.graph, [_variant()])
    gm.recompile()
    assert report.counts == {"attn_res_mix_norm[blocks=1,delta]": 1} and not sorts
    for g, w in zip(gm(*inputs), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    args = absorb_case._args(1, 1)
    gm, report = rewrite(absorb_case.absorb, args, mla_q_absorb.patterns(), joint=True)
    assert len(sorts) == 1
    assert_rewritten_equal(gm, report, absorb_case.absorb, args, "k3.mla_q_absorb")
