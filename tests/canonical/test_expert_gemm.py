"""Rule `expert_gemm`: per-token expert GEMMs written as bmm / matmul matrix-vector products
become the lowered einsums of `math.mxfp4_experts` (FC1 "nl,nkil->nki" where x is the token
broadcast over k, FC2 "nki,nkli->nkl" otherwise): the same graph the einsum traces to, equal to
the original; real GEMMs and other layouts stay."""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import expert_gemm as rule

from .rule_checks import assert_same, targets, trace

E, K, OUT, WIDTH = 5, 2, 64, 96
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # bf16: the GEMMs' last rounding may differ


def _bmm(w, x):
    n, k, out, width = w.shape
    return torch.bmm(w.reshape(n * k, out, width), x.reshape(n * k, width, 1)).view(n, k, out)


def _matmul(w, x):
    return torch.matmul(w, x.unsqueeze(-1)).squeeze(-1)


def _bmm_x_first(w, x):  # x·Wᵀ
    n, k, out, width = w.shape
    return torch.bmm(x.reshape(n * k, 1, width),
                     w.reshape(n * k, out, width).transpose(1, 2)).view(n, k, out)


def _matmul_x_first(w, x):
    return torch.matmul(x.unsqueeze(-2), w.transpose(-1, -2)).squeeze(-2)


def _vmap(w, x):  # spell9: one expert's matrix-vector product vmapped over tokens and slots
    return torch.vmap(torch.vmap(torch.matmul))(w, x)


GEMMS = {"bmm": _bmm, "matmul": _matmul, "bmm_x_first": _bmm_x_first,
         "matmul_x_first": _matmul_x_first,
         "einsum_nkoi": lambda w, x: torch.einsum("nkoi,nki->nko", w, x), "vmap": _vmap}


def _per_token(w, z):  # the k experts' rows stacked: [N, k*O, I] x [N, I, 1]
    return torch.bmm(w.flatten(1, 2), z.unsqueeze(-1)).view(w.shape[0], K, -1)


def _per_token_matmul(w, z):
    return torch.matmul(w.flatten(1, 2), z.unsqueeze(-1)).squeeze(-1).unflatten(1, (K, OUT))


def _per_token_x_first(w, z):  # z·Wᵀ: [N, 1, I] x [N, I, k*O]
    return torch.bmm(z.unsqueeze(1), w.flatten(1, 2).transpose(1, 2)).view(w.shape[0], K, OUT)


PER_TOKEN = {"bmm": _per_token, "matmul": _per_token_matmul, "bmm_x_first": _per_token_x_first}


def _fc1(gemm):
    def f(z, experts, ids):
        return gemm(experts[ids], z.unsqueeze(-2).expand(z.shape[0], K, z.shape[1]))
    return f


def _fc2(gemm):
    return lambda x, experts, ids: gemm(experts[ids], x)


def _inputs(fc1, rows, dtype):
    """x (the token [N, I] or [N, k, I]), the stacked experts [E, O, I], the routed ids [N, k]."""
    x = torch.randn(rows, WIDTH) if fc1 else torch.randn(rows, K, WIDTH)
    return [x.to(dtype), torch.randn(E, OUT, WIDTH).to(dtype), torch.randint(0, E, (rows, K))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("gemm", sorted(GEMMS))
@pytest.mark.parametrize("fc1", [True, False], ids=["fc1", "fc2"])
def test_matrix_vector_becomes_the_einsum(fc1, gemm, rows, dtype):
    fn = (_fc1 if fc1 else _fc2)(GEMMS[gemm])
    args = _inputs(fc1, rows, dtype)
    gm = trace(fn, args)
    assert rule.apply(gm.graph) == 1
    gm.recompile()
    spec = "nl,nkil->nki" if fc1 else "nki,nkli->nkl"
    canonical = trace(lambda x, e, i: torch.einsum(spec, x, e[i]), args)
    assert targets(gm) == targets(canonical)  # the pattern's form, op for op
    assert_same(gm(*args), canonical(*args))
    got, want = gm(*args), fn(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype] * want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("gemm", sorted(PER_TOKEN))
def test_per_token_product_becomes_the_fc1_einsum(gemm, rows, dtype):
    """One token z per bmm batch, its k experts' weights stacked as [N, k*O, I]: FC1."""
    def fn(z, experts, ids):
        return PER_TOKEN[gemm](experts[ids], z)

    args = _inputs(True, rows, dtype)
    gm = trace(fn, args)
    assert rule.apply(gm.graph) == 1
    gm.recompile()
    canonical = trace(lambda z, e, i: torch.einsum("nl,nkil->nki", z, e[i]), args)
    assert targets(gm) == targets(canonical)
    assert_same(gm(*args), canonical(*args))
    got, want = gm(*args), fn(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype] * want.abs().max())


def _merged(w, x, columns=1):
    return torch.bmm(w.reshape(-1, OUT, WIDTH), x.reshape(-1, WIDTH, 1).expand(-1, WIDTH, columns))


