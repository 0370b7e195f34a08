"""state_matvec: a V-major state [B, H, V, K] read by `matmul(S, x.unsqueeze(-1))` (spell7's
reads) becomes `(S * x.unsqueeze(-2)).sum(-1)`, the read `state_transpose` takes; values within
fp32 summation order. Look-alikes stay: a K-major read `x^T S`, a product by a matrix, a
matrix-vector product of a tensor that is no gathered state."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import delta_einsum, state_matvec, state_transpose
from tests.canonical.rule_checks import rewrite, targets
from tests.conftest import rel_err

H, D, S = 3, 8, 5
aten = torch.ops.aten
_rewrite = functools.partial(rewrite, state_matvec, joint=True)


def _args(B=2, T=2):
    g = torch.Generator().manual_seed(0)
    n = torch.nn.functional.normalize
    return [torch.randn(S, H, D, D, generator=g), torch.tensor([3, 0][:B]),
            n(torch.randn(B, T, H, D, generator=g), dim=-1),
            n(torch.randn(B, T, H, D, generator=g), dim=-1), torch.randn(B, T, H, D, generator=g),
            torch.rand(B, T, H, D, generator=g), torch.rand(B, T, H, generator=g)]


def matmul_reads(buf, slots, q, k, v, a, beta):
    """spell7's delta rule (probe `add_outer`): V-major state, `matmul` reads"""
    s, outs = buf[slots], []
    for t in range(q.shape[1]):
        s = s * a[:, t].unsqueeze(-2)
        kv = torch.matmul(s, k[:, t].unsqueeze(-1)).squeeze(-1)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv)
        s = s + u.unsqueeze(-1) * k[:, t].unsqueeze(-2)
        outs.append(torch.matmul(s, q[:, t].unsqueeze(-1)).squeeze(-1))
    return torch.index_put(buf, (slots,), s), torch.stack(outs, 1)


def _close(after, before, args, tol=1e-6):
    leaves = torch.utils._pytree.tree_leaves
    for got, want in zip(leaves(after(*args)), leaves(before(*args)), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= tol


@pytest.mark.parametrize("B,T", [(2, 2), (1, 1)])
def test_matmul_reads_become_sum_reads(B, T):
    args = _args(B, T)
    before, after, n = _rewrite(matmul_reads, *args)
    assert n == 2 * T
    _close(after, before, args)
    assert "aten.bmm.default" not in targets(after)
    sums = [n for n in after.graph.nodes if n.target is aten.sum.dim_IntList]
    assert len(sums) == 2 * T and all(list(n.args[1]) == [-1] for n in sums)
    # then the V-major rule is the K-major one on the transpose, its write k-first
    assert state_transpose.apply(after.graph) == 1
    assert delta_einsum.apply(after.graph) == 2 * T
    after.recompile()
    _close(after, before, args)
    outer = [n for n in after.graph.nodes if n.target is aten.mul.Tensor
             and all(isinstance(a, torch.fx.Node) and a.target is aten.unsqueeze.default
                     for a in n.args)]
    assert outer and all(n.args[0].args[1] in (-1, 3) for n in outer)


def test_k_major_read_stays():
    def k_major(buf, slots, q, k, v, a, beta):  # x^T S: over the state's third dim
        s = buf[slots] * a[:, 0].unsqueeze(-1)
        o = torch.matmul(q[:, 0].unsqueeze(-2), s).squeeze(-2)
        return torch.index_put(buf, (slots,), s), o

    args = _args()
    before, after, n = _rewrite(k_major, *args)
    assert n == 0
    assert targets(after) == targets(before)


def test_matrix_product_and_ungathered_matrix_stay():
    def by_matrix(buf, slots, q, k, v, a, beta):  # S times a [K, 2] matrix per head
        s = buf[slots] * a[:, 0].unsqueeze(-2)
        return torch.matmul(s, torch.stack([q[:, 0], k[:, 0]], -1))

    def ungathered(buf, slots, q, k, v, a, beta):  # a matvec of a weight, no state
        return torch.matmul(buf[:2] * 2.0, q[:, 0].unsqueeze(-1)).squeeze(-1)

    for fn in (by_matrix, ungathered):
        args = _args()
        before, after, n = _rewrite(fn, *args)
        assert n == 0
        assert targets(after) == targets(before)
