"""heads_first: KDA's per-head tensors written heads-first [B, H, T, D] (tests/models/spell5_k3.py)
become the tokens-first form the kda_decode pattern has: the permute sunk to the token selects,
the output's pulled up to the delta rule's stack; look-alikes (attention's heads-first operands,
an output read elsewhere, a stack of other values) stay."""

from __future__ import annotations

import collections

import pytest
import torch

from k3compile.canonical import delta_einsum, heads_first
from tests.conftest import rel_err
from tests.fusions.pattern_checks import graph

B, H, K, S_ROWS = 2, 2, 16, 4
EPS = 1e-6


def _l2(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + EPS)


def _front(q, k, v, graw, b, a_log, dt_bias, tokens_first):
    """q, k, v, graw [B, T, H·K] -> per-head, l2 norms, decay, β (spell5's KDA, fp32)"""
    t = q.shape[1]

    def heads(x):
        x = x.view(B, t, H, K)
        return x if tokens_first else x.transpose(1, 2)

    per_head = (H, 1) if tokens_first else (H, 1, 1)
    q, k, v = _l2(heads(q)) * K**-0.5, _l2(heads(k)), heads(v)
    rate = a_log.exp().view(per_head)
    decay = torch.exp(-5.0 * torch.sigmoid(rate * (heads(graw)
                                                    + dt_bias.view(*per_head[:-1], K))))
    beta = torch.sigmoid(b)
    return q, k, v, decay, beta if tokens_first else beta.transpose(1, 2)


def _step(q, k, v, graw, b, g, a_log, dt_bias, w, state, slots, tokens_first=False,
          einsum=False):
    """the delta rule on state[slots] (bmm over [B*H, K, V], or einsums), the state written back,
    the head norm and gate; o [B, T, H·K]"""
    t = q.shape[1]
    td = 1 if tokens_first else 2
    q, k, v, decay, beta = _front(q, k, v, graw, b, a_log, dt_bias, tokens_first)
    S, outs = state[slots], []
    if not einsum:
        S = S.reshape(B * H, K, K)
    for i in range(t):
        q_i, k_i, v_i = q.select(td, i), k.select(td, i), v.select(td, i)
        if einsum:
            S = S * decay.select(td, i).unsqueeze(-1)
            u = beta.select(td, i).unsqueeze(-1) * (v_i - torch.einsum("bhkv,bhk->bhv", S, k_i))
            S = S + k_i.unsqueeze(-1) * u.unsqueeze(-2)
            outs.append(torch.einsum("bhkv,bhk->bhv", S, q_i))
            continue
        q_i, k_i, v_i = (x.reshape(B * H, 1, K) for x in (q_i, k_i, v_i))
        S = S * decay.select(td, i).reshape(B * H, K, 1)
        u = beta.select(td, i).reshape(B * H, 1, 1) * (v_i - torch.bmm(k_i, S))
        S = S + torch.bmm(k_i.transpose(1, 2), u)
        outs.append(torch.bmm(q_i, S).view(B, H, K))
    new_state = torch.index_put(state, (slots,), S.view(B, H, K, K))
    o = torch.stack(outs, dim=td)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    gate = g.view(B, t, H, K)
    o = o * torch.sigmoid(gate if tokens_first else gate.transpose(1, 2))
    o = o if tokens_first else o.transpose(1, 2)
    return o.reshape(B, t, H * K), new_state


def _args(t):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)
    return [r(B, t, H * K), r(B, t, H * K), r(B, t, H * K), r(B, t, H * K), r(B, t, H),
            r(B, t, H * K), r(H), r(H * K), r(K), r(S_ROWS, H, K, K), torch.tensor([3, 1])]


def _rules(fn, args):
    before, after = graph(fn, *args, joint=True), graph(fn, *args, joint=True)
    delta_einsum.apply(after.graph)
    n = heads_first.apply(after.graph)
    after.graph.eliminate_dead_code()
    after.graph.lint()
    after.recompile()
    return before, after, n


def _ops(gm):
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("einsum", [False, True], ids=["bmm", "einsum"])
@pytest.mark.parametrize("t", [1, 2])
def test_heads_first_becomes_tokens_first(t, einsum):
    args = _args(t)
    before, after, n = _rules(lambda *a: _step(*a, einsum=einsum), args)
    assert n >= 6  # q, k, v, graw, β sunk; the output's pulled up
    _, want, _ = _rules(lambda *a: _step(*a, tokens_first=True, einsum=einsum), args)
    assert _ops(after)["aten.permute.default"] <= _ops(want)["aten.permute.default"] + 1
    selects = [x for x in after.graph.nodes if str(x.target) == "aten.select.int"
               and len(x.args[0].meta["val"].shape) >= 3]
    assert selects and all(x.args[1] == 1 for x in selects)  # token t of [B, T, ...]
    for got, ref in zip(after(*args), before(*args), strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-6


def test_tokens_first_is_left_as_it_is():
    args = _args(1)
    *_, n = _rules(lambda *a: _step(*a, tokens_first=True), args)
    assert n == 0


def _attention(q, k, v, graw, b, g, a_log, dt_bias, w, state, slots):
    """heads-first q and k of an attention: their values reach a matmul, not token selects"""
    qh, kh = (x.view(B, -1, H, K).transpose(1, 2) for x in (q, k))
    p = torch.softmax(_l2(qh) @ _l2(kh).transpose(-1, -2), -1)
    return (p @ v.view(B, -1, H, K).transpose(1, 2)).transpose(1, 2).reshape(B, -1, H * K)


def _output_read_elsewhere(*args):
    """the heads-first output is also returned: its permute stays"""
    o, new_state = _step(*args)
    qh = args[0].view(B, 1, H, K).transpose(1, 2)
    return o, new_state, qh.sum()


def _stack_of_other_values(q, k, v, graw, b, g, a_log, dt_bias, w, state, slots):
    """a stack on dim 2 of values that are no delta-rule read, transposed back"""
    x = torch.stack([q.view(B, H, K), k.view(B, H, K)], dim=2)
    return (torch.sigmoid(x) * w).transpose(1, 2).reshape(B, 2, H * K)


@pytest.mark.parametrize("fn", [_attention, _stack_of_other_values])
def test_look_alikes_stay(fn):
    args = _args(1)
    before, after, n = _rules(fn, args)
    assert n == 0
    assert _ops(after) == _ops(before)
    torch.testing.assert_close(after(*args), before(*args), rtol=0, atol=0)


def test_a_heads_first_value_read_elsewhere_keeps_its_permute():
    """a heads-first view of q summed besides the step: that permute stays (its values reach no
    token select), the step's are sunk"""
    args = _args(1)
    before, after, n = _rules(_output_read_elsewhere, args)
    assert n >= 6
    summed = [x for x in after.graph.nodes if str(x.target) == "aten.permute.default"
              and any(str(u.target) == "aten.sum.default" for u in x.users)]
    assert len(summed) == 1
    for got, ref in zip(after(*args), before(*args), strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-6