LOOK_ALIKES = {  # (fn, extra inputs); every fn gets (experts [E, O, I], ids [N, k], *extra)
    "real_gemm": (lambda e, i, x: _merged(e[i], x, 4), [torch.randn(3, K, WIDTH)]),
    "batch_orders_differ": (lambda e, i, x: _merged(e[i], x).view(3, K, OUT),
                            [torch.randn(K, 3, WIDTH)]),  # x is [k, N, I]
    "flat_weight": (lambda e, i, x: _merged(e[i.flatten()], x).squeeze(-1),
                    [torch.randn(3 * K, WIDTH)]),
    "other_view": (lambda e, i, x: _merged(e[i], x).flatten(), [torch.randn(3, K, WIDTH)]),
    # the shapes of an expert GEMM, but no routed gather: KDA's state [B, H, d, d] times a vector
    "state_times_vector": (lambda e, i, state, slots, q: _merged(state[slots], q).view(3, K, OUT),
                           [torch.randn(4, K, OUT, WIDTH), torch.tensor([2, 0, 1]),
                            torch.randn(3, K, WIDTH)]),
    "ungathered_weight": (lambda e, i, w, x: _merged(w, x).view(3, K, OUT),
                          [torch.randn(3, K, OUT, WIDTH), torch.randn(3, K, WIDTH)]),
    # per token ([N, k*O, I] x [N, I, 1]): a real GEMM, rows stacked [O, k] not [k, O], the
    # product read back flat, KDA's state [B, H*d, d] times q, an ungathered weight
    "per_token_real_gemm": (lambda e, i, z: torch.bmm(e[i].flatten(1, 2), z),
                            [torch.randn(3, WIDTH, 4)]),
    "per_token_rows_o_k": (lambda e, i, z: torch.bmm(e[i].transpose(1, 2).flatten(1, 2),
                                                     z.unsqueeze(-1)).view(3, K, OUT),
                           [torch.randn(3, WIDTH)]),
    "per_token_flat_result": (lambda e, i, z: torch.bmm(e[i].flatten(1, 2), z.unsqueeze(-1)),
                              [torch.randn(3, WIDTH)]),
    "per_token_state_times_vector": (
        lambda e, i, state, slots, q: torch.bmm(state[slots].flatten(1, 2),
                                                q.unsqueeze(-1)).view(3, K, OUT),
        [torch.randn(4, K, OUT, WIDTH), torch.tensor([2, 0, 1]), torch.randn(3, WIDTH)]),
    # torch.vmap over something else: KDA's state rows times q, vmapped over batch and heads
    "vmap_state_times_vector": (
        lambda e, i, state, slots, q: _vmap(state[slots], q),
        [torch.randn(4, K, OUT, WIDTH), torch.tensor([2, 0, 1]), torch.randn(3, K, WIDTH)]),
    "per_token_ungathered_weight": (
        lambda e, i, w, z: torch.bmm(w.flatten(1, 2), z.unsqueeze(-1)).view(3, K, OUT),
        [torch.randn(3, K, OUT, WIDTH), torch.randn(3, WIDTH)]),
}


def test_vmapped_experts_take_the_einsums():
    """spell9's experts: one expert's SiTU-GLU for one token, `torch.vmap`ped over the slots and
    the tokens (the token broadcast over the slots, `in_dims=None`): FC1, FC3 and FC2 (read
    back through vmap's `squeeze.dims`) all become the canonical einsums; values kept."""
    def expert(w1, w3, w2, z):
        return w2 @ (torch.sigmoid(w1 @ z) * (w3 @ z))

    def fn(z, w1s, w3s, w2s, ids):
        return torch.vmap(torch.vmap(expert, in_dims=(0, 0, 0, None)))(w1s[ids], w3s[ids],
                                                                        w2s[ids], z)

    args = [torch.randn(3, WIDTH), torch.randn(E, OUT, WIDTH), torch.randn(E, OUT, WIDTH),
            torch.randn(E, WIDTH, OUT), torch.randint(0, E, (3, K))]
    gm = trace(fn, args)
    assert "aten.squeeze.dims" in targets(gm)
    assert rule.apply(gm.graph) == 3
    gm.recompile()
    assert "aten.squeeze.dims" not in targets(gm)
    got, want = gm(*args), fn(*args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max())


@pytest.mark.parametrize("case", sorted(LOOK_ALIKES))
def test_look_alikes_are_left_alone(case):
    fn, extra = LOOK_ALIKES[case]
    args = [torch.randn(E, OUT, WIDTH), torch.randint(0, E, (3, K)), *extra]
    gm = trace(fn, args)
    before = targets(gm)
    assert "aten.bmm.default" in before
    assert rule.apply(gm.graph) == 0 and targets(gm) == before


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("spec", ["nl,nkil->nki", "nki,nkli->nkl"])
def test_canonical_einsums_are_left_as_they_are(spec, rows):
    args = _inputs(spec.startswith("nl"), rows, torch.float32)
    gm = trace(lambda x, e, i: torch.einsum(spec, x, e[i]), args)
    before = targets(gm)
    assert rule.apply(gm.graph) == 0 and targets(gm) == before


def test_only_the_spliced_nodes_take_the_site_module_stack():
    """Session 23 (spell6): the splice gave the site's nn_module_stack to every node of the graph
    that had none, e.g. the token embedding at the model's top level, so the per-layer plan
    counted every AttnRes op reading it in the MoE layer of the site."""
    args = _inputs(False, 3, torch.float32)
    gm = trace(lambda x, e, i: (_fc2(_bmm)(x, e, i), x * 2), args)
    stack = {"ffn": ("layers.1.ffn", object)}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not torch.ops.aten.mul.Tensor:
            n.meta["nn_module_stack"] = stack
    (top,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert rule.apply(gm.graph) == 1
    assert "nn_module_stack" not in top.meta
    new = [n for n in gm.graph.nodes if n.op == "call_function" and n is not top]
    assert new and all(n.meta.get("nn_module_stack") == stack for n in new)
    gm.recompile()
    got, want = gm(*args), (_fc2(_bmm)(*args), args[0] * 2)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6 * want[0].abs().max())
