"""cast_cat: a cat of pieces cut from fp32 upcasts of bf16 / fp16 values (spell11's conv taps with
its checkpoint's bf16 weights: `taps.float()`, then qkv_split's cut and re-concatenation) becomes
the pieces cut from those values, concatenated, then one upcast, as the kda_decode pattern writes
its taps; bit-equal. A cat with a piece that is no upcast, upcasts from two dtypes, a downcast, a
piece computed from its upcast and an upcast also read elsewhere stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import cast_cat
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite

W, K = 8, 4


def _x(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _taps_split(x):  # spell11 + qkv_split: the upcast taps cut by a split, concatenated again
    return torch.cat(x.float().reshape(3 * W, 1, K).split(W, 0)) * 2


def _taps_slices(x):  # the same cut by slices (spell11 under weight_cast's fp32 masters)
    t = x.float().reshape(3 * W, 1, K)
    return torch.cat([t[:W], t[W:2 * W], t[2 * W:]]) * 2


def _two_sources(a, b):  # one upcast per piece (cast_split's form), viewed
    return torch.cat([a.float().view(W, 1, K), b.float().unsqueeze(1)], 0) * 2


def _transposed(x):  # permuted pieces on another dim
    t = x.float().t()
    return torch.cat([t[:, :W], t[:, 2 * W:]], 1) * 2


SPELLINGS = {
    "taps_split": (_taps_split, lambda x: torch.cat(x.reshape(3 * W, 1, K).split(W, 0)).float() * 2,
                   ((3 * W, K),)),
    "taps_slices": (_taps_slices, None, ((3 * W, K),)),
    "two_sources": (_two_sources, lambda a, b: torch.cat(
        [a.view(W, 1, K), b.unsqueeze(1)], 0).float() * 2, ((W, K), (W, K))),
    "transposed": (_transposed, None, ((3 * W, K),)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_a_cat_of_upcast_pieces_is_one_upcast_after_the_cat(name, dtype):
    fn, canonical, shapes = SPELLINGS[name]
    args = tuple(_x(*s, dtype=dtype, seed=i) for i, s in enumerate(shapes))
    before, after, n = rewrite(cast_cat, fn, *args)
    assert n == 1
    (cat,) = [n for n in after.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert cat.meta["val"].dtype == dtype
    assert [u.target for u in cat.users] == [cast_cat.CAST]
    assert ops(after)["prims.convert_element_type"] == 1
    assert_same(before, after, args)
    if canonical is not None:  # the kda_decode pattern's order, op for op
        _, form, m = rewrite(cast_cat, canonical, *args)
        assert m == 0 and ops(after) == ops(form)


LOOKALIKES = {
    # an fp32 master beside an upcast half: the cat is fp32 by its own values
    "fp32_piece": (lambda a, b: torch.cat([a.float(), b]) * 2, (torch.bfloat16, torch.float32)),
    "two_dtypes": (lambda a, b: torch.cat([a.float(), b.float()]) * 2,
                   (torch.bfloat16, torch.float16)),
    # a downcast of fp32 pieces: the kda_decode patterns round before cutting (cast_split's note)
    "downcast": (lambda a, b: torch.cat([a.bfloat16(), b.bfloat16()]) * 2,
                 (torch.float32, torch.float32)),
    "computed_piece": (lambda a, b: torch.cat([a.float().exp(), b.float()]) * 2,
                       (torch.bfloat16, torch.bfloat16)),
    "fp64": (lambda a, b: torch.cat([a.double(), b.double()]) * 2,
             (torch.bfloat16, torch.bfloat16)),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_other_cats_stay(name):
    fn, dtypes = LOOKALIKES[name]
    args = tuple(_x(W, K, dtype=d, seed=i) for i, d in enumerate(dtypes))
    before, after, n = rewrite(cast_cat, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)


@pytest.mark.parametrize("reader", ["upcast", "split"])
def test_a_chain_also_read_elsewhere_stays(reader):
    """the upcast (or the split of it) also read outside the cat would be computed twice"""
    def fn(x):
        t = x.float().reshape(3 * W, 1, K)
        pieces = t.split(W, 0)
        other = t.sum() if reader == "upcast" else pieces[0].exp()
        return torch.cat(pieces[1:]) * 2, other

    args = (_x(3 * W, K),)
    before, after, n = rewrite(cast_cat, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)
