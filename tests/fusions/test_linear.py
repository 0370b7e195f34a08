"""linear: a plain GEMM of a weight that no fusion took as `k3.linear` (our skinny GEMM on CUDA):
values unchanged, only weights (graph inputs the graph does not write) of the activations' dtype,
never a GEMM a fusion took, and on the tiny model the GEMMs the plan leaves."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import ORDER, all_patterns, linear

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from k3compile.rewrite import apply_patterns, module_path
from k3compile.stages.contract import NEUTRAL, PLANS, SCHEDULE

from .pattern_checks import assert_near_miss, assert_rewritten_equal, graph, rewrite, targets
from .test_norm_linear import _inputs as norm_linear_inputs
from .test_norm_linear import up


def _args(dtype=torch.bfloat16, rows=(3,), k=64, n=48):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*rows, k, generator=gen).to(dtype),
            (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)]


def plain(x, w):
    return F.linear(x, w)


@pytest.mark.parametrize("rows", [(3,), (2, 1), (2, 8)], ids=["2d", "decode", "verify"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_linear_becomes_k3_linear(dtype, rows):
    args = _args(dtype, rows)
    gm, report = rewrite(plain, args, linear.patterns())
    assert_rewritten_equal(gm, report, plain, args, "k3.linear")  # the same mm: bit for bit
    assert "aten.mm.default" not in targets(gm)


def test_mismatched_dtypes_are_refused():
    """mm cannot be traced with mixed dtypes: the graph is one whose metadata says w is fp32."""
    x, w = _args(torch.bfloat16)
    gm = graph(plain, x, w)
    node = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("w"))
    node.meta["val"] = node.meta["val"].float()
    report = apply_patterns(gm.graph, linear.patterns())
    assert_near_miss(report, "linear", "check refused",
                     "x is torch.bfloat16 but w is torch.float32")


def test_integer_gemm_is_refused():
    x, w = (torch.randint(-4, 4, (3, 16)), torch.randint(-4, 4, (8, 16)))
    _, report = rewrite(plain, [x, w], linear.patterns())
    assert_near_miss(report, "linear", "check refused", "int64 is not a float type")


def test_activation_products_are_not_rewritten():
    """A second operand the graph computes (attention scores, a gate) is not a weight; bmm is
    never a linear."""

    def products(x, w, q, k):
        h = torch.sigmoid(F.linear(x, w))  # the one weight GEMM
        scores = torch.bmm(q, k.transpose(1, 2))
        return F.linear(h, torch.tanh(h)), scores

    gen = torch.Generator().manual_seed(1)
    args = [*_args(), torch.randn(2, 4, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)]
    gm, report = rewrite(products, args, linear.patterns())
    assert [h.pattern for h in report.hits] == ["linear[plain]"]
    assert targets(gm).count("k3.linear.default") == 1
    assert targets(gm).count("aten.mm.default") == 1 and "aten.bmm.default" in targets(gm)
    misses = [nm.reason for nm in report.near_misses]
    assert any("computed in the graph" in r and "tanh" in r for r in misses), misses
    for got, want in zip(gm(*args), products(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_state_written_in_place_is_not_a_weight():
    def reads_then_updates(x, s):
        y = F.linear(x, s)
        s.copy_(s * 0.5)
        return y

    args = _args(torch.float32)
    gm = graph(reads_then_updates, *[a.clone() for a in args])
    report = apply_patterns(gm.graph, linear.patterns())
    assert_near_miss(report, "linear", "check refused", "writes in place")


def test_a_gemm_a_fusion_took_is_not_rewritten_again():
    """In registry order (linear last) norm_linear takes its GEMM first; a plain GEMM next to it
    is still taken."""

    def both(u, norm_w, w, w2):
        return up(u, norm_w, w), F.linear(u, w2)

    assert ORDER[-1] == "linear"
    patterns = [p for p in all_patterns() if p.name.startswith(("norm_linear[", "linear["))]
    args = [*norm_linear_inputs(), _args(rows=(3,), n=16)[1]]
    gm, report = rewrite(both, args, patterns)
    assert sorted(h.op for h in report.hits) == ["k3.linear", "k3.norm_linear"]
    fused = next(n for n in gm.graph.nodes if str(n.target) == "k3.linear.default")
    assert fused.args[1].name.startswith("w2")  # the plain GEMM, not norm_linear's
    for got, want in zip(gm(*args), both(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# every template (dense, kda_moe, mla_moe, last) in 4 layers, as in test_attention_plan
CFG = dataclasses.replace(get_config("tiny"), num_hidden_layers=4, full_attn_layers=(2, 3))


@pytest.fixture(scope="module")
def tiny():
    torch._dynamo.reset()
    eager, model = (build_model(CFG, dtype=torch.bfloat16, max_batch=4, max_seq_len=32)
                    for _ in range(2))
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "keep_graphs": False})
    gen = torch.Generator().manual_seed(0)
    pos, slots, outs = torch.tensor([0, 3]), torch.tensor([1, 0]), []
    for i in range(2):
        ids = torch.randint(0, CFG.vocab_size, (2,), generator=gen)
        outs.append((step(ids, pos + i, slots), eager(ids, pos + i, slots)))
    return outs, k3be.last_compiled()


def test_tiny_model_equals_eager_with_k3_linear(tiny):
    outs, compiled = tiny
    for got, want in outs:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    graph = next(iter(compiled.observer.graphs.values()))
    where = collections.Counter(module_path(n).removeprefix("language_model.")
                                for n in graph.nodes if str(n.target) == "k3.linear.default")
    # what the fusions leave: the dense MLP's down GEMM, the shared experts' down GEMM, lm_head
    assert where == {"model.layers.0.mlp.down_proj": 1, "lm_head": 1,
                     **{f"model.layers.{i}.mlp.shared_experts.down_proj": 1 for i in (1, 2, 3)}}
    assert not any(str(n.target) == "aten.mm.default" for n in graph.nodes)


def test_k3_linear_is_neutral_in_the_contract(tiny):
    _, compiled = tiny
    (report,) = compiled.contracts.values()
    assert report.met
    assert {lr.template for lr in report.layers} == {"dense", "kda_moe", "mla_moe", "last", "final"}
    assert not any(op in plan for plan in PLANS.values() for op in NEUTRAL)
    for lr in (lr for lr in report.layers if lr.template != "final"):
        assert lr.gemm_ops == lr.actual["linear"] == 1
        assert lr.fused_ops == sum(n for op, n in lr.actual.items() if op not in SCHEDULE) - 1


def test_a_refused_fusion_keeps_its_near_miss_when_its_gemm_becomes_k3_linear():
    """norm_linear refuses a 60-wide norm (not 16-byte rows); the GEMM still becomes k3.linear,
    and the near miss that says why the fusion did not happen survives the rewrite."""
    from k3compile.patterns import norm_linear

    args = norm_linear_inputs(width=60)
    gm, report = rewrite(up, args, norm_linear.patterns() + linear.patterns())
    assert "k3.linear.default" in targets(gm)
    misses = [nm for nm in report.near_misses if nm.pattern.startswith("norm_linear")]
    assert misses and "multiples of 8" in misses[0].reason, report.near_misses
