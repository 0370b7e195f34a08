"""Rule `expert_slots`: routed MXFP4 experts written as a loop over the top-k slots (per slot the
experts of one id per row, bmm GEMMs, SiTU, the slot's weight read from a dense [N, E] routing
matrix or from the [N, k] weights, an fp32 running sum) become the k slots at once, op for op
the form `math.mxfp4_experts` has, equal to the loop to fp32 summation order, at the tests' small
sizes and at K3's (TP16 and TP1 ranks: proven structurally, slot 0 evaluated at smaller sizes,
checked op for op against the canonical trace: no N*k*I*L dequant); look-alikes (a loop over
fewer slots, another activation, a slot that reads another tensor, another beta, another stack or
another row, a bf16 expert output rounded otherwise) stay."""

from __future__ import annotations

import time

import pytest
import torch

from k3compile.canonical import expert_slots as rule
from k3compile.canonical.expert_gather import same_graph
from k3compile.math import e2m1_table, mxfp4_experts, situ
from k3compile.math import mxfp4_dequant as dequant

from .rule_checks import targets, trace

E, INTER, LATENT, K = 6, 64, 96, 3
BETAS = (4.0, 25.0)
# K3's routed experts per rank: E experts, the top k, latent L, intermediate I (spec §3.3)
TP16 = {"experts": 896, "inter": 192, "latent": 3584, "k": 16}
TP1 = {"experts": 896, "inter": 3072, "latent": 3584, "k": 16}


