"""Rule `expert_slots`: routed MXFP4 experts written as a loop over the top-k slots (per slot the
experts of one id per row, bmm GEMMs, SiTU, the slot's weight read from a dense [N, E] routing
matrix or from the [N, k] weights, an fp32 running sum) become the k slots at once, op for op
the form `math.mxfp4_experts` has, equal to the loop to fp32 summation order; look-alikes (a loop
over fewer slots, another activation, a slot that reads another tensor, a bf16 expert output
rounded otherwise) stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import expert_slots as rule
from k3compile.math import e2m1_table, mxfp4_experts, situ
from k3compile.math import mxfp4_dequant as dequant

from .rule_checks import targets, trace

E, INTER, LATENT, K = 6, 64, 96, 3
BETAS = (4.0, 25.0)


def _inputs(rows, dtype=torch.float32):
    """z [N, L], router scores [N, E], ids [N, k] (top-k: distinct per row), the E2M1 table,
    W1, W3, W2 as (packed, scale) stacks."""
    gen = torch.Generator().manual_seed(rows)
    scores = torch.rand(rows, E, generator=gen)
    stacks = []
    for out, width in ((INTER, LATENT), (INTER, LATENT), (LATENT, INTER)):
        stacks += [torch.randint(0, 256, (E, out, width // 2), generator=gen, dtype=torch.uint8),
                   torch.randint(120, 130, (E, out, width // 32), generator=gen,
                                 dtype=torch.uint8)]
    return [torch.randn(rows, LATENT, generator=gen).to(dtype), scores,
            torch.topk(scores, K).indices, e2m1_table(dtype=dtype), *stacks]


def _routed(scores, ids):
    top = scores.gather(1, ids)
    return top / (top.sum(-1, keepdim=True) + 1e-20)


def _slot(z, ids_j, lut, w1p, w1s, w3p, w3s, w2p, w2s, act=situ):
    w1 = dequant(w1p[ids_j], w1s[ids_j], lut)                     # [N, I, L]
    w3 = dequant(w3p[ids_j], w3s[ids_j], lut)
    w2 = dequant(w2p[ids_j], w2s[ids_j], lut)                     # [N, L, I]
    x = z.unsqueeze(1)
    h = act(torch.bmm(x, w1.transpose(1, 2)), torch.bmm(x, w3.transpose(1, 2)), *BETAS)
    return torch.bmm(h, w2.transpose(1, 2)).squeeze(1)


def dense_matrix(z, scores, ids, lut, *stacks, slots=K, act=situ):
    """Megatron-style: the slot weights read back from a dense [N, E] routing matrix."""
    probs = torch.zeros_like(scores).scatter(1, ids, _routed(scores, ids))
    acc = torch.zeros(z.shape[0], LATENT)
    for j in range(slots):
        acc = acc + probs.gather(1, ids[:, j:j + 1]) * _slot(z, ids[:, j], lut, *stacks,
                                                              act=act).float()
    return acc


def topk_weights(z, scores, ids, lut, *stacks):
    """Mixtral-style: the slot weights are columns of the [N, k] routed weights."""
    weights, acc = _routed(scores, ids), 0.0
    for j in range(K):
        acc = acc + weights[:, j, None] * _slot(z, ids[:, j], lut, *stacks).float()
    return acc


def canonical_dense(z, scores, ids, lut, *stacks):
    probs = torch.zeros_like(scores).scatter(1, ids, _routed(scores, ids))
    return mxfp4_experts(z, ids, probs.gather(1, ids), lut, *stacks, *BETAS)


def canonical_topk(z, scores, ids, lut, *stacks):
    return mxfp4_experts(z, ids, _routed(scores, ids), lut, *stacks, *BETAS)


SPELLINGS = {"dense_matrix": (dense_matrix, canonical_dense),
             "topk_weights": (topk_weights, canonical_topk)}


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_slot_loop_becomes_the_k_slots_at_once(spelling, rows):
    fn, canonical = SPELLINGS[spelling]
    args = _inputs(rows)
    gm = trace(fn, args)
    assert "aten.select.int" in targets(gm)
    assert rule.apply(gm.graph) == 1
    gm.recompile()
    # the experts as the canonical trace has them: no slot is selected any more
    assert "aten.select.int" not in targets(gm)
    experts = {"aten.bmm.default", "aten.tanh.default", "aten.index.Tensor"}
    assert ([t for t in targets(gm) if t in experts]
            == [t for t in targets(trace(canonical, args)) if t in experts])
    got, want = gm(*args), fn(*args)
    got, want = (torch.utils._pytree.tree_leaves(t)[0] for t in (got, want))
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max())


# ---- look-alikes left alone ---------------------------------------------------------------------

def _silu_glu(g, u, *_):
    return torch.nn.functional.silu(g) * u


def _extra(z, scores, ids, lut, *stacks):
    """Each slot's output also gets its expert's row of another tensor (a bias): not the
    experts the canonical form computes."""
    bias = scores.t()[:, :1].expand(E, LATENT)  # [E, L]
    probs = torch.zeros_like(scores).scatter(1, ids, _routed(scores, ids))
    acc = torch.zeros(z.shape[0], LATENT)
    for j in range(K):
        y = _slot(z, ids[:, j], lut, *stacks) + bias[ids[:, j]]
        acc = acc + probs.gather(1, ids[:, j:j + 1]) * y.float()
    return acc


CASES = {
    "fewer_slots": lambda *a: dense_matrix(*a, slots=K - 1),
    "silu_glu": lambda *a: dense_matrix(*a, act=_silu_glu),
    "extra_read": _extra,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_look_alikes_are_left_alone(case):
    args, fn = _inputs(3), CASES[case]
    gm = trace(fn, args)
    before = targets(gm)
    assert rule.apply(gm.graph) == 0
    assert targets(gm) == before


def test_bf16_experts_rounded_otherwise_are_left_alone():
    """bf16 experts summed into fp32 without the canonical finalize's bf16 rounding."""
    args = _inputs(3, torch.bfloat16)
    gm = trace(dense_matrix, args)
    assert rule.apply(gm.graph) == 0
