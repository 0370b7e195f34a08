"""Rule slice_split: slices that tile one dim of a tensor (`x[..., :C]`, `x[..., C:]`, `narrow`,
a part read twice) become one split_with_sizes; bit-equal results. Slices that leave part of the
dim unread, overlap or step stay, and so do slices of a graph input (a weight's rows)."""

from __future__ import annotations

import pytest
import torch

from .compiled import assert_same_values, canonicalize, targets
from .router_spellings import only

SPLIT, SLICE = "aten.split_with_sizes.default", "aten.slice.Tensor"

def _parts(fn):
    """y = 2x read through fn(y) (slices of one node)."""
    return lambda x: fn(2 * x)


SPELLED = {
    "two_parts": _parts(lambda y: y[..., :5].exp() + y[..., 5:].sum(-1, keepdim=True)),
    "three_parts_dim1": _parts(lambda y: torch.cat([y[:, 6:], y[:, :2] * 2, y[:, 2:6]], 1)),
    "part_read_twice": _parts(lambda y: y[:, :4].exp() * y[:, :4].sin() + y[:, 4:].sum()),
    "narrow": _parts(lambda y: y.narrow(1, 0, 3).cos().sum() + y.narrow(1, 3, 5).sin().sum()),
    "negative_bounds": _parts(lambda y: y[:, :-2].exp().sum() + y[:, -2:].sum()),
}
LOOKALIKES = {
    "part_unread": _parts(lambda y: y[..., 2:].exp()),  # a cache's tail hist[..., T:]
    "gap": _parts(lambda y: y[:, :3].exp().sum() + y[:, 4:].sum()),
    "overlap": _parts(lambda y: y[:, :5].exp().sum() + y[:, 3:].sum()),
    "strided": _parts(lambda y: y[:, ::2].exp().sum() + y[:, 1::2].sum()),
    "weight_rows": lambda x: x[:4].exp().sum() + x[4:].sum(),  # x an input: a weight's rows
}


def _x():
    return {"x": torch.randn(3, 8, generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_tiling_slices_are_one_split(name):
    c = canonicalize(SPELLED[name], _x(), **only("slice_split"))
    assert c.counts["slice_split"] == 1
    assert SPLIT in targets(c.after) and SLICE not in targets(c.after)
    assert_same_values(c, rel=0)


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_other_slices_stay(name):
    c = canonicalize(LOOKALIKES[name], _x(), **only("slice_split"))
    assert c.counts["slice_split"] == 0
    assert SPLIT not in targets(c.after)
    assert_same_values(c, rel=0)
