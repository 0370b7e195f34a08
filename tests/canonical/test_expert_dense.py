"""Rule `expert_dense`: routed MXFP4 experts written as a static loop over ALL E experts (each
on every row, `stack[e]`), weighted by a dense [N, E] routing matrix zero off the top-k ids (a
one-hot contraction, weights scattered into zeros, a `where` over a top-k mask) become the k
chosen experts, the canonical `math.mxfp4_experts` over `routing.gather(1, ids)`, equal to the
loop up to fp32 summation order. Look-alikes stay: a matrix not zero off the top-k (a softmax
over all experts, a one-hot of ids that are no top-k), a loop over fewer experts, one expert
computing otherwise (another beta, another expert's W2), bf16 sums. And the one deliberate
difference from eager: an unchosen expert whose output is inf (E8M0 scale 255) makes eager's
row NaN (0 * inf); the rewritten form does not compute it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import expert_dense as rule
from k3compile.math import e2m1_table, mxfp4_experts, situ
from k3compile.math import mxfp4_dequant as dequant

from .rule_checks import targets, trace

E, INTER, LATENT, K = 6, 64, 96, 3
BETAS = (4.0, 25.0)


def _inputs(rows, dtype=torch.float32, seed=0):
    """z [N, L], router scores [N, E], the E2M1 table, W1, W3, W2 as (packed, scale) stacks."""
    gen = torch.Generator().manual_seed(seed + rows)
    stacks = []
    for out, width in ((INTER, LATENT), (INTER, LATENT), (LATENT, INTER)):
        for lo, hi, cols in ((0, 256, width // 2), (120, 130, width // 32)):
            stacks.append(torch.randint(lo, hi, (E, out, cols), generator=gen, dtype=torch.uint8))
    return [torch.randn(rows, LATENT, generator=gen).to(dtype),
            torch.rand(rows, E, generator=gen), e2m1_table(dtype=dtype), *stacks]


def _top(scores, k=K):
    ids = torch.topk(scores, k).indices
    w = scores.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20)


def _expert(z, e, lut, w1p, w1s, w3p, w3s, w2p, w2s, betas=BETAS, w2e=None):
    w1 = dequant(w1p[e], w1s[e], lut)                            # [I, L]
    w3 = dequant(w3p[e], w3s[e], lut)
    w2e = e if w2e is None else w2e
    w2 = dequant(w2p[w2e], w2s[w2e], lut)                        # [L, I]
    return situ(z @ w1.t(), z @ w3.t(), *betas) @ w2.t()


def _loop(z, routing, lut, stacks, column, experts=E, odd=None):
    acc = torch.zeros(z.shape[0], z.shape[1])
    for e in range(experts):
        kwargs = odd[1] if odd is not None and odd[0] == e else {}
        acc = acc + column(routing, e) * _expert(z, e, lut, *stacks, **kwargs).float()
    return acc


def one_hot(z, scores, lut, *stacks, **kw):
    """spell8: the dense matrix as the one-hot contraction, columns `routing[:, e:e+1]`."""
    ids, w = _top(scores)
    routing = (F.one_hot(ids, E).float() * w.unsqueeze(-1)).sum(-2)
    return _loop(z, routing, lut, stacks, lambda r, e: r[:, e:e + 1], **kw)


def scattered(z, scores, lut, *stacks, **kw):
    """Megatron's probs: the weights scattered into zeros, columns `routing[:, e, None]`."""
    ids, w = _top(scores)
    routing = torch.zeros_like(scores).scatter(1, ids, w)
    return _loop(z, routing, lut, stacks, lambda r, e: r[:, e, None], **kw)


def masked(z, scores, lut, *stacks, **kw):
    """The scores kept where a top-k mask is set (route_mask's mask), unnormalised."""
    ids = torch.topk(scores, K).indices
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter(1, ids, True)
    routing = torch.where(mask, scores, 0.0)
    return _loop(z, routing, lut, stacks, lambda r, e: r[:, e:e + 1], **kw)


def canonical(z, scores, lut, *stacks, routing_of=None):
    ids = torch.topk(scores, K).indices
    return mxfp4_experts(z, ids, routing_of(scores).gather(1, ids), lut, *stacks, *BETAS,
                         None if z.dtype == torch.float32 else torch.float32)


SPELLINGS = {"one_hot": one_hot, "scattered": scattered, "masked": masked}


