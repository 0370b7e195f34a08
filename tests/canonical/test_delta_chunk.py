"""delta_chunk: the gated delta rule in the chunked form at chunk size 1 (spell12's: the delta and
the output from the old state) becomes the sequential step of k3compile.math.delta_rule_step, to
fp32 rounding (measured at K3's sizes: the bound of the rule's docstring); look-alikes stay."""

from __future__ import annotations

import functools

import pytest
import torch

from k3compile.canonical import delta_chunk
from k3compile.canonical.region import VIEWS
from tests.conftest import rel_err

from .rule_checks import rewrite

aten = torch.ops.aten
_rewrite = functools.partial(rewrite, delta_chunk, joint=True)


def _inputs(B=2, T=1, H=2, K=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(B, H, K, K, generator=g)
    alpha = torch.exp(-5 * torch.sigmoid(torch.randn(B, T, H, K, generator=g)))
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(B, T, H, K, generator=g)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    return S, alpha, q * K ** -0.5, k, v, beta


def spell12(S, alpha, q, k, v, beta):
    """tests/models/spell12_k3.py's recurrence: per token, the delta and o from the old state"""
    outs = []
    beta = beta[..., None]
    for t in range(q.shape[1]):
        a_t, q_t, k_t = alpha[:, t], q[:, t], k[:, t]
        u = beta[:, t] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", a_t * k_t, S))
        o = torch.einsum("bhk,bhkv->bhv", a_t * q_t, S)
        outs.append(o + torch.linalg.vecdot(q_t, k_t)[..., None] * u)
        S = a_t[..., None] * S + k_t[..., :, None] * u[..., None, :]
    return S, torch.stack(outs, 1)


def swapped(S, alpha, q, k, v, beta):
    """the same with the operands of every product and sum swapped, q·k kept, not unsqueezed"""
    outs = []
    for t in range(q.shape[1]):
        a_t, q_t, k_t = alpha[:, t], q[:, t], k[:, t]
        u = (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t * a_t)) * beta[:, t, :, None]
        o = (k_t * q_t).sum(-1, keepdim=True) * u + torch.einsum("bhkv,bhk->bhv", S, q_t * a_t)
        outs.append(o)
        S = k_t.unsqueeze(-1) * u.unsqueeze(-2) + S * a_t.unsqueeze(-1)
    return S, torch.stack(outs, 1)


def sequential(S, alpha, q, k, v, beta):
    """the canonical order (k3compile.math.delta_rule_step)"""
    outs = []
    for t in range(q.shape[1]):
        S = S * alpha[:, t].unsqueeze(-1)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return S, torch.stack(outs, 1)


def _assert_close(after, before, args, bound):
    for got, want in zip(after(*args), before(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= bound, rel_err(got, want)


@pytest.mark.parametrize("fn", [spell12, swapped])
@pytest.mark.parametrize("tokens", [1, 2])
def test_the_chunk_form_becomes_the_sequential_step(fn, tokens):
    args = _inputs(T=tokens)
    before, after, n = _rewrite(fn, *args)
    assert n == tokens
    _assert_close(after, before, args, 2e-6)
    # the canonical form: the decay multiplies the state, no q·k dot product is left
    _, canonical, _ = _rewrite(sequential, *args)
    ops = _arithmetic(after)
    assert ops.count("aten.sum.dim_IntList") == 0
    assert ops.count("aten.bmm.default") == 2 * tokens
    assert ops == _arithmetic(canonical)


def _arithmetic(gm) -> list[str]:
    """gm's ops that compute values (views, selects and copies left out), sorted"""
    moves = {*VIEWS, aten.select.int, aten.cat.default, aten.stack.default}
    return sorted(str(n.target) for n in gm.graph.nodes
                  if n.op == "call_function" and n.target not in moves)


def test_the_rounding_at_k3_sizes_is_within_the_bound():
    """K3's KDA heads (96 of 128 x 128, batch 2): the rewritten step within 2e-6 of the chunk
    form's values (measured 6.8e-7 for o, 7.4e-8 for the state at batch 8)."""
    args = _inputs(B=2, H=96, K=128, seed=1)
    before, after, n = _rewrite(spell12, *args)
    assert n == 1
    _assert_close(after, before, args, 2e-6)


def wrong_term(S, alpha, q, k, v, beta):
    """o corrected by (q·k)·v, not by the delta: another function"""
    a_t, q_t, k_t = alpha[:, 0], q[:, 0], k[:, 0]
    u = beta[:, 0, :, None] * (v[:, 0] - torch.einsum("bhk,bhkv->bhv", a_t * k_t, S))
    o = (torch.einsum("bhk,bhkv->bhv", a_t * q_t, S)
         + torch.linalg.vecdot(q_t, k_t)[..., None] * v[:, 0])
    return a_t[..., None] * S + k_t[..., :, None] * u[..., None, :], o


def other_key(S, alpha, q, k, v, beta):
    """the delta read with q where the write has k: not the delta rule"""
    a_t, q_t, k_t = alpha[:, 0], q[:, 0], k[:, 0]
    u = beta[:, 0, :, None] * (v[:, 0] - torch.einsum("bhk,bhkv->bhv", a_t * q_t, S))
    o = torch.einsum("bhk,bhkv->bhv", a_t * q_t, S) + torch.linalg.vecdot(q_t, k_t)[..., None] * u
    return a_t[..., None] * S + k_t[..., :, None] * u[..., None, :], o


def undecayed(S, alpha, q, k, v, beta):
    """the chunk form without the decay on the state"""
    a_t, q_t, k_t = alpha[:, 0], q[:, 0], k[:, 0]
    u = beta[:, 0, :, None] * (v[:, 0] - torch.einsum("bhk,bhkv->bhv", a_t * k_t, S))
    o = torch.einsum("bhk,bhkv->bhv", a_t * q_t, S) + torch.linalg.vecdot(q_t, k_t)[..., None] * u
    return S + k_t[..., :, None] * u[..., None, :], o


@pytest.mark.parametrize("fn", [sequential, wrong_term, other_key, undecayed])
def test_look_alikes_stay(fn):
    args = _inputs()
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    _assert_close(after, before, args, 0)
