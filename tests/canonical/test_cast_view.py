"""cast_view: a dtype cast after a head split (Moonshot's `rearrange(x, '... (h d) -> ... h d')`
in bf16, then fla's `.float()`) becomes the cast, then the split, as `k3compile/math.py` and the
kda_decode pattern write it; bit-equal. Casts after other views (a linear's `[N, O] -> [B, T, O]`,
a size-1 "head" dim, a merge of dims) stay, and so does a split also read in its own dtype."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import cast_view
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite

B, T, H, K = 2, 1, 4, 8


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


SPLITS = {
    "view": lambda x: x.view(B, T, H, K).float().pow(2),
    "reshape_minus_one": lambda x: x.reshape(B, T, -1, K).float().sigmoid(),
    "unflatten": lambda x: x.unflatten(-1, (H, K)).float() * 2,
    "to_half": lambda x: x.float().view(B, T, H, K).to(torch.float16) + 1,  # fp32 -> fp16 too
}


def _canonical(x):
    return x.float().view(B, T, H, K).pow(2)


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_cast_after_a_head_split_moves_in_front(name):
    args = (_x(B, T, H * K),)
    before, after, n = rewrite(cast_view, SPLITS[name], *args)
    assert n == 1
    casts = [n for n in after.graph.nodes if n.target is cast_view.CAST]
    assert casts and not any(cast_view._head_split(c.args[0]) for c in casts)
    assert any(u.target is torch.ops.aten.view.default for c in casts for u in c.users)
    assert_same(before, after, args)


def test_the_split_then_cast_is_the_canonical_form():
    args = (_x(B, T, H * K),)
    _, after, _ = rewrite(cast_view, SPLITS["view"], *args)
    _, canonical, n = rewrite(cast_view, _canonical, *args)
    assert n == 0 and ops(after) == ops(canonical)


LOOKALIKES = {
    # a linear's rows back to [B, T, O] before `b.float()`: the patterns bind the view itself
    "tokens_to_batch": (lambda x: x.view(B, T, H).float().sigmoid(), (B * T, H)),
    # at batch 1, [1, O] -> [1, 1, O] splits nothing
    "size_one_head": (lambda x: x.view(1, 1, H).float().sigmoid(), (1, H)),
    "merge": (lambda x: x.view(B, T, H * K).float().sigmoid(), (B, T, H, K)),
    "split_not_last": (lambda x: x.view(B, T, H, K).float().sigmoid(), (B, T * H, K)),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_casts_after_other_views_stay(name):
    fn, shape = LOOKALIKES[name]
    args = (_x(*shape),)
    before, after, n = rewrite(cast_view, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)


def test_a_split_also_read_in_its_own_dtype_keeps_its_view():
    def fn(x):
        heads = x.view(B, T, H, K)
        return heads.float().exp(), heads * 2  # the bf16 heads are read too

    args = (_x(B, T, H * K),)
    before, after, n = rewrite(cast_view, fn, *args)
    assert n == 1 and ops(after)["view"] == 2
    assert_same(before, after, args)
