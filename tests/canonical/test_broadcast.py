"""Rule `broadcast`: a weight given the leading dims broadcasting adds anyway (`unsqueeze(0)`,
`view(1, -1)`, `[None]`, `expand_as`) enters its elementwise op as itself; bit-equal results.
Left alone: a dim that is not leading, a result whose shape or dtype the extra dims decide, and
computed tensors (our model's own views, which the patterns hold)."""

from __future__ import annotations

import pytest
import torch

from .compiled import assert_same_values, canonicalize, targets
from .router_spellings import FUSED, SPELLINGS, Router, fused, only, routed_equal, tokens

aten = torch.ops.aten
VIEWS = {"aten.unsqueeze.default", "aten.view.default", "aten.expand.default",
         "aten.slice.Tensor"}

SPELLED = {
    "unsqueeze": lambda s, b, c, h, z: s + b.unsqueeze(0),
    "view": lambda s, b, c, h, z: s - b.view(1, -1),
    "none_index": lambda s, b, c, h, z: s * b[None],
    "expand_as": lambda s, b, c, h, z: torch.maximum(s, b.expand_as(s)),
    "unsqueeze_twice": lambda s, b, c, h, z: (2 * s).unsqueeze(0) / b.unsqueeze(0).unsqueeze(0),
    "where": lambda s, b, c, h, z: torch.where(c, s, b.unsqueeze(0)),
    "cast_then_unsqueeze": lambda s, b, c, h, z: s + h.float().unsqueeze(0),  # a bf16 weight
}


def _args():
    g = torch.Generator().manual_seed(0)
    s, b = torch.randn(3, 8, generator=g), torch.randn(8, generator=g)
    return {"s": s, "b": b, "c": s > 0, "h": b.bfloat16(), "z": b[0].clone()}


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_leading_dims_of_a_weight_are_left_to_broadcasting(name):
    c = canonicalize(SPELLED[name], _args(), **only("broadcast"))
    assert c.counts["broadcast"] == 1
    weights = [n for n in c.after.graph.nodes
               if n.op == "placeholder" and tuple(n.meta["val"].shape) == (8,)]
    cast = torch.ops.prims.convert_element_type.default
    weights += [u for w in weights for u in w.users if u.target is cast]
    ops = {str(u.target) for w in weights for u in w.users} - {str(cast)}
    assert ops and not ops & VIEWS, ops  # the weight (or its cast) enters the op as itself
    assert_same_values(c, rel=0)


LOOKALIKES = {
    # [E, 1] against [E, E]: a column, not a row (another result)
    "inner_dim": lambda s, b, c, h, z: s[:1].T * s[:1] + b.unsqueeze(1),
    # both [E]: the [1, E] result's leading dim comes from the unsqueeze
    "result_rank": lambda s, b, c, h, z: b.unsqueeze(0) + b,
    # 0-dim: [1] takes part in type promotion, a 0-dim tensor does not (bf16 + fp32 -> fp32)
    "zero_dim": lambda s, b, c, h, z: s.bfloat16() + z.unsqueeze(0),
    # a computed tensor (our model views those itself: mla_decode's arange(S).view(1, 1, -1))
    "computed": lambda s, b, c, h, z: s + (2 * b).unsqueeze(0),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_keep_their_views(name):
    c = canonicalize(LOOKALIKES[name], _args(), **only("broadcast"))
    assert c.counts["broadcast"] == 0
    assert {"aten.unsqueeze.default", "aten.view.default"} & set(targets(c.after))
    assert_same_values(c, rel=0)


def test_router_bias_row_is_the_bias():
    c = canonicalize(None, {"x": tokens()}, module=Router(SPELLINGS["hf"]), **only("broadcast"))
    assert c.counts["broadcast"] == 1
    add = next(n for n in c.after.graph.nodes if n.target is aten.add.Tensor)
    assert add.args[1].op == "placeholder" and tuple(add.args[1].meta["val"].shape) == (16,)
    assert_same_values(c, rel=0)


@pytest.mark.parametrize("name", ["hf", "view_bias", "expand_bias"])
def test_router_fuses_under_the_backend(name):
    ops, got, want = fused(SPELLINGS[name])
    assert all(ops[op] == 1 for op in FUSED), ops
    routed_equal(got, want)
