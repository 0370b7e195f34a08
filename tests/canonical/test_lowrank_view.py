"""lowrank_view: a low-rank pair of projections whose inner GEMM feeds the outer one its rows
(einsum / matmul spellings after rule `gemm`: spell8's KDA f_a -> f_b) gets F.linear's
[*lead, N] round trip back, bit-equal; `linear_concat[kda]` then takes KDA's in-projections.
Pairs already in the F.linear form, pairs on rows and non-linear inner products stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import linear_concat
from torch import nn

from k3compile.canonical import ORDER
from k3compile.rewrite import apply_patterns
from tests.conftest import TOL, rel_err

from .compiled import assert_same_values, canonicalize, run, targets

D, R, N = 16, 8, 24
RULES = {"disabled_rules": [n for n in ORDER if n not in ("gemm", "lowrank_view")]}


def _einsum(x, w):
    return torch.einsum("...d,od->...o", x, w)


SPELLED = {
    "einsum": lambda x, wa, wb: _einsum(_einsum(x, wa), wb),
    "einsum_inner": lambda x, wa, wb: F.linear(_einsum(x, wa), wb),
}
LOOKALIKES = {
    "linear": lambda x, wa, wb: F.linear(F.linear(x, wa), wb),  # the canonical form already
    "matmul": lambda x, wa, wb: (x @ wa.t()) @ wb.t(),  # traces to it
    "rows": lambda x, wa, wb: _einsum(_einsum(x.flatten(0, 1), wa), wb),  # no lead to restore
}


class Pair(nn.Module):
    def __init__(self, fn):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.fn = fn
        self.wa = nn.Parameter(torch.randn(R, D, generator=g), requires_grad=False)
        self.wb = nn.Parameter(torch.randn(N, R, generator=g), requires_grad=False)

    def forward(self, x):
        return self.fn(x, self.wa, self.wb).sigmoid()


def _x():
    return {"x": torch.randn(3, 1, D, generator=torch.Generator().manual_seed(0))}


def _mm_reads(gm) -> list[str]:
    """What each mm's first operand is: the op that made it."""
    return [str(n.args[0].target) for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_inner_rows_go_through_the_lead_view(name):
    c = canonicalize(None, _x(), module=Pair(SPELLED[name]), **RULES)
    assert c.counts["lowrank_view"] == 1
    assert _mm_reads(c.after) == ["aten.view.default"] * 2
    assert_same_values(c)  # rule gemm's mm blocks differently from einsum's bmm


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_other_pairs_stay(name):
    c = canonicalize(None, _x(), module=Pair(LOOKALIKES[name]), **RULES)
    assert c.counts["lowrank_view"] == 0
    assert targets(c.after).count("aten.mm.default") == 2
    assert_same_values(c)


def test_inner_product_not_a_linear_stays():
    """The inner GEMM's weight is a step input (an activation), not a parameter."""
    class Act(nn.Module):
        def __init__(self):
            super().__init__()
            self.wb = nn.Parameter(torch.randn(N, R), requires_grad=False)

        def forward(self, x, a):
            return _einsum(_einsum(x, a), self.wb).sigmoid()

    args = {**_x(), "a": torch.randn(R, D)}
    c = canonicalize(None, args, module=Act(), **RULES)
    assert c.counts["lowrank_view"] == 0
    assert_same_values(c)


class InProj(nn.Module):
    """KDA's six in-projections as einsums (spell8), summed so that every one is read."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        W, H = 16, 2
        shapes = {"q": (W, D), "k": (W, D), "v": (W, D), "g": (W, D), "fa": (R, D),
                  "fb": (W, R), "b": (H, D)}
        for name, shape in shapes.items():
            setattr(self, f"w_{name}", nn.Parameter(torch.randn(*shape, generator=g),
                                                    requires_grad=False))

    def forward(self, x):
        q, k, v, g = (_einsum(x, w) for w in (self.w_q, self.w_k, self.w_v, self.w_g))
        graw = _einsum(_einsum(x, self.w_fa), self.w_fb)
        b = _einsum(x, self.w_b)
        return (q * k + v.sigmoid() * g + graw) * b.sum(-1, keepdim=True)


@pytest.mark.parametrize("rule", [True, False])
def test_einsum_in_projections_fuse_as_linear_concat(rule):
    """With the rule linear_concat[kda] takes them; without it, it does not."""
    off = {} if rule else {"disabled_rules": ["lowrank_view"]}
    c = canonicalize(None, {"x": torch.randn(2, 1, D)}, module=InProj(), **off)
    want = run(c.before, c.inputs)
    report = apply_patterns(c.after.graph, linear_concat.patterns())
    c.after.recompile()
    assert [h.pattern for h in report.hits] == (["linear_concat[kda]"] if rule else [])
    for got, w in zip(run(c.after, c.inputs), want):
        assert rel_err(got, w) <= TOL["aten_cpu"]
