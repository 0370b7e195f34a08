"""cast_select: per-token upcasts of a bf16 / fp16 value's selects (spell6's bf16 delta rule reads
`v[:, i].float()` token by token) become one upcast of the value, then the selects, as
`k3compile/math.py` and the kda_decode pattern write it (`v.float().view(B, T, H, D)`, then
`v[:, t]`); bit-equal. Look-alikes stay: a select also read in the low dtype, an index left
unread, selects on two dims, casts to two dtypes, a downcast, a same-width cast, the value also
read whole."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import cast_select, cast_view
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite

B, H, D = 2, 3, 8


def _x(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _recurrence(rows):
    """a running sum over the tokens' fp32 rows, each also returned (a delta rule's reads)"""
    s, outs = torch.zeros_like(rows[0]), []
    for r in rows:
        s = s * 0.5 + r
        outs.append(s.exp())
    return s, torch.stack(outs, 1)


def spell6(v):
    """spell6's `v[:, i].float()` per token, on [B, T, H, D]"""
    return _recurrence([v[:, i].float() for i in range(v.shape[1])])


def heads_fp16(v):
    """per-head fp16 reads on dim 2, upcast, the last one by a negative index"""
    return _recurrence([v[:, :, i].float() for i in (0, 1, -1)])


def twice(v):
    """each token's select read by two casts (k read twice in a delta rule)"""
    rows = [v[:, i] for i in range(v.shape[1])]
    return _recurrence([r.float() for r in rows]), [r.float() * 2 for r in rows]


@pytest.mark.parametrize("fn,T,dtype", [(spell6, 1, torch.bfloat16), (spell6, 3, torch.bfloat16),
                                        (heads_fp16, 2, torch.float16),
                                        (twice, 2, torch.bfloat16)])
def test_the_upcast_moves_before_the_selects(fn, T, dtype):
    args = (_x(B, T, H, D, dtype=dtype),)
    before, after, n = rewrite(cast_select.RULE, fn, *args)
    assert n == 1
    (cast,) = (x for x in after.graph.nodes if x.target is cast_select.CAST)
    assert cast.args[0].op == "placeholder" and cast.args[1] == torch.float32  # one cast, whole
    assert {u.target for u in cast.users} == {torch.ops.aten.select.int}
    assert_same(before, after, args)


def _flat_spell6(v):
    """spell6's form on a flat [B, T, H·D] value split into heads (the q|k|v conv's cut)"""
    heads = v.view(B, v.shape[1], H, D)
    return _recurrence([heads[:, i].float() for i in range(v.shape[1])])


def _flat_canonical(v):
    heads = v.float().view(B, v.shape[1], H, D)
    return _recurrence([heads[:, i] for i in range(v.shape[1])])


@pytest.mark.parametrize("T", [1, 3])
def test_with_cast_view_it_is_the_canonical_form(T):
    """then cast_view moves the whole upcast before the head split: the pattern's order"""
    args = (_x(B, T, H * D),)
    before, after, n = rewrite(cast_select.RULE, _flat_spell6, *args)
    assert n == 1 and cast_view.RULE.apply(after.graph) == 1
    after.graph.eliminate_dead_code()
    after.recompile()
    _, canonical, m = rewrite(cast_select.RULE, _flat_canonical, *args)
    assert m == 0 and ops(after) == ops(canonical)
    assert_same(before, after, args)


def _read_low(v):
    rows = [v[:, i] for i in range(v.shape[1])]
    return _recurrence([r.float() for r in rows]), rows[0] * 2  # a select read in bf16 too


def _index_unread(v):
    return _recurrence([v[:, i].float() for i in (0, 2)])  # token 1 never read


def _two_dims(v):
    # [B, T, D] = [B, H, D] at T = H = 3: a head's select joins the tokens'
    return _recurrence([v[:, 0].float(), v[:, 1].float(), v[:, 2].float(), v[:, :, 0].float()])


def _two_dtypes(v):
    return _recurrence([v[:, 0].float(), v[:, 1].double().float(), v[:, 2].float()])


def _downcast(v):
    return _recurrence([v.float()[:, i].bfloat16() for i in range(3)])


def _same_width(v):
    return _recurrence([v[:, i].half().float() for i in range(3)])


def _read_whole(v):
    return spell6(v), v.sum()  # the bf16 value read whole too


@pytest.mark.parametrize("fn", [_read_low, _index_unread, _two_dims, _two_dtypes, _downcast,
                                _same_width, _read_whole])
def test_look_alikes_stay(fn):
    args = (_x(B, 3, H, D),)
    before, after, n = rewrite(cast_select.RULE, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)


def test_the_canonical_form_is_no_site():
    args = (_x(B, 3, H, D),)
    _, _, n = rewrite(cast_select.RULE, lambda v: _recurrence(list(v.float().unbind(1))), *args)
    assert n == 0
