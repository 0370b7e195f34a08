"""state_transpose: a delta rule on a V-major state [B, H, V, K] (decay along the last dim, reads
summed over it, the rank-1 write `k.unsqueeze(-2) * u.unsqueeze(-1)`) becomes the K-major rule on
the gathered rows' transpose, written back transposed: the same values (sums in another order,
an ulp), and after rule `delta_einsum` the canonical reads. Look-alikes stay: a K-major state, a
V-major state read by a product (bmm), a region with a sum over both dims, a state never
written."""

from __future__ import annotations

import functools

import torch

from k3compile.canonical import delta_einsum, state_transpose
from tests.canonical.rule_checks import rewrite, targets
from tests.conftest import rel_err

B, H, D, S = 2, 3, 8, 5
aten = torch.ops.aten
_rewrite = functools.partial(rewrite, state_transpose, joint=True)


def _args(T=2):
    g = torch.Generator().manual_seed(0)
    n = torch.nn.functional.normalize
    return [torch.randn(S, H, D, D, generator=g), torch.tensor([3, 0]),
            n(torch.randn(B, T, H, D, generator=g), dim=-1),
            n(torch.randn(B, T, H, D, generator=g), dim=-1), torch.randn(B, T, H, D, generator=g),
            torch.rand(B, T, H, D, generator=g), torch.rand(B, T, H, generator=g)]


def v_major(buf, slots, q, k, v, a, beta):
    """spell6's `_delta_heads` with its V-major state (vdim -2, kdim -1)"""
    s, outs = buf[slots], []
    for t in range(q.shape[1]):
        s = s * a[:, t].unsqueeze(-2)
        kv = (s * k[:, t].unsqueeze(-2)).sum(-1)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv)
        s = s + k[:, t].unsqueeze(-2) * u.unsqueeze(-1)
        outs.append((s * q[:, t].unsqueeze(-2)).sum(-1))
    return torch.index_put(buf, (slots,), s), torch.stack(outs, 1)


def k_major(buf, slots, q, k, v, a, beta):
    s, outs = buf[slots], []
    for t in range(q.shape[1]):
        s = s * a[:, t].unsqueeze(-1)
        kv = (s * k[:, t].unsqueeze(-1)).sum(-2)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv)
        s = s + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append((s * q[:, t].unsqueeze(-1)).sum(-2))
    return torch.index_put(buf, (slots,), s), torch.stack(outs, 1)


def _close(after, before, args):
    leaves = torch.utils._pytree.tree_leaves
    for got, want in zip(leaves(after(*args)), leaves(before(*args)), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 1e-6


def _sums(gm) -> list:
    return [list(n.args[1]) for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]


def test_v_major_rule_is_the_k_major_rule_on_the_transpose():
    args = _args()
    before, after, n = _rewrite(v_major, *args)
    assert n == 1
    _close(after, before, args)
    assert _sums(after) and all(d == [-2] for d in _sums(after))  # the K-major reads
    swaps = [n for n in after.graph.nodes if n.target is aten.permute.default
             and list(n.args[1]) == [0, 1, 3, 2]]
    assert [p.args[0].target for p in swaps] == [aten.index.Tensor, aten.add.Tensor]
    assert next(iter(swaps[-1].users)).target is aten.index_put.default
    # the reads are then delta_einsum's sum reads, the whole step the K-major one's form
    assert delta_einsum.apply(after.graph) == 4
    after.recompile()
    _close(after, before, args)


def test_v_major_rule_at_one_token_and_batch_one():
    args = _args(T=1)
    args[1], args[2:] = args[1][:1], [x[:1] for x in args[2:]]
    before, after, n = _rewrite(v_major, *args)
    assert n == 1
    _close(after, before, args)


def test_k_major_rule_stays():
    args = _args()
    before, after, n = _rewrite(k_major, *args)
    assert n == 0
    assert targets(after) == targets(before)


def test_v_major_state_read_by_a_product_stays():
    def bmm_read(buf, slots, q, k, v, a, beta):
        s = buf[slots] * a[:, 0].unsqueeze(-2)
        o = (s.flatten(0, 1) @ q[:, 0].flatten(0, 1).unsqueeze(-1)).view(B, H, D)
        return torch.index_put(buf, (slots,), s), o

    args = _args()
    before, after, n = _rewrite(bmm_read, *args)
    assert n == 0
    assert targets(after) == targets(before)


def test_sums_over_both_dims_stay():
    def both(buf, slots, q, k, v, a, beta):
        s = buf[slots] * a[:, 0].unsqueeze(-2)
        return torch.index_put(buf, (slots,), s), s.sum(-1) + s.sum(-2)

    args = _args()
    before, after, n = _rewrite(both, *args)
    assert n == 0
    assert targets(after) == targets(before)


def test_unwritten_state_stays():
    def read_only(buf, slots, q, k, v, a, beta):
        s = buf[slots] * a[:, 0].unsqueeze(-2)
        return (s * q[:, 0].unsqueeze(-2)).sum(-1)

    args = _args()
    before, after, n = _rewrite(read_only, *args)
    assert n == 0
    assert targets(after) == targets(before)
    _close(after, before, args)
