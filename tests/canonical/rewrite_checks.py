"""Helpers of the view-rule tests: compare a rule's rewritten graph (`rule_checks.rewrite`) with
the unrewritten one on the same inputs."""

from __future__ import annotations

import collections

import torch

from tests.fusions.pattern_checks import targets


def assert_same(before, after, args) -> None:
    """Bit-equal outputs of the same dtype and shape (the rules move views, compute nothing)."""
    want, got = before(*args), after(*args)
    want, got = torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def ops(gm) -> collections.Counter:
    return collections.Counter(t.removeprefix("aten.").removesuffix(".default")
                               for t in targets(gm))
