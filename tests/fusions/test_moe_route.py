"""moe_route: sigmoid scores, bias-corrected top-k and renormalised unbiased weights; the
renormalisation as K3 writes it (+ 1e-20), with another eps, clamped, or with none: the op carries
which, so the fused graph computes the same values bit for bit."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import moe_route
from torch import fx

import k3compile.backend as k3be
from tests.canonical.router_spellings import FUSED, SCALING, K, fused, routed_equal

from .pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite, with_kernel_limits


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 16, generator=g).to(dtype), 0.1 * torch.randn(16, generator=g)]


def _scalars(gm) -> tuple:
    """(top_k, scaling, eps, clamp) of the graph's k3.moe_route, defaults filled in."""
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.moe_route.default")
    names = [a.name for a in op.target._schema.arguments]
    bound = {a.name: a.default_value for a in op.target._schema.arguments}
    bound |= dict(zip(names, op.args)) | op.kwargs
    return tuple(bound[n] for n in ("top_k", "scaling", "eps", "clamp"))


def route(logits, bias, top_k=4, scaling=1.0):  # MoEGate after its GEMM
    scores = torch.sigmoid(logits)
    _, ids = torch.topk(scores + bias, top_k, dim=-1)
    weights = scores.gather(-1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def _route_with(k, scaling):
    def fn(logits, bias):
        return route(logits, bias, k, scaling)

    return fn


def test_rewrites_and_captures_top_k_and_scaling():
    args = _inputs()
    for k, scaling in ((4, 1.0), (2, 2.5)):
        fn = _route_with(k, scaling)
        gm, report = rewrite(fn, args, moe_route.patterns())
        assert_rewritten_equal(gm, report, fn, args, "k3.moe_route")
        assert _scalars(gm) == (k, scaling, 1e-20, False)


def test_escaping_scores_is_a_near_miss():
    def escaped(logits, bias):
        scores = torch.sigmoid(logits)  # also returned: escapes the fusion
        _, ids = torch.topk(scores + bias, 4, dim=-1)
        weights = scores.gather(-1, ids)
        return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * 1.0, scores

    _, report = rewrite(escaped, _inputs(), moe_route.patterns())
    assert_near_miss(report, "moe_route", "user")


def test_check_refuses_bf16_logits():
    args = _inputs(torch.bfloat16)
    _, report = rewrite(lambda lg, b: route(lg, b), args, moe_route.patterns())
    assert_near_miss(report, "moe_route", "check refused", "fp32")


def _renormalised(gather_dim=-1, sum_dim=-1, eps=1e-20):
    """route() with the literals Inductor's matcher takes as wildcards (ints and floats)."""

    def fn(logits, bias):
        scores = torch.sigmoid(logits)
        _, ids = torch.topk(scores + bias, 4, dim=-1)
        weights = scores.gather(gather_dim, ids)
        return ids, weights / (weights.sum(sum_dim, keepdim=True) + eps) * 2.5

    return fn


def test_other_dims_are_refused():
    """The engine compares the dims the matcher takes as wildcards (tests/engine/
    test_lookalikes.py); this pattern's check did until session 35."""
    args = [torch.rand(16, 16), torch.zeros(16)]  # 16 tokens: a gather along dim 0 is valid
    for literals, words in (({"gather_dim": 0}, "gather (gather float32[16, 4]) has dim=0"),
                            ({"sum_dim": 0}, "sum_1 (sum.dim_IntList float32[1, 4]) has dim=[0]")):
        gm, report = rewrite(_renormalised(**literals), args, moe_route.patterns())
        assert_near_miss(report, "moe_route", "literal_mismatch", words)
        fn = _renormalised(**literals)
        for got, want in zip(gm(*args), fn(*args)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# renormalisation spellings -> (eps, clamp) the op must carry
RENORMALISATIONS = {
    "+ 1e-20": (lambda w: w / (w.sum(-1, keepdim=True) + 1e-20), 1e-20, False),
    "+ 1e-6": (lambda w: w / (w.sum(-1, keepdim=True) + 1e-6), 1e-6, False),
    "div(+ 1e-9)": (lambda w: w.div(w.sum(-1, keepdim=True) + 1e-9), 1e-9, False),
    "clamp_min(1e-12)": (lambda w: w / w.sum(-1, keepdim=True).clamp_min(1e-12), 1e-12, True),
    "clamp(min=1e-6)": (lambda w: w / torch.clamp(w.sum(dim=-1, keepdim=True), min=1e-6), 1e-6,
                        True),
    "no eps": (lambda w: w / w.sum(-1, keepdim=True), 0.0, False),
    "div, no eps": (lambda w: torch.div(w, w.sum(-1, keepdim=True)), 0.0, False),
}


def _router(renormalise, top_k=4, scaling=2.5):
    def fn(logits, bias):
        scores = torch.sigmoid(logits)
        _, ids = torch.topk(scores + bias, top_k, dim=-1)
        return ids, renormalise(scores.gather(-1, ids)) * scaling

    return fn


def _tiny_scores():
    """Rows whose top-k scores sum below every eps here (sigmoid(-60) ~ 9e-27) or near 1e-6
    (sigmoid(-15) ~ 3e-7): where + eps, max(., eps) and no eps differ, so an op that assumed
    another renormalisation would show."""
    logits, bias = _inputs()
    logits[1] = -60.0 - torch.arange(16.0) / 16
    logits[2] = -15.0 - torch.arange(16.0) / 16
    return [logits, bias]


@pytest.mark.parametrize("spelling", RENORMALISATIONS)
def test_every_renormalisation_fuses_with_its_eps(spelling):
    renormalise, eps, clamp = RENORMALISATIONS[spelling]
    fn = _router(renormalise)
    for args in (_inputs(), _tiny_scores()):
        gm, report = rewrite(fn, args, moe_route.patterns())
        assert_rewritten_equal(gm, report, fn, args, "k3.moe_route")  # fp32: bit for bit
        assert _scalars(gm) == (4, 2.5, eps, clamp)


def test_the_renormalisations_differ_where_the_sum_is_tiny():
    """The spellings above are not one function: the bit-exact comparison sees the difference."""
    args = _tiny_scores()
    outs = {name: _router(r)(*args)[1][1:] for name, (r, *_) in RENORMALISATIONS.items()}
    assert not torch.equal(outs["+ 1e-20"], outs["+ 1e-6"])
    assert not torch.equal(outs["+ 1e-6"], outs["clamp(min=1e-6)"])
    assert not torch.equal(outs["+ 1e-20"], outs["clamp_min(1e-12)"])
    assert not torch.equal(outs["+ 1e-20"], outs["no eps"])


# look-alikes: renormalisations the op does not compute -> (spelling, why it is not one)
LOOKALIKES = {
    "clamp_max": lambda w: w / w.sum(-1, keepdim=True).clamp_max(1e-6),
    "clamp(min, max)": lambda w: w / w.sum(-1, keepdim=True).clamp(min=1e-6, max=2.0),
    "sum times eps": lambda w: w / (w.sum(-1, keepdim=True) * 1.5),
    "max, not sum": lambda w: w / (w.amax(-1, keepdim=True) + 1e-20),
    "sum then sqrt": lambda w: w / w.sum(-1, keepdim=True).sqrt(),
}


@pytest.mark.parametrize("spelling", LOOKALIKES)
def test_lookalike_renormalisations_stay(spelling):
    fn = _router(LOOKALIKES[spelling])
    args = _tiny_scores()
    gm, report = rewrite(fn, args, moe_route.patterns())
    assert not report.hits, report.hits
    assert "k3.moe_route.default" not in [str(n.target) for n in gm.graph.nodes]
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_tensor_epsilon_is_refused():
    """eps from a tensor (a buffer, a config tensor): no compile-time number for the op."""
    def fn(logits, bias, eps):
        return _router(lambda w: w / (w.sum(-1, keepdim=True) + eps))(logits, bias)

    _, report = rewrite(fn, [*_inputs(), torch.tensor(1e-6)], moe_route.patterns())
    assert_near_miss(report, "moe_route", "check refused", "not a compile-time number")


def test_scores_renormalised_by_all_experts_stay():
    """Dividing by the sum over every expert's score is another routing (not the k chosen)."""
    def fn(logits, bias):
        scores = torch.sigmoid(logits)
        _, ids = torch.topk(scores + bias, 4, dim=-1)
        return ids, scores.gather(-1, ids) / (scores.sum(-1, keepdim=True) + 1e-20) * 2.5

    args = _inputs()
    gm, report = rewrite(fn, args, moe_route.patterns())
    assert not report.hits
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gpu_graphs_fuse_only_the_kernels_renormalisation(monkeypatch):
    """The CUDA kernel adds 1e-20: on GPU graphs another eps or a clamp stays for Inductor
    (deferred with the kernel's reason); K3's own renormalisation fuses."""
    with_kernel_limits(monkeypatch, "moe_route")
    args = _inputs()
    for spelling in ("+ 1e-6", "clamp_min(1e-12)", "no eps"):
        fn = _router(RENORMALISATIONS[spelling][0])
        gm, report = rewrite(fn, args, moe_route.patterns(), kernels_only=True)
        assert not report.hits and "kernel adds 1e-20" in report.deferred["moe_route"], spelling
        for got, want in zip(gm(*args), fn(*args)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    fn = _router(RENORMALISATIONS["+ 1e-20"][0])
    gm, report = rewrite(fn, args, moe_route.patterns(), kernels_only=True)
    assert_rewritten_equal(gm, report, fn, args, "k3.moe_route")


def test_positive_dims_and_an_int_scaling_are_the_same_routing():
    def fn(logits, bias):
        scores = torch.sigmoid(logits)
        _, ids = torch.topk(scores + bias, 4)
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(1, keepdim=True) + 1e-20) * 2

    args = _inputs()
    gm, report = rewrite(fn, args, moe_route.patterns())
    assert_rewritten_equal(gm, report, fn, args, "k3.moe_route")
    assert _scalars(gm) == (4, 2.0, 1e-20, False)


def _hf_gate(renormalise):
    """A transformers-style gate (unsorted top-k, `bias.unsqueeze(0)`, `gather(1)`) that
    renormalises in place, as `weights /= ...`: functionalised by the backend."""
    def route(logits, bias):
        scores = logits.sigmoid()
        _, ids = torch.topk(scores + bias.unsqueeze(0), k=K, dim=-1, sorted=False)
        weights = scores.gather(1, ids)
        weights /= renormalise(weights.sum(dim=-1, keepdim=True))
        return ids, weights * SCALING

    return route


@pytest.mark.parametrize("denominator, eps, clamp", [
    (lambda total: total, 0.0, False),
    (lambda total: total.clamp(min=1e-6), 1e-6, True),
    (lambda total: total + 1e-9, 1e-9, False),
], ids=["no eps", "clamp", "+ 1e-9"])
def test_compiled_foreign_gates_fuse_with_their_eps(denominator, eps, clamp):
    """Under backend="k3" (canonical rules, then the router's patterns): the front and the route
    fuse, the op carries the gate's eps, and the step routes as the gate does."""
    ops, got, want = fused(_hf_gate(denominator))
    assert all(ops[op] == 1 for op in FUSED), ops
    routed_equal(got, want, rel=0.0)
    graph = next(iter(k3be.last_compiled().observer.graphs.values()))
    assert _scalars(fx.GraphModule({}, graph)) == (K, SCALING, eps, clamp)