def _rewritten(fn, args):
    gm = trace(fn, args)
    n = rule.apply(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm, n


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_dense_loop_becomes_the_k_chosen_experts(spelling, rows):
    fn, args = SPELLINGS[spelling], _inputs(rows)
    gm, n = _rewritten(fn, args)
    assert n == 1
    # the canonical experts: the stacks gathered by the [N, k] ids, none selected per expert
    assert "aten.select.int" not in targets(gm) and "aten.index.Tensor" in targets(gm)
    got, want = torch.utils._pytree.tree_leaves(gm(*args))[0], fn(*args)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_bf16_experts_with_an_fp32_sum():
    """spell8 in bf16: dequant and GEMMs in bf16, each expert's output `.float()`, the sum fp32
    (the canonical experts with out_dtype fp32)."""
    args = _inputs(3, torch.bfloat16)
    gm, n = _rewritten(one_hot, args)
    assert n == 1
    got, want = torch.utils._pytree.tree_leaves(gm(*args))[0], one_hot(*args)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_the_rewrite_is_the_canonical_experts_over_the_gathered_weights():
    """Against math.mxfp4_experts itself (not just the loop): the same values."""
    args = _inputs(4)
    gm, _ = _rewritten(scattered, args)
    want = canonical(*args, routing_of=lambda s: torch.zeros_like(s).scatter(1, *_top(s)))
    torch.testing.assert_close(torch.utils._pytree.tree_leaves(gm(*args))[0], want,
                               rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_an_unchosen_inf_expert_makes_eager_nan_and_the_rewrite_finite():
    """The one difference from eager, decided (module docstring): an expert no row chose whose
    weights are inf (E8M0 scale 255 = 2^128) gives eager 0 * inf = NaN on every row; the
    rewritten graph computes only the chosen experts, so its rows are the sparse sum."""
    args = _inputs(2)
    scores = args[1]
    scores[:, 5] = -1.0  # expert 5 is never chosen
    args[4][5] = 255     # its W1 scales: inf
    gm, n = _rewritten(one_hot, args)
    assert n == 1
    eager, got = one_hot(*args), torch.utils._pytree.tree_leaves(gm(*args))[0]
    assert eager.isnan().all(dim=1).all()
    assert got.isfinite().all()
    ids, w = _top(scores)
    want = canonical(*args, routing_of=lambda s: torch.zeros_like(s).scatter(1, ids, w))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_a_chosen_inf_expert_is_non_finite_in_both():
    args = _inputs(2)
    ids, _ = _top(args[1])
    args[4][int(ids[0, 0])] = 255
    gm, _ = _rewritten(one_hot, args)
    eager, got = one_hot(*args), torch.utils._pytree.tree_leaves(gm(*args))[0]
    assert not eager[0].isfinite().all() and not got[0].isfinite().all()


# ---- look-alikes left alone ---------------------------------------------------------------------


def softmax_routing(z, scores, lut, *stacks):
    """Every expert weighted (a softmax over all E): not zero off any top-k."""
    routing = torch.softmax(scores, -1)
    return _loop(z, routing, lut, stacks, lambda r, e: r[:, e:e + 1])


def one_hot_of_other_ids(z, scores, lut, *stacks):
    """A one-hot of ids that are no top-k's (shifted: distinct here, but not provably so)."""
    ids, w = _top(scores)
    routing = (F.one_hot((ids + 1) % E, E).float() * w.unsqueeze(-1)).sum(-2)
    return _loop(z, routing, lut, stacks, lambda r, e: r[:, e:e + 1])


def one_hot_plus_scores(z, scores, lut, *stacks):
    """The one-hot contraction plus the scores: nonzero off the top-k."""
    ids, w = _top(scores)
    routing = (F.one_hot(ids, E).float() * w.unsqueeze(-1)).sum(-2) + scores
    return _loop(z, routing, lut, stacks, lambda r, e: r[:, e:e + 1])


def one_hot_squared(z, scores, lut, *stacks):
    """A product of two one-hots: zero off the top-k too, but not the contraction the rule
    proves (quadratic in the one-hot on random values): left alone, safely."""
    ids, w = _top(scores)
    hot = F.one_hot(ids, E).float()
    routing = (hot * hot * w.unsqueeze(-1)).sum(-2)
    return _loop(z, routing, lut, stacks, lambda r, e: r[:, e:e + 1])


def fewer_experts(z, scores, lut, *stacks):
    return one_hot(z, scores, lut, *stacks, experts=E - 1)


def other_beta(z, scores, lut, *stacks):
    return one_hot(z, scores, lut, *stacks, odd=(3, {"betas": (2.0, 25.0)}))


def other_w2(z, scores, lut, *stacks):
    return one_hot(z, scores, lut, *stacks, odd=(2, {"w2e": 0}))


def bf16_sum(z, scores, lut, *stacks):
    ids, w = _top(scores)
    routing = (F.one_hot(ids, E).float() * w.unsqueeze(-1)).sum(-2).to(z.dtype)
    acc = torch.zeros_like(z)
    for e in range(E):
        acc = acc + routing[:, e:e + 1] * _expert(z, e, lut, *stacks)
    return acc


LOOKALIKES = {"softmax_routing": (softmax_routing, torch.float32),
              "one_hot_of_other_ids": (one_hot_of_other_ids, torch.float32),
              "one_hot_plus_scores": (one_hot_plus_scores, torch.float32),
              "one_hot_squared": (one_hot_squared, torch.float32),
              "fewer_experts": (fewer_experts, torch.float32),
              "other_beta": (other_beta, torch.float32),
              "other_w2": (other_w2, torch.float32),
              "bf16_sum": (bf16_sum, torch.bfloat16)}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_are_left_alone(name):
    fn, dtype = LOOKALIKES[name]
    args = _inputs(3, dtype)
    gm = trace(fn, args)
    before = targets(gm)
    assert rule.apply(gm.graph) == 0
    gm.recompile()
    assert targets(gm) == before
    got, want = torch.utils._pytree.tree_leaves(gm(*args))[0], fn(*args)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the trace's decompositions, not the rule
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