def _inputs(rows, dtype=torch.float32, experts=E, inter=INTER, latent=LATENT, k=K, cheap=False):
    """z [N, L], router scores [N, E], ids [N, k] (top-k: distinct per row), the E2M1 table,
    W1, W3, W2 as (packed, scale) stacks; `cheap`: the stacks one byte each, expanded (for
    tracing at K3's sizes, which reads no value)."""
    gen = torch.Generator().manual_seed(rows)
    scores = torch.rand(rows, experts, generator=gen)
    stacks = []
    for out, width in ((inter, latent), (inter, latent), (latent, inter)):
        for lo, hi, cols in ((0, 256, width // 2), (120, 130, width // 32)):
            size = (experts, out, cols)
            stacks.append(torch.full((1, 1, 1), lo, dtype=torch.uint8).expand(size) if cheap
                          else torch.randint(lo, hi, size, generator=gen, dtype=torch.uint8))
    return [torch.randn(rows, latent, generator=gen).to(dtype), scores,
            torch.topk(scores, k).indices, e2m1_table(dtype=dtype), *stacks]


def _routed(scores, ids):
    top = scores.gather(1, ids)
    return top / (top.sum(-1, keepdim=True) + 1e-20)


def _slot(z, ids_j, lut, w1p, w1s, w3p, w3s, w2p, w2s, act=situ, betas=BETAS):
    w1 = dequant(w1p[ids_j], w1s[ids_j], lut)                     # [N, I, L]
    w3 = dequant(w3p[ids_j], w3s[ids_j], lut)
    w2 = dequant(w2p[ids_j], w2s[ids_j], lut)                     # [N, L, I]
    x = z.unsqueeze(1)
    h = act(torch.bmm(x, w1.transpose(1, 2)), torch.bmm(x, w3.transpose(1, 2)), *betas)
    return torch.bmm(h, w2.transpose(1, 2)).squeeze(1)


def dense_matrix(z, scores, ids, lut, *stacks, slots=None, act=situ, odd=None):
    """Megatron-style: the slot weights read back from a dense [N, E] routing matrix. `odd`:
    (j or "every", how slot j's call differs) for the look-alikes."""
    probs = torch.zeros_like(scores).scatter(1, ids, _routed(scores, ids))
    acc = torch.zeros(z.shape[0], z.shape[1])
    for j in range(ids.shape[1] if slots is None else slots):
        args, kwargs = (z, ids[:, j], lut, *stacks), {"act": act}
        if odd is not None and odd[0] in (j, "every"):
            args, kwargs = odd[1](args, kwargs)
        acc = acc + probs.gather(1, ids[:, j:j + 1]) * _slot(*args, **kwargs).float()
    return acc


def topk_weights(z, scores, ids, lut, *stacks):
    """Mixtral-style: the slot weights are columns of the [N, k] routed weights."""
    weights, acc = _routed(scores, ids), 0.0
    for j in range(ids.shape[1]):
        acc = acc + weights[:, j, None] * _slot(z, ids[:, j], lut, *stacks).float()
    return acc


def dequant_first(z, scores, ids, lut, w1p, w1s, w3p, w3s, w2p, w2s):
    """Every slot's weights dequantised first (slot 0's in another order: W2 first), then the
    slots' GEMMs: the slots' nodes in different graph orders (as the spell5 graph's spliced
    dequants are)."""
    def weights(j):
        stacks = [(w1p, w1s), (w3p, w3s), (w2p, w2s)]
        w = {k: dequant(p[ids[:, j]], s[ids[:, j]], lut)
             for k, (p, s) in sorted(enumerate(stacks), reverse=j == 0)}
        return w[0], w[1], w[2]

    probs = torch.zeros_like(scores).scatter(1, ids, _routed(scores, ids))
    experts = [weights(j) for j in range(ids.shape[1])]
    acc = torch.zeros(z.shape[0], z.shape[1])
    for j, (w1, w3, w2) in enumerate(experts):
        x = z.unsqueeze(1)
        h = situ(torch.bmm(x, w1.transpose(1, 2)), torch.bmm(x, w3.transpose(1, 2)), *BETAS)
        y = torch.bmm(h, w2.transpose(1, 2)).squeeze(1)
        acc = acc + probs.gather(1, ids[:, j:j + 1]) * y.float()
    return acc


def canonical_dense(z, scores, ids, lut, *stacks, out_dtype=None):
    probs = torch.zeros_like(scores).scatter(1, ids, _routed(scores, ids))
    return mxfp4_experts(z, ids, probs.gather(1, ids), lut, *stacks, *BETAS, out_dtype)


def canonical_topk(z, scores, ids, lut, *stacks, out_dtype=None):
    return mxfp4_experts(z, ids, _routed(scores, ids), lut, *stacks, *BETAS, out_dtype)


SPELLINGS = {"dense_matrix": (dense_matrix, canonical_dense),
             "topk_weights": (topk_weights, canonical_topk),
             "dequant_first": (dequant_first, canonical_dense)}


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


def test_slot_0_proven_at_smaller_sizes_equals_the_loop(monkeypatch):
    """The proof's smaller sizes (every budget exceeded): I, L, E replaced by smaller ones in
    slot 0's arguments; the rewrite still equals the loop at the real (here moderate) sizes."""
    monkeypatch.setattr(rule, "BUDGET", 0)
    sizes = {"experts": 12, "inter": 320, "latent": 448, "k": 3}
    seen = _record_sizes(monkeypatch)
    args = _inputs(2, **sizes)
    gm = trace(dense_matrix, args)
    assert rule.apply(gm.graph) == 1
    gm.recompile()
    assert seen == [{320: 160, 160: 80, 10: 5, 448: 224, 224: 112, 14: 7, 12: 6}]
    got, want = torch.utils._pytree.tree_leaves(gm(*args))[0], dense_matrix(*args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max())


def _record_sizes(monkeypatch) -> list:
    seen, evaluate = [], rule._slot_values

    def recording(region, inputs, term, sizes):
        seen.append(sizes)
        return evaluate(region, inputs, term, sizes)

    monkeypatch.setattr(rule, "_slot_values", recording)
    return seen


@pytest.mark.parametrize(("shard", "rows", "dtype"), [
    ("TP16", 4, torch.float32), ("TP16", 6, torch.float32), ("TP1", 4, torch.float32),
    ("TP16", 4, torch.bfloat16)])
@pytest.mark.parametrize("spelling", ["dense_matrix", "topk_weights"])
def test_k3_sizes(spelling, shard, rows, dtype, monkeypatch):
    """At K3's sizes (16 slots, 896 experts; 6 rows: N = I/32 at TP16, shrunk with it): slot 0
    is evaluated at I 160, L 224, E 17; the rewritten graph is the canonical trace op for op
    (its values: the positives above, at the tests' sizes, and the canonical op's own tests)."""
    fn, canonical = SPELLINGS[spelling]
    seen = _record_sizes(monkeypatch)
    args = _inputs(rows, dtype, cheap=True, **{"TP16": TP16, "TP1": TP1}[shard])
    gm, start = trace(fn, args), time.perf_counter()
    assert rule.apply(gm.graph) == 1
    print(f"{spelling} {shard}: {time.perf_counter() - start:.3f} s")
    inter, latent = TP16["inter"] if shard == "TP16" else TP1["inter"], 3584
    assert seen == [{inter: 160, inter // 2: 80, inter // 32: 5, latent: 224, latent // 2: 112,
                     latent // 32: 7, 896: 17}]
    (out,) = torch.utils._pytree.tree_leaves(next(iter(reversed(gm.graph.nodes))).args)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_dtype = None if dtype == torch.float32 else torch.float32
    assert same_graph(out, trace(lambda *a: canonical(*a, out_dtype=out_dtype), args),
                      placeholders)


def test_sizes_that_cannot_be_told_apart_are_left_alone(monkeypatch):
    """I/32 = k = 16: an int 16 of slot 0's arguments could be either; not shrunk, too large to
    evaluate as it is (the budget exceeded): left alone."""
    monkeypatch.setattr(rule, "BUDGET", 0)
    seen = _record_sizes(monkeypatch)
    gm = trace(dense_matrix, _inputs(2, cheap=True, **{**TP16, "inter": 512}))
    before = targets(gm)
    assert rule.apply(gm.graph) == 0
    assert targets(gm) == before and seen == []


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


def _another_beta(args, kwargs):
    return args, {**kwargs, "betas": (BETAS[0], BETAS[1] + 1)}


def _another_stack(args, kwargs):  # W1 and W3 swapped
    z, ids_j, lut, w1p, w1s, w3p, w3s, w2p, w2s = args
    return (z, ids_j, lut, w3p, w3s, w1p, w1s, w2p, w2s), kwargs


def _another_row(args, kwargs):  # each row gets the expert of the row before
    return (args[0], args[1].roll(1, 0), *args[2:]), kwargs


def _another_latent(args, kwargs):  # each row reads the latent of the row before
    return (args[0].roll(1, 0), *args[1:]), kwargs


# (how slot 1 differs, or the spelling); refused by the structure, or by slot 0's proof
CASES = {
    "fewer_slots": lambda *a: dense_matrix(*a, slots=K - 1),
    "silu_glu": lambda *a: dense_matrix(*a, act=_silu_glu),
    "extra_read": _extra,
    "another_beta": lambda *a: dense_matrix(*a, odd=(1, _another_beta)),
    "another_stack": lambda *a: dense_matrix(*a, odd=(1, _another_stack)),
    "another_row": lambda *a: dense_matrix(*a, odd=(1, _another_row)),
    "another_latent": lambda *a: dense_matrix(*a, odd=(1, _another_latent)),
    "every_slot_another_row": lambda *a: dense_matrix(*a, odd=("every", _another_row)),
}
STRUCTURAL = {"another_beta", "another_stack", "another_row", "another_latent"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_look_alikes_are_left_alone(case, monkeypatch):
    args, fn = _inputs(3), CASES[case]
    seen = _record_sizes(monkeypatch)
    gm = trace(fn, args)
    before = targets(gm)
    assert rule.apply(gm.graph) == 0
    assert targets(gm) == before
    if case in STRUCTURAL:
        assert seen == []  # refused before any evaluation


@pytest.mark.parametrize("odd", [_another_beta, _another_stack, _another_row])
def test_k3_sizes_look_alikes_refused_by_the_structure(odd, monkeypatch):
    seen = _record_sizes(monkeypatch)
    args = _inputs(4, cheap=True, **TP16)
    gm = trace(lambda *a: dense_matrix(*a, odd=(5, odd)), args)
    before = targets(gm)
    assert rule.apply(gm.graph) == 0
    assert targets(gm) == before and seen == []


def test_bf16_slots_summed_in_fp32_become_the_unrounded_finalize():
    """A bf16 latent, each slot's GEMMs in bf16, the slots summed in fp32 (spell5's bf16 loop):
    the canonical experts with `out_dtype` fp32 (the finalize's sum unrounded), op for op, equal
    to the loop to fp32 summation order."""
    args = _inputs(3, torch.bfloat16)
    gm = trace(dense_matrix, args)
    assert rule.apply(gm.graph) == 1
    gm.recompile()
    (out,) = torch.utils._pytree.tree_leaves(next(iter(reversed(gm.graph.nodes))).args)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    canonical = trace(lambda *a: canonical_dense(*a, out_dtype=torch.float32), args)
    assert same_graph(out, canonical, placeholders)
    got, want = torch.utils._pytree.tree_leaves(gm(*args))[0], dense_matrix(*args)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max())


def _bf16_sum(z, scores, ids, lut, *stacks):
    """The slots summed in bf16: each add rounds, the canonical finalize rounds once."""
    probs = torch.zeros_like(scores).scatter(1, ids, _routed(scores, ids)).to(z.dtype)
    acc = torch.zeros_like(z)
    for j in range(ids.shape[1]):
        acc = acc + probs.gather(1, ids[:, j:j + 1]) * _slot(z, ids[:, j], lut, *stacks)
    return acc


def _situ_in_bf16(gate, up, beta, linear_beta):
    """SiTU in the GEMMs' bf16 (the canonical one computes in fp32 and rounds once)."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (
        linear_beta * torch.tanh(up / linear_beta))


@pytest.mark.parametrize(("spelling", "structural"), [
    (_bf16_sum, True), (lambda *a: dense_matrix(*a, act=_situ_in_bf16), False)])
def test_bf16_experts_rounded_otherwise_are_left_alone(spelling, structural, monkeypatch):
    """A bf16 sum: refused from the adds' dtypes, before any evaluation; a slot rounding
    otherwise than the canonical experts (SiTU in bf16): by slot 0's evaluation."""
    seen = _record_sizes(monkeypatch)
    gm = trace(spelling, _inputs(3, torch.bfloat16))
    before = targets(gm)
    assert rule.apply(gm.graph) == 0
    assert targets(gm) == before and (seen == []) == structural
