"""delta_einsum: the delta rule's state read (S·x over K) and write (k ⊗ u) in other einsum
orders become the lowering of math.delta_rule_step's own; other products stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.backend import last_compiled
from k3compile.canonical import delta_einsum
from k3compile.math import delta_rule_step
from tests.canonical.compiled import canonicalize
from tests.canonical.router_spellings import only
from tests.canonical.rule_checks import rewrite
from tests.conftest import rel_err
from tests.fusions.pattern_checks import graph, targets

B, H, K = 2, 2, 16


_rewrite = functools.partial(rewrite, delta_einsum, joint=True)


def _canonical(S, k, u):
    return delta_einsum.read(S, k), delta_einsum.write(k, u)


def _swapped(S, k, u):
    """tests/spellings/blind_k3.py: einsum("bhk,bhkv->bhv", k, S), einsum("bhk,bhv->bhkv")."""
    return torch.einsum("bhk,bhkv->bhv", k, S), torch.einsum("bhk,bhv->bhkv", k, u)


def _matmul(S, k, u):
    return (k.unsqueeze(-2) @ S).squeeze(-2), k[..., :, None] * u[..., None, :]


def _args(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in ((B, H, K, K), (B, H, K), (B, H, K))]


@pytest.mark.parametrize("fn", [_swapped, _matmul])
def test_spellings_become_the_canonical_lowering(fn):
    args = _args()
    before, after, n = _rewrite(fn, *args)
    assert n == 2
    assert sorted(targets(after)) == sorted(targets(graph(_canonical, *args, joint=True)))
    for got, want in zip(after(*args), before(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 1e-6


def test_canonical_form_is_left_as_it_is():
    args = _args()
    *_, n = _rewrite(_canonical, *args)
    assert n == 0


def _over_v(S, k, u):
    """a product over V (no read of the state) and u ⊗ k laid out [.., V, K]"""
    return torch.einsum("bhkv,bhv->bhk", S, k), torch.einsum("bhk,bhv->bhvk", k, u)


def _not_outer(S, k, u):
    """a mul by a 4-D tensor is no outer product"""
    return (k * u).unsqueeze(-1) * S


@pytest.mark.parametrize(("fn", "dtype"), [(_over_v, torch.float32), (_swapped, torch.bfloat16),
                                           (_not_outer, torch.float32)])
def test_other_products_stay(fn, dtype):
    """bf16: the read rounds its output (not the fp32 state read); its write is exact, taken"""
    args = _args(dtype)
    before, after, n = _rewrite(fn, *args)
    assert n == (1 if dtype == torch.bfloat16 else 0)
    assert targets(after).count("aten.bmm.default") == targets(before).count("aten.bmm.default")
    for got, want in zip(torch.utils._pytree.tree_leaves(after(*args)),
                         torch.utils._pytree.tree_leaves(before(*args)), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) == 0


# ---- the query scale on the read's output (tests/models/redteam_k3.py: o = S·q * d^-1/2) ----

C = K**-0.5


def _scaled_q(S, q4):
    """the canonical form: q scaled before its token's row is read"""
    return delta_einsum.read(S, (q4 * C)[:, 0])


def _scaled_o(S, q4):
    return delta_einsum.read(S, q4[:, 0]) * C


def _scaled_o_swapped(S, q4):
    return C * torch.einsum("bhk,bhkv->bhv", q4[:, 0], S)


def _args_q(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=g).to(dtype) for s in ((B, H, K, K), (B, 1, H, K))]


