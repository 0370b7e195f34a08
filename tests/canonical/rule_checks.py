"""Helpers of the canonical-rule tests: trace a function as the backend sees it (functionalised,
decomposed, Inductor's joint-graph passes), with the real inputs handed over as stage
`canonicalize` does, apply a rule, and compare a rewritten graph with the original function."""

from __future__ import annotations

import torch
from torch.func import functionalize

import k3compile.ops  # noqa: F401  (the k3 ops exist before anything traces)
from k3compile.rewrite import inductor
from tests.fusions import pattern_checks


def trace(fn, args) -> torch.fx.GraphModule:
    gm = inductor.fwd_only_joint(functionalize(fn), list(args))
    gm.meta["real_inputs"] = list(args)
    return gm


def rewrite(rule, fn, *args, joint: bool = False):
    """(unrewritten graph, rewritten graph, sites) of fn traced twice as the patterns' tests trace
    it (`joint`: through Inductor's joint-graph passes too), `rule` applied to the second, its
    dead code removed and the graph linted."""
    before, after = (pattern_checks.graph(fn, *args, joint=joint) for _ in range(2))
    n = rule.apply(after.graph)
    after.graph.eliminate_dead_code()
    after.graph.lint()
    after.recompile()
    return before, after, n


def rewritten(fn, args, *rules) -> tuple[torch.fx.GraphModule, list[int]]:
    """(fn traced on args with `rules` applied in turn, linted, how many sites each rewrote)."""
    gm = trace(fn, args)
    counts = [rule.apply(gm.graph) for rule in rules]
    gm.graph.lint()
    gm.recompile()
    return gm, counts


def targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def assert_same(got, want):
    """Equal bit for bit (NaN where NaN), dtype and shape included."""
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want),
                    strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def assert_one_site_becomes(gm, count: int, fn, canonical, args, *, gone=(), same_ops=True):
    """One site rewritten (count) into canonical's form (op for op with canonical traced on args,
    where same_ops), none of the targets in `gone` left, and gm equal bit for bit to fn (the
    spelling) and to canonical on args."""
    assert count == 1
    if same_ops:
        assert targets(gm) == targets(trace(canonical, args))  # the pattern's form, op for op
    assert not set(gone) & set(targets(gm))
    assert_same(gm(*args), fn(*args))
    assert_same(gm(*args), canonical(*args))
