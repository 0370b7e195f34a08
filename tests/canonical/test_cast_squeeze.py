"""cast_squeeze: an upcast between a bmm's output views and the view that drops their size-1 dims
(spell9 bf16: its vmapped experts' output cast to fp32 before the reshape the rules composed)
becomes the view, then the upcast, as an einsum followed by `.float()` (the moe_experts
pattern's FC2) is written; bit-equal. Then spell9's bf16 experts fuse as moe_experts' fp32_out
variant. Look-alikes stay: an upcast of no bmm's output, a downcast, a view moving a non-unit
dim or merges rows, and an upcast also read before its view."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import cast_squeeze
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite
from tests.conftest import rel_err

N, K, I, L = 3, 4, 16, 8


def _x(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _fc2(h, w):
    """[N·k, 1, I] x [N·k, I, L] -> [N, k, L, 1] (the einsum lowering's view and permute)"""
    return torch.bmm(h, w).view(N, K, 1, L).permute(0, 1, 3, 2)


def spell9(h, w, weights):
    """the vmapped experts' output upcast, then its size-1 dim dropped; the weighted finalize"""
    y = _fc2(h, w).float().view(N, K, L)
    return (weights.unsqueeze(-1) * y).sum(1)


def reshape_kept(h, w, weights):
    """the same with reshape, to [N, k, 1, L] (a size-1 dim moved: no value moves)"""
    return _fc2(h, w).float().reshape(N, K, 1, L) * 2


def _canonical(h, w, weights):
    y = _fc2(h, w).view(N, K, L).float()
    return (weights.unsqueeze(-1) * y).sum(1)


def _args():
    return (_x(N * K, 1, I), _x(N * K, I, L, seed=1), _x(N, K, dtype=torch.float32, seed=2))


@pytest.mark.parametrize("fn", [spell9, reshape_kept])
def test_the_upcast_moves_after_the_squeeze(fn):
    args = _args()
    before, after, n = rewrite(cast_squeeze.RULE, fn, *args)
    assert n == 1
    cast = next(x for x in after.graph.nodes if x.target is cast_squeeze.CAST)
    assert cast.args[0].target in cast_squeeze.RESHAPES  # the view first, then the cast
    assert_same(before, after, args)


def test_the_view_then_upcast_is_the_canonical_form():
    args = _args()
    _, after, _ = rewrite(cast_squeeze.RULE, spell9, *args)
    _, canonical, n = rewrite(cast_squeeze.RULE, _canonical, *args)
    assert n == 0 and ops(after) == ops(canonical)


def _not_a_bmm(h, w, weights):
    return (h * 2).float().view(N, K, I)  # [N·k, 1, I]: the upcast of a pointwise op


def _downcast(h, w, weights):
    return _fc2(h.float(), w.float()).bfloat16().view(N, K, L)


def _moves_a_dim(h, w, weights):
    return _fc2(h, w).float().reshape(N, L, K)  # not a squeeze: K and L regrouped


def _merges_rows(h, w, weights):
    return _fc2(h, w).float().reshape(N * K, L)  # [N, k, L, 1] -> [N·k, L]: rows merged


def _read_before(h, w, weights):
    y = _fc2(h, w).float()
    return y.view(N, K, L), y.exp()  # the fp32 [N, k, L, 1] is read too


@pytest.mark.parametrize("fn", [_not_a_bmm, _downcast, _moves_a_dim, _merges_rows,
                                _read_before])
def test_look_alikes_stay(fn):
    args = _args()
    before, after, n = rewrite(cast_squeeze.RULE, fn, *args)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 3])
def test_spell9_bf16_experts_fuse(T):
    """spell9's bf16 `moe_step` (layer 1's weights; its jmp policy keeps the finalize in fp32):
    moe_experts' fp32_out variant hits on the canonical graph, which equals the unrewritten one
    (rules) and eager within bf16's rounding of the experts' sums"""
    from tests.canonical.compiled import assert_same_values, run
    from tests.canonical.test_combine_rows import _fused, _Spell9Moe

    model = _Spell9Moe(torch.bfloat16)
    x = _x(2, T, model.cfg.hidden_size, seed=T)
    with torch.no_grad():
        want = model(x)
    c, gm, report = _fused(None, {"x": x}, model)
    assert c.counts["combine_rows"] == 1 and c.counts["cast_squeeze"] == (T == 1), c.counts
    # N = 2 T rows: the variant traced at 3 rows (its permutes place the rows as the site does;
    # the one-row trace matched too while permute dims were free, before session 36)
    assert [h.pattern for h in report.hits] == ["moe_experts[bfloat16,rows,fp32_out]"]
    assert_same_values(c, rel=1e-5)
    (got,) = run(gm, c.inputs)[:1]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 1e-2
