"""cast_merge: a dtype cast after a head merge (spell8's KDA output, kept fp32 through its gated
norm: `o.reshape(B, T, H·K).to(x.dtype)`) becomes the cast, then the merge, as the red-team
spelling and the kda_decode pattern's `o_fp32` variant write it; bit-equal. Casts after other
views (a split, a merge of other dims, a size-1 "head" dim) stay, and so does a merge also read
in its own dtype."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import cast_merge
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite

B, T, H, K = 2, 1, 4, 8


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


MERGES = {
    "reshape": lambda o: (o * 2).reshape(B, T, H * K).to(torch.bfloat16),
    "view": lambda o: (o * 2).view(B, T, -1).to(torch.bfloat16),
    "flatten": lambda o: (o * 2).flatten(-2).to(torch.bfloat16),
    "to_half": lambda o: (o * 2).reshape(B, T, H * K).half(),
}


def _canonical(o):
    return (o * 2).to(torch.bfloat16).reshape(B, T, H * K)


@pytest.mark.parametrize("name", sorted(MERGES))
def test_cast_after_a_head_merge_moves_in_front(name):
    args = (_x(B, T, H, K),)
    before, after, n = rewrite(cast_merge, MERGES[name], *args)
    assert n == 1
    casts = [n for n in after.graph.nodes if n.target is cast_merge.CAST]
    assert casts and not any(cast_merge._head_merge(c.args[0]) for c in casts)
    assert_same(before, after, args)


def test_the_cast_then_merge_is_the_canonical_form():
    args = (_x(B, T, H, K),)
    _, after, _ = rewrite(cast_merge, MERGES["reshape"], *args)
    _, canonical, n = rewrite(cast_merge, _canonical, *args)
    assert n == 0 and ops(after) == ops(canonical)


LOOKALIKES = {
    "split": (lambda x: (x * 2).view(B, T, H, K).to(torch.bfloat16), (B, T, H * K)),
    "leading_dims": (lambda x: (x * 2).view(B * T, H * K).to(torch.bfloat16), (B, T, H * K)),
    # [B, T, 1, O] -> [B, T, O] merges no heads
    "size_one_head": (lambda x: (x * 2).view(B, T, H).to(torch.bfloat16), (B, T, 1, H)),
    "merge_not_last": (lambda x: (x * 2).view(B, T * H, K).to(torch.bfloat16), (B, T, H, K)),
    # an upcast after the merge (the canonical form's casts of inputs are upcasts after views)
    "upcast": (lambda x: (x.bfloat16() * 2).reshape(B, T, H * K).float(), (B, T, H, K)),
    # MXFP4 nibbles merged, then cast to int (the red-team spelling's dequant: nibble_unpack's)
    "int_codes": (lambda x: torch.stack(((x.abs() * 40).to(torch.uint8) & 0xF,
                                         (x.abs() * 40).to(torch.uint8) >> 4), -1).flatten(-2)
                  .to(torch.int32), (B, T, H)),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_casts_after_other_views_stay(name):
    fn, shape = LOOKALIKES[name]
    args = (_x(*shape),)
    before, after, n = rewrite(cast_merge, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)


def test_a_merge_also_read_in_its_own_dtype_stays():
    def fn(o):
        flat = (o * 2).reshape(B, T, H * K)
        return flat.to(torch.bfloat16), flat.exp()  # the fp32 merge is read too

    args = (_x(B, T, H, K),)
    before, after, n = rewrite(cast_merge, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)
