"""Helpers of the pattern tests: trace a function as the backend sees it, apply patterns, and
check a rewrite's values against the unfused function."""

from __future__ import annotations

import torch

import k3compile.ops  # noqa: F401  (the k3 ops exist before patterns trace)
from k3compile.rewrite import RewriteReport, apply_patterns, inductor


def graph(fn, *args, joint: bool = False):
    """fn's functional ATen graph, one fake mode for all meta as in Inductor; `joint` also runs
    Inductor's joint-graph passes, which the model's graph has been through (einsum folding)."""
    trace = inductor.fwd_only_joint if joint else inductor.fwd_only_fake
    gm = trace(fn, list(args))
    gm.meta["real_inputs"] = list(args)  # as the pipeline hands them over (constant tables)
    return gm


def rewrite(fn, args, patterns, joint: bool = False, kernels_only: bool = False):
    """(graph module after the patterns, report); `kernels_only` as on a GPU graph."""
    gm = graph(fn, *args, joint=joint)
    report = apply_patterns(gm.graph, patterns, kernels_only=kernels_only)
    gm.recompile()
    return gm, report


def targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def assert_rewritten_equal(gm, report: RewriteReport, fn, args, op: str):
    """One hit, the op in the graph, meta on every node, and values equal to eager bit for bit
    (every op's CPU implementation rounds like the model code)."""
    assert len(report.hits) == 1, report
    assert f"{op}.default" in targets(gm)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
    want = torch.utils._pytree.tree_leaves(fn(*args))
    got = torch.utils._pytree.tree_leaves(gm(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def assert_variant_rewrite(gm, report: RewriteReport, fn, args, op: str, pattern: str,
                           tail: tuple) -> torch.fx.Node:
    """`assert_rewritten_equal`, the one hit being the variant `pattern`, whose op call ends in
    the arguments `tail` (its eps and flags); the call's node, for further checks."""
    assert_rewritten_equal(gm, report, fn, args, op)
    assert [h.pattern for h in report.hits] == [pattern]
    node = next(n for n in gm.graph.nodes if str(n.target) == f"{op}.default")
    assert node.args[-len(tail):] == tail
    return node


def assert_fused_on_gpu_graph(gm, report: RewriteReport, fn, args, op: str) -> None:
    """A rewrite with `kernels_only` (as on a GPU graph): kernel `op` took the site, none was
    deferred to Inductor for it, and the graph's values are close to the unfused function's."""
    assert [h.op for h in report.hits] == [f"k3.{op}"], report
    assert op not in report.deferred
    for got, want in zip(gm(*args), fn(*args), strict=True):
        torch.testing.assert_close(got, want)


def assert_near_miss(report: RewriteReport, pattern_prefix: str, *words: str):
    """No hit, and a near miss of the pattern whose reason names the failed condition."""
    assert not report.hits, report.hits
    misses = [nm for nm in report.near_misses if nm.pattern.startswith(pattern_prefix)]
    assert misses, f"no near miss of {pattern_prefix} reported: {report.near_misses}"
    reasons = " | ".join(nm.reason for nm in misses)
    assert all(nm.reason for nm in misses)
    for w in words:
        assert w.lower() in reasons.lower(), reasons
    return misses


def with_kernel_limits(monkeypatch, op: str) -> None:
    """Register `op`'s CUDA kernel limits in the op registry for one test, as `register_all`
    does on a GPU machine (patterns read them there, never from a kernel module)."""
    import importlib

    from k3compile.ops import registry

    kernel = importlib.import_module(f"k3compile.kernels.{op}")
    monkeypatch.setitem(registry._entries, op, registry.KernelEntry(op, kernel.refusal))
