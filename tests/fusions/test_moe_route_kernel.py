"""k3::moe_route kernel at the K3 router shape (896 experts, top-16) for every batch bucket:
the selected set (ties to the lower expert index) and the renormalised unbiased weights; a bf16
router bias (Moonshot's model cast to bf16 whole) at 1, 8 and 64 rows (GPU, marked `gpu`).

CPU: the reference with a bf16 bias is bit-equal to it with the same values in fp32; the bf16
build's cache key; refusals."""

import logging

import pytest
import torch
from k3compile.kernels import moe_route as kernel

from k3compile.ops.moe_route import moe_route_ref
from tests.kernel_checks import BUCKETS, TOL, assert_refused, assert_written, on_gpu, poisoned

EXPERTS, TOP_K, SCALING = 896, 16, 2.5


def make_inputs(gen, n, n_experts=EXPERTS, ties=False, device="cuda"):
    logits = torch.randn(n, n_experts, generator=gen, device=device) * 2
    bias = torch.randn(n_experts, generator=gen, device=device) * 0.1
    if ties:  # few distinct logits, no bias: many exact ties in s + bias, also at the cut
        logits = (logits * 2).round() / 4
        bias = torch.zeros_like(bias)
    return logits, bias


def run_kernel(logits, bias, top_k=TOP_K, scaling=SCALING):
    n = logits.shape[0]
    out = (poisoned(n, top_k, dtype=torch.int64), poisoned(n, top_k, dtype=torch.float32))
    got = kernel.moe_route_cuda(logits, bias, top_k, scaling, out=out)
    assert got[0] is out[0], "the kernel did not run (fallback)"
    assert_written(*out)
    return out


def expected(logits, bias, top_k=TOP_K, scaling=SCALING):
    """Documented rule: descending s + bias, ties to the lower index (a stable sort)."""
    scores = torch.sigmoid(logits)
    keys = scores + bias
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    ids = order[:, :top_k]
    w = scores.gather(-1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * scaling, keys.gather(-1, order)


def by_id(ids, weights):
    ids, order = ids.sort(-1)
    return ids, weights.gather(-1, order)


def check(logits, bias, top_k=TOP_K, exact_ties=False):
    ids, weights = run_kernel(logits, bias, top_k)
    want_ids, want_w, sorted_keys = expected(logits, bias, top_k)
    keys = torch.sigmoid(logits) + bias
    assert (ids >= 0).all() and (ids < logits.shape[1]).all()
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "an expert chosen twice"
    assert (keys.gather(-1, ids).diff(dim=-1) <= 1e-6).all(), "not in descending key order"
    # Any valid top-k: every chosen key >= every other key (up to the sigmoid's last ulps).
    chosen = torch.zeros_like(keys, dtype=torch.bool).scatter_(-1, ids, True)
    worst_in = keys.masked_fill(~chosen, float("inf")).min(-1).values
    best_out = keys.masked_fill(chosen, -float("inf")).max(-1).values
    assert (worst_in >= best_out - 1e-6).all()
    # Weights: the unbiased scores of the chosen experts, renormalised and scaled.
    w = torch.sigmoid(logits).gather(-1, ids)
    torch.testing.assert_close(weights, w / (w.sum(-1, keepdim=True) + 1e-20) * SCALING,
                               **TOL["fp32"])
    if exact_ties:  # keys tie exactly (equal logits): the documented order, lower index first
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, **TOL["fp32"])
        return
    # Rows whose cut is not within rounding of a tie: the same set as the stable-sort rule and
    # as the op's reference (torch.topk), with the same weights.
    clear = (sorted_keys[:, top_k - 1] - sorted_keys[:, top_k]) > 1e-6 \
        if top_k < logits.shape[1] else torch.ones_like(worst_in, dtype=torch.bool)
    got = by_id(ids[clear], weights[clear])
    ref_ids, ref_w = moe_route_ref(logits, bias, top_k, SCALING)
    for other in (by_id(want_ids[clear], want_w[clear]), by_id(ref_ids[clear], ref_w[clear])):
        assert torch.equal(got[0], other[0]), "selected set differs"
        torch.testing.assert_close(got[1], other[1], **TOL["fp32"])


@on_gpu
@pytest.mark.parametrize("n", BUCKETS)
def test_k3_router(gen, n):
    check(*make_inputs(gen, n))


@on_gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_ties_pick_the_lower_index(gen, n):
    logits, bias = make_inputs(gen, n, ties=True)
    check(logits, bias, exact_ties=True)


@on_gpu
def test_all_equal_scores(gen):
    logits = torch.full((8, EXPERTS), 0.25, device="cuda")
    ids, weights = run_kernel(logits, torch.zeros(EXPERTS, device="cuda"))
    assert torch.equal(ids, torch.arange(TOP_K, device="cuda").expand(8, -1))
    torch.testing.assert_close(weights, torch.full_like(weights, SCALING / TOP_K))


@on_gpu
@pytest.mark.parametrize("n_experts,top_k", [(64, 4), (100, 8), (256, 8), (1024, 32), (8, 8),
                                             (4, 4), (4, 1), (896, 1), (128, 32)])
def test_other_sizes(gen, n_experts, top_k):
    for n in (1, 8, 33):
        check(*make_inputs(gen, n, n_experts), top_k=top_k)


