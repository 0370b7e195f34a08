"""Rule `noop_view`: a view to its input's own shape (Moonshot's `scores.view(N, -1)` on [N, E]
scores, `reshape(3, -1)` of [3, 8]) is its input; bit-equal results. Real reshapes, round trips
through another shape and expands (matmul's lowering) stay."""

from __future__ import annotations

import pytest
import torch

from .compiled import assert_same_values, canonicalize, targets
from .router_spellings import FUSED, SPELLINGS, Router, fused, only, routed_equal, tokens

aten = torch.ops.aten
VIEWS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
         "aten.expand.default"}

SPELLED = {
    "view_minus_one": lambda x: torch.sigmoid(x).view(-1, 8) + 1,
    "view_rows": lambda x: torch.sigmoid(x).view(x.shape[0], -1) * x,
    "reshape_rows": lambda x: (2 * x).reshape(3, -1).exp(),  # (reshape(x.shape): no node)
}
LOOKALIKES = {
    "real_reshape": lambda x: (2 * x).view(8, 3).exp(),
    "round_trip": lambda x: (2 * x).view(3, 1, 8).view(3, 8).exp(),  # our model's KDA f_a/f_b
    "expand_own_shape": lambda x: (2 * x).expand(3, 8).exp(),  # matmul's lowering writes it
}


def _x():
    return {"x": torch.randn(3, 8, generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_view_to_the_own_shape_is_the_tensor(name):
    c = canonicalize(SPELLED[name], _x(), **only("noop_view"))
    assert c.counts["noop_view"] == 1
    assert not VIEWS & set(targets(c.after))
    assert_same_values(c, rel=0)


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_other_views_stay(name):
    c = canonicalize(LOOKALIKES[name], _x(), **only("noop_view"))
    assert c.counts["noop_view"] == 0
    assert VIEWS & set(targets(c.after))
    assert_same_values(c, rel=0)


def test_moonshot_router_scores_are_the_sigmoid():
    c = canonicalize(None, {"x": tokens()}, module=Router(SPELLINGS["moonshot"]),
                     **only("noop_view"))
    assert c.counts["noop_view"] == 1
    sigmoid = next(n for n in c.after.graph.nodes if n.target is aten.sigmoid.default)
    assert {u.target for u in sigmoid.users} == {aten.add.Tensor, aten.gather.default}
    assert_same_values(c, rel=0)


@pytest.mark.parametrize("name", ["moonshot", "grouped_top2"])
def test_router_fuses_under_the_backend(name):
    ops, got, want = fused(SPELLINGS[name])
    assert all(ops[op] == 1 for op in FUSED), ops
    routed_equal(got, want)
