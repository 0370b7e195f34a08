"""index_slice: a write at one constant index (`torch.index_copy(bank, d, torch.tensor([j]), v)`,
a JAX port's `bank.at[..., j, :].set(v)`, spell9) becomes `slice_scatter(bank, v, d, j, j + 1)`,
bit for bit, so rule `depth_mix` reads the AttnRes bank the mixes read; indices from an input,
several indices, accumulate, a broadcast value and an index out of range stay (the last raises
as eager does)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import k3compile.backend as k3be
from k3compile.canonical import depth_mix, index_slice
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.conftest import TOL, rel_err
from tests.fusions.attention_checks import compile_with

INDEX_PUT, SLICE_SCATTER = "aten.index_put.default", "aten.slice_scatter.default"
B, T, D, EPS = 2, 1, 16, 1e-5


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _at_set(bank, j, v):
    """spell9's `bank_set`: bank.at[..., j, :].set(v) out of place."""
    return torch.index_copy(bank, bank.dim() - 2, torch.tensor([j]), v.unsqueeze(-2))


def _bank_of_two(b0, b1):
    return _at_set(_at_set(b0.new_zeros(B, T, 2, D), 0, b0), 1, b1)


SPELLED = {  # name -> (fn, args, sites)
    "index_copy": (lambda bank, v: _at_set(bank, 1, v), (_rand(B, T, 3, D), _rand(B, T, D)), 1),
    "two_writes": (_bank_of_two, (_rand(B, T, D), _rand(B, T, D, seed=1)), 2),
    "index_put_dim0": (lambda bank, v: bank.index_put((torch.tensor([2]),), v),
                       (_rand(3, 4, D), _rand(1, 4, D)), 1),
    "negative_index": (lambda bank, v: bank.index_put((torch.tensor([-1]),), v),
                       (_rand(3, 4, D), _rand(1, 4, D)), 1),
    "bf16": (lambda bank, v: _at_set(bank, 0, v),
             (_rand(B, T, 2, D, dtype=torch.bfloat16), _rand(B, T, D, dtype=torch.bfloat16)), 1),
}


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_one_constant_index_is_a_slice_scatter(name):
    fn, args, sites = SPELLED[name]
    before, after, n = rewrite(index_slice.RULE, fn, *args, joint=True)
    assert n == sites
    assert INDEX_PUT in targets(before) and INDEX_PUT not in targets(after)
    assert targets(after).count(SLICE_SCATTER) == sites
    assert_same(after(*args), before(*args))


LOOKALIKES = {  # name -> (fn, args)
    "index_from_input": (lambda bank, v, i: torch.index_copy(bank, 2, i, v.unsqueeze(-2)),
                         (_rand(B, T, 3, D), _rand(B, T, D), torch.tensor([1]))),
    "two_indices": (lambda bank, v: bank.index_put((torch.tensor([1, 1]),), v),
                    (_rand(3, 4, D), _rand(2, 4, D))),
    "accumulate": (lambda bank, v: bank.index_put((torch.tensor([1]),), v, accumulate=True),
                   (_rand(3, 4, D), _rand(1, 4, D))),
    "broadcast_value": (lambda bank, v: bank.index_put((torch.tensor([1]),), v),
                        (_rand(3, 4, D), _rand(D))),
}


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_stay(name):
    fn, args = LOOKALIKES[name]
    before, after, n = rewrite(index_slice.RULE, fn, *args, joint=True)
    assert n == 0 and targets(after) == targets(before)
    assert_same(after(*args), before(*args))


def test_an_index_out_of_range_stays_and_raises_as_eager():
    def fn(bank, v):
        return bank.index_put((torch.tensor([3]),), v)

    args = (_rand(3, 4, D), _rand(1, 4, D))
    with pytest.raises(IndexError):
        fn(*args)
    before, after, n = rewrite(index_slice.RULE, fn, *args, joint=True)
    assert n == 0 and targets(after) == targets(before)
    with pytest.raises((IndexError, RuntimeError)):
        after(*args)


# ---- the bank then reads as depth_mix's -----------------------------------------------------------

def spell9_mix(b0, b1, prefix, w_norm, w_query, n: int = 2):
    """spell9's AttnRes mix (tests/models/spell9_k3.py `attn_res`) over a bank written by
    `index_copy`: sources narrowed off the bank and stacked with the prefix on axis -2, the
    folded pseudo-query [D, 1] (Flax's [in, out]), ellipsis einsums, softmax in fp32."""
    bank = _bank_of_two(b0, b1)
    src = torch.cat([bank.narrow(-2, 0, n), prefix.unsqueeze(-2)], -2).float()
    normed = src * torch.rsqrt(torch.mean(src * src, -1, keepdim=True) + EPS)
    scores = torch.einsum("...sd,d->...s", normed, w_norm.float() * w_query.float()[:, 0])
    alpha = torch.softmax(scores, -1)
    return torch.einsum("...s,...sd->...d", alpha, src).to(prefix.dtype)


def _mix_args(dtype=torch.float32):
    acts = [_rand(B, T, D, seed=i, dtype=dtype) for i in range(3)]
    return [*acts, (1 + 0.1 * _rand(D, seed=3)).to(dtype), (_rand(D, 1, seed=4) / 4).to(dtype)]


@pytest.mark.parametrize("n", [1, 2])
def test_the_bank_then_reads_as_depth_mix_s(n):
    """Without the rule depth_mix finds no write at the bank's indices and leaves the mix; after
    it, the mix is the canonical one (fp32 summation order)."""
    def fn(*args):
        return spell9_mix(*args, n=n)

    args = _mix_args()
    n_alone = rewrite(depth_mix.RULE, fn, *args, joint=True)[2]
    before, after, sites = rewrite(index_slice.RULE, fn, *args, joint=True)
    assert n_alone == 0 and sites == 2
    assert depth_mix.RULE.apply(after.graph) == 1
    after.graph.eliminate_dead_code()
    after.recompile()
    assert "aten.bmm.default" not in targets(after)
    assert rel_err(after(*args), before(*args)) <= 1e-6


class Spell9MixNorm(nn.Module):
    def __init__(self):
        super().__init__()
        *_, wn, wq = _mix_args()
        self.w_norm, self.w_query = nn.Parameter(wn), nn.Parameter(wq)
        self.norm = nn.Parameter(1 + 0.1 * _rand(D, seed=5))

    def forward(self, b0, b1, prefix):
        h = spell9_mix(b0, b1, prefix, self.w_norm, self.w_query).float()
        return (h * torch.rsqrt(torch.mean(h * h, -1, keepdim=True) + EPS) * self.norm).to(
            prefix.dtype)


@pytest.mark.slow
def test_spell9_bank_mix_fuses():
    torch._dynamo.reset()
    model = Spell9MixNorm().requires_grad_(False)
    args = _mix_args()[:3]
    got = compile_with(model, "attn_res_mix_norm")(*args)
    report = next(iter(k3be.last_compiled().observer.reports.values()))
    assert [h.op for h in report.hits] == ["k3.attn_res_mix_norm"]
    assert rel_err(got, model(*args)) <= TOL["aten_cpu"]