@pytest.mark.parametrize("fn", [_scaled_o, _scaled_o_swapped])
def test_scale_of_the_output_moves_onto_q(fn):
    args = _args_q()
    before, after, n = _rewrite(fn, *args)
    assert n >= 1
    assert sorted(targets(after)) == sorted(targets(graph(_scaled_q, *args, joint=True)))
    mul = next(n for n in after.graph.nodes if str(n.target) == "aten.mul.Tensor")
    assert mul.args[0].op == "placeholder" and mul.args[1] == C  # on q4, before its row's select
    got, want = after(*args), before(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 2e-7  # q rounds instead of o: ~1 ulp


def test_scaled_reads_of_one_q_scale_it_once():
    """reads of one [B, T, H, K] q (two states, two tokens), each output scaled: q is scaled
    once (row 1 of a T = 2 q is a non-contiguous view: its read keeps the clone it has)"""
    def two(S, q4):
        return (delta_einsum.read(S, q4[:, 0]) * C, delta_einsum.read(S * 0.5, q4[:, 0]) * C,
                delta_einsum.read(S, q4[:, 1]) * C)

    args = _args_q()
    args[1] = torch.cat([args[1], args[1].flip(0)], dim=1)  # [B, 2, H, K]
    before, after, n = _rewrite(two, *args)
    assert n >= 3
    scales = [n for n in after.graph.nodes if str(n.target) == "aten.mul.Tensor" and C in n.args]
    assert len(scales) == 1 and scales[0].args[0].op == "placeholder"
    for got, want in zip(after(*args), before(*args), strict=True):
        assert rel_err(got, want) <= 2e-7


def _tensor_scale(S, q4):
    """a scale by a tensor (per head): not a scalar"""
    return delta_einsum.read(S, q4[:, 0]) * S[:, :, :1, 0]


def _output_read_twice(S, q4):
    o = delta_einsum.read(S, q4[:, 0])
    return o * C, o


def _not_a_product(S, q4):
    return (S.sum(-2) + q4[:, 0]) * C


@pytest.mark.parametrize(("fn", "dtype"), [(_tensor_scale, torch.float32),
                                           (_output_read_twice, torch.float32),
                                           (_not_a_product, torch.float32),
                                           (_scaled_o, torch.bfloat16)])
def test_other_scales_stay(fn, dtype):
    args = _args_q(dtype)
    before, after, _ = _rewrite(fn, *args)
    muls = [n for n in after.graph.nodes if str(n.target) == "aten.mul.Tensor"]
    assert all(m.args[0].op != "placeholder" for m in muls)  # nothing scales q
    for got, want in zip(torch.utils._pytree.tree_leaves(after(*args)),
                         torch.utils._pytree.tree_leaves(before(*args)), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) == 0


# ---- token rows t > 0 of a [B, T, H, K] q (the verify buckets, T > 1) ----


def _rows(S, q4, k, u):
    """each token's read of one [B, T, H, K] q: a row t > 0 is a non-contiguous [B, H, K] view,
    whose canonical lowering has a clone; among them, spellings the rule rewrites: a swapped read
    of the last row, a scaled read of row 0, a swapped write"""
    T = q4.shape[1]
    return (*(delta_einsum.read(S, q4[:, t]) for t in range(T)),
            torch.einsum("bhk,bhkv->bhv", q4[:, T - 1], S),
            delta_einsum.read(S, q4[:, 0]) * C,
            torch.einsum("bhk,bhv->bhkv", k, u))


def _args_rows(T):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(s, generator=g) for s in ((B, H, K, K), (B, T, H, K), (B, H, K), (B, H, K))]