@on_gpu
@pytest.mark.parametrize("n_equal", [16, 40, 61, 62, 300])
def test_equal_keys_at_the_cut(gen, n_equal):
    """n_equal experts at random places (across lanes and float4 slots) share the top logit, a
    few distinct ones lie above it: up to 64 candidates (61 + 3: the cap) take the ranked way,
    more the serial rounds; both give the equal experts in ascending order after the distinct
    ones."""
    n = 8
    logits = torch.rand(n, EXPERTS, generator=gen, device="cuda") - 6  # far below the cut
    for r in range(n):
        perm = torch.randperm(EXPERTS, generator=gen, device="cuda")
        logits[r, perm[:n_equal]] = 2.0
        logits[r, perm[n_equal:n_equal + 3]] = torch.tensor([4.0, 3.5, 3.0], device="cuda")
    check(logits, torch.zeros(EXPERTS, device="cuda"), exact_ties=True)


@on_gpu
def test_strided_logits(gen):
    wide = torch.randn(16, EXPERTS + 128, generator=gen, device="cuda")
    check(wide[:, :EXPERTS], torch.randn(EXPERTS, generator=gen, device="cuda") * 0.1)


@on_gpu
def test_op_dispatch_and_graph_replay(gen):
    logits, bias = make_inputs(gen, 8)
    ids, w = torch.ops.k3.moe_route(logits, bias, TOP_K, SCALING)
    want_ids, want_w, _ = expected(logits, bias)
    assert torch.equal(by_id(ids, w)[0], by_id(want_ids, want_w)[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = torch.ops.k3.moe_route(logits, bias, TOP_K, SCALING)
    for _ in range(3):
        fresh = make_inputs(gen, 8)
        logits.copy_(fresh[0])
        bias.copy_(fresh[1])
        graph.replay()
        want_ids, want_w, _ = expected(logits, bias)
        (got_ids, got_w), (ref_ids, ref_w) = by_id(ids, w), by_id(want_ids, want_w)
        assert torch.equal(got_ids, ref_ids)
        torch.testing.assert_close(got_w, ref_w, **TOL["fp32"])


@on_gpu
def test_refused_inputs_fall_back_to_the_reference(gen, caplog):
    logits, bias = make_inputs(gen, 4, n_experts=90)  # not a multiple of 4
    assert not kernel.can_implement(logits, bias, TOP_K)
    with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
        ids, w = torch.ops.k3.moe_route(logits, bias, TOP_K, SCALING)
    ref_ids, ref_w = moe_route_ref(logits, bias, TOP_K, SCALING)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
    assert "moe_route" in caplog.text


@on_gpu
def test_can_implement_limits(gen):
    logits, bias = make_inputs(gen, 2)
    assert kernel.can_implement(logits, bias, TOP_K)
    assert not kernel.can_implement(logits, bias, 33)
    assert not kernel.can_implement(logits.bfloat16(), bias, TOP_K)
    assert not kernel.can_implement(logits, bias.double(), TOP_K)


@on_gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_bf16_bias(gen, n):
    """A bf16 router bias (`model.to(torch.bfloat16)` casts Moonshot's fp32
    e_score_correction_bias): the kernel's build for it against the reference, and bit-equal to
    the fp32 build given the same values in fp32 (the bias is converted exactly at the load)."""
    logits, bias = make_inputs(gen, n)
    bias = bias.bfloat16()
    check(logits, bias)
    got, same = run_kernel(logits, bias), run_kernel(logits, bias.float())
    assert torch.equal(got[0], same[0]) and torch.equal(got[1], same[1])


def _cpu_inputs(n=3, n_experts=64):
    return make_inputs(torch.Generator().manual_seed(n_experts + n), n, n_experts, device="cpu")


def test_reference_takes_a_bf16_bias_as_its_fp32_values():
    """A bf16 bias is promoted, not computed in bf16: the reference (the op's CPU implementation,
    and what the kernel is checked against) with it equals it with the same values in fp32, bit
    for bit, at the K3 router shape."""
    logits, bias = _cpu_inputs(64, EXPERTS)
    bias = bias.bfloat16()
    got, want = moe_route_ref(logits, bias, TOP_K, SCALING), \
        moe_route_ref(logits, bias.float(), TOP_K, SCALING)
    assert got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bias_bf16_enters_the_key_only_when_set(monkeypatch):
    """The cached kernel's key for an fp32 bias is the key from before the bf16 build, so
    existing compiled kernels keep it; a bf16 bias adds its flag."""
    keys = []
    monkeypatch.setattr(kernel.KERNEL, "compiled", lambda *a, **kw: keys.append((a, kw)))
    kernel.compiled(EXPERTS, TOP_K, 8)
    kernel.compiled(EXPERTS, TOP_K, 8, False)
    kernel.compiled(EXPERTS, TOP_K, 8, True)
    cfg = kernel.config(EXPERTS, TOP_K, 8)
    assert keys == [((EXPERTS, TOP_K, cfg), {"rows": 8})] * 2 + [
        ((EXPERTS, TOP_K, cfg), {"rows": 8, "bias_bf16": True})]


def test_refusals():
    """fp32 and bf16 biases are taken (each a build of its own); other dtypes, shapes and
    layouts are refused, and so are bf16 logits."""
    logits, bias = _cpu_inputs()
    args = (logits, bias, 4)
    assert kernel.refusal(*args) is None
    assert kernel.refusal(logits, bias.bfloat16(), 4) is None
    for value in (bias.half(), bias.double(), bias[:-4], bias.bfloat16().repeat(2)[::2]):
        assert_refused(kernel.refusal, args, 1, value, "bias:")
    assert_refused(kernel.refusal, args, 0, logits.bfloat16(), "logits:")
