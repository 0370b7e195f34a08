"""allreduce_attn_res_mix_norm: the attention output's all-reduce (functional collectives:
`_c10d_functional.all_reduce` + `wait_tensor`) folded into the post-attention depth mix + RMSNorm,
with the prefix add and where a block starts. The graphs run on a gloo group of world size 1 in
this process: the op's CPU implementation does the all-reduce on the captured group's name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from k3compile.patterns import allreduce_attn_res_mix_norm, attn_res_mix_norm

from k3compile.math import depth_mix_scores_fp32, depth_mix_weights, rms_norm
from k3compile.rewrite import apply_patterns

from .pattern_checks import assert_near_miss, assert_rewritten_equal, rewrite, targets

D, MIX_EPS, NORM_EPS = 64, 1e-6, 1e-5
_c10d = torch.ops._c10d_functional
MIX, FUSED = attn_res_mix_norm.patterns(), allreduce_attn_res_mix_norm.patterns()  # traced once


@pytest.fixture(scope="module")
def group() -> str:
    """The name of a world-size-1 gloo group (the default group, unless one exists already)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    if created:
        dist.destroy_process_group()


def _inputs(n_blocks=2, with_prefix=True, dtype=torch.bfloat16, partial_dtype=None):
    g = torch.Generator().manual_seed(n_blocks)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)
    partial = rnd(3, 1, D).to(partial_dtype or dtype)  # this rank's o_proj partial sums
    acts = [rnd(3, 1, D) for _ in range(with_prefix + n_blocks)]  # [prefix], blocks
    weights = [(1 + 0.1 * torch.randn(D, generator=g)).to(dtype), rnd(1, D),
               (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)]
    return [partial, *acts, *weights]


def _reduce(partial, group_name):
    return _c10d.wait_tensor(_c10d.all_reduce(partial, "sum", group_name))


def _model(with_prefix, group_name, mix=depth_mix_weights):
    """The model's unfused spelling under TP: all-reduce, then the mix and norm (k3compile.math;
    `mix` depth_mix_scores_fp32: Moonshot's fp32 scores in canonical form)."""
    def post_mix(partial, prefix, *rest):
        *blocks, wmn, wmp, wn = rest
        prefix_out = prefix + _reduce(partial, group_name)
        h = mix(prefix_out, blocks, wmn, wmp, MIX_EPS)
        return rms_norm(h, wn, NORM_EPS), prefix_out

    def new_block(partial, *rest):  # a block starts: the reduced output is the next prefix
        *blocks, wmn, wmp, wn = rest
        a = _reduce(partial, group_name)
        return rms_norm(mix(a, blocks, wmn, wmp, MIX_EPS), wn, NORM_EPS), a

    return post_mix if with_prefix else new_block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_prefix", [True, False])
@pytest.mark.parametrize("n_blocks", [1, 3, 8])
def test_rewrites_and_equals_eager(group, n_blocks, with_prefix, dtype):
    """As in the backend: attn_res_mix_norm first, then the all-reduce folds into its op."""
    fn, args = _model(with_prefix, group), _inputs(n_blocks, with_prefix, dtype)
    gm, mixed = rewrite(fn, args, MIX)
    assert len(mixed.hits) == 1, mixed
    report = apply_patterns(gm.graph, FUSED)
    gm.recompile()
    assert_rewritten_equal(gm, report, fn, args, "k3.allreduce_attn_res_mix_norm")
    kind = "prefix" if with_prefix else "new_block"
    name = f"allreduce_attn_res_mix_norm[blocks={n_blocks},{kind}"
    assert report.hits[0].pattern.startswith(name)
    op = next(n for n in gm.graph.nodes
              if str(n.target) == "k3.allreduce_attn_res_mix_norm.default")
    assert op.args[-3:] == (MIX_EPS, NORM_EPS, group)  # the graph's group, not the sentinel
    assert (op.args[1] is None) == (not with_prefix) and len(op.args[2]) == n_blocks
    left = " ".join(targets(gm))
    assert "all_reduce" not in left and "wait_tensor" not in left
    assert "k3.attn_res_mix_norm" not in left


@pytest.mark.parametrize("with_prefix", [True, False])
def test_fp32_scores_carry_over(group, with_prefix):
    """The mix's fp32-scores variant (Moonshot's, bf16) folds the all-reduce in too and passes
    scores_fp32=True on; bit-equal to the unfused graph."""
    fn, args = _model(with_prefix, group, depth_mix_scores_fp32), _inputs(2, with_prefix)
    gm, mixed = rewrite(fn, args, MIX)
    assert [h.pattern.endswith(",scores_fp32]") for h in mixed.hits] == [True]
    report = apply_patterns(gm.graph, FUSED)
    gm.recompile()
    assert_rewritten_equal(gm, report, fn, args, "k3.allreduce_attn_res_mix_norm")
    assert report.hits[0].pattern.endswith(",scores_fp32]")
    op = next(n for n in gm.graph.nodes
              if str(n.target) == "k3.allreduce_attn_res_mix_norm.default")
    assert op.args[-4:] == (MIX_EPS, NORM_EPS, group, True)


def _post_mix_op(group_name, escape=False):
    """The graph after attn_res_mix_norm; `escape` also returns the reduced attention output."""
    def fn(partial, prefix, b0, b1, wmn, wmp, wn):
        a = _reduce(partial, group_name)
        p, x = torch.ops.k3.attn_res_mix_norm(prefix, a, [b0, b1], wmn, wmp, wn, MIX_EPS, NORM_EPS)
        return (x, p, a) if escape else (x, p)

    return fn


def test_escaping_reduced_output_is_a_near_miss(group):
    """The fused op never materialises the reduced output, so a second user of it keeps the
    collective; the graph still computes the unfused values."""
    fn, args = _post_mix_op(group, escape=True), _inputs()
    gm, report = rewrite(fn, args, FUSED)
    assert_near_miss(report, "allreduce_attn_res_mix_norm[blocks=2,prefix",
                     "multiple_users: wait_tensor")
    for got, want in zip(gm(*args), fn(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_check_refuses_an_integer_partial(group):
    args = _inputs(partial_dtype=torch.int32)
    _, report = rewrite(_post_mix_op(group), args, FUSED)
    assert_near_miss(report, "allreduce_attn_res_mix_norm[blocks=2,prefix", "check refused",
                     "partial dtype torch.int32 is not a float type")