@pytest.mark.parametrize("T", [2, 8])
def test_rows_of_a_multi_token_q(T):
    """the canonical reads of rows t > 0 stay as they are (no splice of the contiguous lowering,
    which cannot view them); the swapped read, the scale and the write are rewritten"""
    args = _args_rows(T)
    before, after, n = _rewrite(_rows, *args)
    assert n == 3
    assert targets(after).count("aten.clone.default") == targets(before).count("aten.clone.default")
    for got, want in zip(after(*args), _rows(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 2e-7


@pytest.mark.parametrize("T", [2, 8])
def test_rows_of_a_multi_token_q_compiled(T):
    """under backend="k3" the rule runs to the end (not undone for the compile): its rewrites are
    counted and the compiled step equals eager"""
    args = _args_rows(T)
    c = canonicalize(_rows, dict(zip(("S", "q4", "k", "u"), args)), **only("delta_einsum"))
    assert c.counts["delta_einsum"] == 3
    (report,) = last_compiled().observer.reports.values()
    assert not report.reverted
    for got, want in zip(c.output, _rows(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 2e-7


# ---- the batch-merged form: bmm over [B*H, K, V] (tests/models/spell5_k3.py) ----


def _step_canonical(S, q, k, v, beta, decay):
    """the canonical form: math.delta_rule_step over T tokens"""
    outs = []
    for t in range(q.shape[1]):
        S, o = delta_rule_step(S, q, k, v, beta, decay, t)
        outs.append(o)
    return S, torch.stack(outs, 1)


def _step_bmm(S, q, k, v, beta, decay):
    """spell5: the state reshaped to [B*H, K, V], each token's rows to [B*H, 1, K], bmm"""
    b, _, h, d = q.shape
    S, outs = S.reshape(b * h, d, d), []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = (x[:, t].reshape(b * h, 1, d) for x in (q, k, v))
        S = S * decay[:, t].reshape(b * h, d, 1)
        u = beta[:, t].reshape(b * h, 1, 1) * (v_t - torch.bmm(k_t, S))
        S = S + torch.bmm(k_t.transpose(1, 2), u)
        outs.append(torch.bmm(q_t, S).view(b, h, d))
    return S.view(b, h, d, d), torch.stack(outs, 1)


def _step_matmul(S, q, k, v, beta, decay):
    """`@` on flatten(0, 1) views, the write as a broadcast product of a column and a row"""
    b, _, h, d = q.shape
    S, outs = S.flatten(0, 1), []
    for t in range(q.shape[1]):
        k_t = k[:, t].flatten(0, 1).unsqueeze(1)
        S = decay[:, t].flatten(0, 1).unsqueeze(-1) * S
        u = (v[:, t].flatten(0, 1).unsqueeze(1) - k_t @ S) * beta[:, t].reshape(-1, 1, 1)
        S = S + k_t.mT * u
        outs.append((q[:, t].flatten(0, 1).unsqueeze(1) @ S).reshape(b, h, d))
    return S.unflatten(0, (b, h)), torch.stack(outs, 1)


def _args_step(T, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    shapes = ((B, H, K, K), (B, T, H, K), (B, T, H, K), (B, T, H, K), (B, T, H), (B, T, H, K))
    args = [torch.randn(s, generator=g) for s in shapes]
    args[4], args[5] = args[4].sigmoid(), args[5].sigmoid()
    return [a.to(dtype) for a in args]


@pytest.mark.parametrize("fn", [_step_bmm, _step_matmul])
@pytest.mark.parametrize("T", [1, 2])
def test_batch_merged_step_becomes_the_canonical_step(fn, T):
    args = _args_step(T)
    before, after, n = _rewrite(fn, *args)
    assert n >= 1
    assert sorted(targets(after)) == sorted(targets(graph(_step_canonical, *args, joint=True)))
    for got, want in zip(after(*args), before(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 1e-6


def _state_read_elsewhere(S, q, k, v, beta, decay):
    """the decayed merged state is read by something else too (the near miss's "2 users"): the
    region is left alone"""
    m = S.reshape(B * H, K, K) * decay[:, 0].reshape(B * H, K, 1)
    k_0 = k[:, 0].reshape(B * H, 1, K)
    u = beta[:, 0].reshape(B * H, 1, 1) * (v[:, 0].reshape(B * H, 1, K) - torch.bmm(k_0, m))
    return (m + torch.bmm(k_0.transpose(1, 2), u)).view(B, H, K, K), m.sum()


def _square(S, q, k, v, beta, decay):
    """a bmm of two merged matrices is no read of the state"""
    m = S.reshape(B * H, K, K)
    return torch.bmm(m, m * decay[:, 0].reshape(B * H, K, 1)).view(B, H, K, K)


@pytest.mark.parametrize(("fn", "dtype"), [(_state_read_elsewhere, torch.float32),
                                           (_square, torch.float32),
                                           (_step_bmm, torch.bfloat16)])
def test_other_batch_merged_products_stay(fn, dtype):
    args = _args_step(1, dtype)
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert sorted(targets(after)) == sorted(targets(before))
    for got, want in zip(torch.utils._pytree.tree_leaves(after(*args)),
                         torch.utils._pytree.tree_leaves(before(*args)), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) == 0


def _sum_read(S, k, u):
    """spell8 (and spell6's probe kda_heads): the read as a broadcast product summed over K"""
    return (S * k.unsqueeze(-1)).sum(-2), delta_einsum.write(k, u)


def _sum_over_v(S, k, u):
    """summed over V: a V-major state's read, not this state's"""
    return (S * k.unsqueeze(-2)).sum(-1), delta_einsum.write(k, u)


def test_read_as_a_product_and_sum_becomes_the_canonical_read():
    args = _args()
    before, after, n = _rewrite(_sum_read, *args)
    assert n == 1
    assert sorted(targets(after)) == sorted(targets(graph(_canonical, *args, joint=True)))
    for got, want in zip(after(*args), before(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 1e-6


def test_sum_over_v_stays():
    args = _args()
    before, after, n = _rewrite(_sum_over_v, *args)
    assert n == 0
    assert targets(after) == targets(before)
