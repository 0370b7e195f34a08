"""Rule `group_limit`: a group-limited top-k whose mask keeps every expert (one group, or every
group kept) routes on the scores themselves; the rewritten graph routes as the unrewritten one,
and the full backend fuses the router. A real group limit keeps its mask."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import group_limit

from .compiled import assert_same_values, canonicalize, targets
from .router_spellings import (
    FUSED,
    LOOKALIKES,
    SPELLINGS,
    Router,
    fused,
    only,
    routed_equal,
    tokens,
)

aten = torch.ops.aten
GROUPED = [name for name in SPELLINGS if name.startswith("grouped")]
MASKING = {"aten.where.self", "aten.masked_fill.Scalar", "aten.scatter.value"}


def _canonicalized(route):
    return canonicalize(None, {"x": tokens()}, module=Router(route), **only("group_limit"))


def _choice(gm) -> torch.fx.Node:
    """The input of the top-k whose indices are gathered (the experts' choice)."""
    gather = next(n for n in gm.graph.nodes if n.target is aten.gather.default)
    return gather.args[2].args[0].args[0]


@pytest.mark.parametrize("name", GROUPED)
def test_mask_that_keeps_every_expert_is_dropped(name):
    c = _canonicalized(SPELLINGS[name])
    assert c.counts["group_limit"] == 1
    assert not MASKING & set(targets(c.after))
    assert _choice(c.after).target is aten.add.Tensor  # topk(scores + bias), the router's choice
    assert_same_values(c, rel=0)


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_real_group_limit_keeps_its_mask(name):
    c = _canonicalized(LOOKALIKES[name])
    assert c.counts["group_limit"] == 0
    assert MASKING & set(targets(c.after)) or "aten.mul.Tensor" in targets(c.after)
    assert_same_values(c, rel=0)


def _scaled(scores, mask):
    return scores.masked_fill(mask, 0.0) * 1.0, scores.masked_fill(scores > 0, 0.0)


def test_input_masks_and_literal_factors_stay():
    scores, mask = torch.rand(3, 8), torch.rand(3, 8) > 0.5
    c = canonicalize(_scaled, {"scores": scores, "mask": mask})
    assert c.counts["group_limit"] == 0
    assert targets(c.after).count("aten.where.self") == 2  # masked_fill as decomposed
    assert "aten.mul.Tensor" in targets(c.after)  # `* 1.0` is a scaling, not a mask
    assert_same_values(c, rel=0)


def test_known_value_reads_fills_scatters_and_casts():
    c = _canonicalized(SPELLINGS["grouped_top2"])
    scatter = next(n for n in c.before.graph.nodes if n.target is aten.scatter.value)
    assert group_limit.known_value(scatter.args[0]) == 0.0  # zeros_like(group_scores)
    assert group_limit.known_value(scatter) == 1.0  # [n, 1]: every element written
    lookalike = _canonicalized(LOOKALIKES["grouped_top2_2_groups"])
    scatter = next(n for n in lookalike.before.graph.nodes if n.target is aten.scatter.value)
    assert group_limit.known_value(scatter) is None  # one of two groups written per row


@pytest.mark.parametrize("name", GROUPED)
def test_router_fuses_under_the_backend(name):
    ops, got, want = fused(SPELLINGS[name])
    assert all(ops[op] == 1 for op in FUSED), ops
    assert ops["aten.topk.default"] == 0
    routed_equal(got, want)


def test_real_group_limit_is_not_fused_as_a_router():
    ops, got, want = fused(LOOKALIKES["grouped_top2_2_groups"])
    assert ops["k3.moe_route.default"] == 0
    routed_equal(got, want)
