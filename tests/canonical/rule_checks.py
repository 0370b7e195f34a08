"""Helpers of the canonical-rule tests: trace a function as the backend sees it (functionalised,
decomposed, Inductor's joint-graph passes), with the real inputs handed over as stage
`canonicalize` does, and compare a rewritten graph with the original function."""

from __future__ import annotations

import torch
from torch.func import functionalize

import k3compile.ops  # noqa: F401  (the k3 ops exist before anything traces)
from k3compile.rewrite import inductor


def trace(fn, args) -> torch.fx.GraphModule:
    gm = inductor.fwd_only_joint(functionalize(fn), list(args))
    gm.meta["real_inputs"] = list(args)
    return gm


def targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def assert_same(got, want):
    """Equal bit for bit (NaN where NaN), dtype and shape included."""
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want),
                    strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
