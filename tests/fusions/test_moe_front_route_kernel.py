"""k3::moe_front_route's kernel (GPU, marked `gpu`) against moe_front's and moe_route's kernels
on the same inputs, at the K3 router (896 experts, top-8) over one TP16 rank's latent down
(3584 x 7168): ids equal and weights within fp32 rounding at 1, 2 and 8 rows over many seeds,
with ties, with a bf16 bias; two launches back to back and CUDA-graph replays (the last CTA's
counter reset); refused calls take the two launches."""

import logging

import pytest
import torch
from k3compile.kernels import moe_front_route as kernel
from k3compile.kernels import moe_route
from k3compile.kernels.common import gemv
from k3compile.kernels.moe_front import moe_front_cuda

from k3compile.ops.linear_concat import concatenated
from tests.kernel_checks import TOL, assert_written, no_fallback, on_gpu

E, L, D, TOP_K, SCALING = 896, 3584, 7168, 8, 2.5


def make_inputs(gen, n, ties=False):
    packed = torch.randn(E + L, D, generator=gen, device="cuda").bfloat16() / 64
    x = torch.randn(n, D, generator=gen, device="cuda").bfloat16()
    bias = torch.randn(E, generator=gen, device="cuda") * 0.1
    if ties:  # few distinct router rows, no bias: many exact ties in the keys, also at the cut
        packed[:E] = packed[torch.randint(0, 4, (E,), generator=gen, device="cuda")]
        bias.zero_()
    return x, packed[:E], packed[E:], bias


def two_launches(x, wr, wd, bias):
    """gemv's split variant (the fused kernel's sums, at any row count) and moe_route's kernel
    on its logits: what the one launch computes, bit for bit."""
    with no_fallback():
        logits, z = gemv.gemv_split_cuda(x, concatenated([wr, wd]), E)
        return (*moe_route.moe_route_cuda(logits, bias, TOP_K, SCALING), z, logits)


def check(got, want):
    ids, weights, z = got
    assert_written(ids, weights)
    assert torch.equal(ids, want[0]), "ids differ from moe_route's kernel"
    torch.testing.assert_close(weights, want[1], **TOL["fp32"])
    assert torch.equal(weights, want[1])  # the same logits through the same device code
    assert torch.equal(z, want[2])  # the same gemv sums


@on_gpu
@pytest.mark.parametrize("n", [1, 2, 8])
def test_equals_the_two_kernels(gen, n):
    for _ in range(20):
        args = make_inputs(gen, n)
        with no_fallback():
            got = kernel.moe_front_route_cuda(*args, TOP_K, SCALING)
        check(got, two_launches(*args))


@on_gpu
@pytest.mark.parametrize("n", [1, 8])
def test_ties_and_a_bf16_bias(gen, n):
    for ties, bf16 in ((True, False), (False, True), (True, True)):
        x, wr, wd, bias = make_inputs(gen, n, ties)
        bias = bias.bfloat16() if bf16 else bias
        with no_fallback():
            got = kernel.moe_front_route_cuda(x, wr, wd, bias, TOP_K, SCALING)
        check(got, two_launches(x, wr, wd, bias))


@on_gpu
@pytest.mark.parametrize("n", [1, 8])
def test_back_to_back_and_graph_replay(gen, n):
    """Consecutive launches on one stream, then a captured launch replayed with fresh inputs:
    every launch has its last CTA (a counter left non-zero would route nothing, or early)."""
    x, wr, wd, bias = make_inputs(gen, n)
    outs = [kernel.moe_front_route_cuda(x, wr, wd, bias, TOP_K, SCALING) for _ in range(4)]
    want = two_launches(x, wr, wd, bias)
    for got in outs:
        check(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.moe_front_route_cuda(x, wr, wd, bias, TOP_K, SCALING)
    for _ in range(5):
        fresh = make_inputs(gen, n)
        for dst, src in zip((x, wr, wd, bias), fresh):
            dst.copy_(src)
        for c in captured[:2]:
            c.fill_(-1)
        graph.replay()
        check(captured, two_launches(x, wr, wd, bias))


@on_gpu
def test_side_stream_takes_its_own_counter(gen):
    x, wr, wd, bias = make_inputs(gen, 2)
    main = kernel.counter(x.device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = kernel.counter(x.device)
        got = kernel.moe_front_route_cuda(x, wr, wd, bias, TOP_K, SCALING)
    torch.cuda.current_stream().wait_stream(side)
    assert other.data_ptr() != main.data_ptr()
    check(got, two_launches(x, wr, wd, bias))
    assert int(main) == 0 and int(other) == 0


@on_gpu
def test_refused_calls_take_two_launches(gen, caplog):
    """Past MAX_ROWS, or weights not packed: moe_front's and moe_route's own paths (their
    routing on their logits), the reason logged."""
    for n, unpacked in ((9, False), (1, True)):
        x, wr, wd, bias = make_inputs(gen, n)
        with caplog.at_level(logging.DEBUG, logger="k3compile.kernels"):
            got = kernel.moe_front_route_cuda(x, wr.clone() if unpacked else wr, wd, bias,
                                              TOP_K, SCALING)
        logits, z = moe_front_cuda(x, wr, wd)
        ids, weights = moe_route.moe_route_cuda(logits, bias, TOP_K, SCALING)
        assert torch.equal(got[0], ids) and torch.equal(got[1], weights)
        assert torch.equal(got[2], z)
        assert "moe_front_route" in caplog.text
