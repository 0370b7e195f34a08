"""Stage `conv_layout` (k3compile/stages/kernel_layout.py): a weight that a fused op's kernel reads
contiguous (kda_decode's conv weights [C, 1, taps]) but that the graph hands it through a
permutation (spell9's Flax conv kernels [taps, 1, C], read as `permute(kernel, [2, 1, 0])`) is
re-laid by the first call, so that the view the op gets is contiguous; the values are the op's
on the weights as they were, and a later write to the weight is seen. On hand-written ATen graphs
(make_fx); spell9 end to end is in tests/e2e/test_spell9_spelling.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import k3compile.ops  # noqa: F401  (torch.ops.k3)
from k3compile.settings import Options
from k3compile.stages import Context
from k3compile.stages.kernel_layout import permuted_inputs

B, H, K, TAPS, R = 2, 2, 4, 4, 3
W = H * K
# lower_bound, l2_eps, q_scale, norm_eps; one conv state buffer (no k and v conv states)
SCALARS = (-5.0, 1e-6, K ** -0.5, 1e-5, None, None)


class Site:
    """One KDA step calling `op` with the Flax conv kernels [taps, 1, C] permuted to its
    [C, 1, taps]: the inputs, which of them are the kernels, the states and the caller's."""

    def __init__(self, op="kda_decode", seed=0):
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen)

        self.op = getattr(torch.ops.k3, op)
        fb = [randn(B, 1, R), randn(W, R)] if op == "fb_kda_decode" else [randn(B, 1, W)]
        acts = [randn(B, 1, W) for _ in range(4)] + fb + [randn(B, 1, H)]
        states = [randn(3, 3 * W, TAPS - 1), randn(3, H, K, K)]
        kernels = [nn.Parameter(randn(TAPS, 1, W) / 2, requires_grad=False) for _ in range(3)]
        self.inputs = [*acts, *states, torch.tensor([2, 0]), *kernels, randn(H), randn(W),
                       randn(K)]
        first = len(acts) + 3
        self.kernels = [first, first + 1, first + 2]
        self.states = [len(acts), len(acts) + 1]
        self.user = frozenset(range(len(acts))) | {len(acts) + 2}
        if op == "fb_kda_decode":
            self.user -= {5}  # W_fb is a weight

    def __call__(self, *a):
        first = self.kernels[0]
        flax = [c.permute(2, 1, 0) for c in a[first:first + 3]]
        return self.op(*a[:first], *flax, *a[first + 3:], *SCALARS)

    def stage(self, fn=None, user=None, **options):
        gm = make_fx(fn or self, tracing_mode="fake")(*self.inputs)
        ctx = Context(Options.make(options or None), None, inputs=list(self.inputs),
                      user_inputs=self.user if user is None else user)
        return gm, permuted_inputs(gm, ctx)

    def run(self, fn):
        """fn on the inputs with copies of the states (the op writes them), and those states."""
        inputs = list(self.inputs)
        for i in self.states:
            inputs[i] = inputs[i].clone()
        return fn(inputs), *(inputs[i] for i in self.states)


def _assert_same(got, want):
    leaves = torch.utils._pytree.tree_leaves
    for a, b in zip(leaves(got), leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["kda_decode", "fb_kda_decode"])
def test_flax_conv_kernels_are_re_laid_by_the_first_call(op):
    site = Site(op)
    kernels = [site.inputs[i] for i in site.kernels]
    values = [w.clone() for w in kernels]
    want = site.run(lambda args: site(*args))
    gm, permuted = site.stage()
    assert sorted(permuted.pending) == site.kernels
    assert set(permuted.pending.values()) == {(2, 1, 0)}
    assert not kernels[0].permute(2, 1, 0).is_contiguous(), "the compile moves nothing"
    step = permuted.wrap(lambda args: gm(*args))
    _assert_same(site.run(step), want)
    for w, v in zip(kernels, values, strict=True):  # re-laid: strides change, nothing else
        assert w.permute(2, 1, 0).is_contiguous() and w.shape == v.shape and torch.equal(w, v)
    for node in gm.graph.find_nodes(op="call_function", target=site.op.default):
        for arg in node.args[site.kernels[0]:site.kernels[0] + 3]:  # what the op is handed
            real = site.inputs[[n for n in gm.graph.nodes if n.op == "placeholder"].index(
                arg.args[0])].permute(*arg.args[1])
            assert real.is_contiguous()
    assert site.stage()[1] is None, "laid out so: a second compile has nothing to do"
    with torch.no_grad():  # a write after the re-lay reaches the graph
        kernels[1].copy_(torch.ones_like(values[1]))
    _assert_same(site.run(step), site.run(lambda args: site(*args)))


def test_the_graph_compiled_before_the_re_lay_gets_the_layout_it_was_compiled_for():
    """Inductor bakes each input's strides into its code, so the graph compiled before the re-lay
    must be handed the kernels as they were laid out then: the old tensors at the first call, and
    a copy so laid out (a later write seen) at any later call that still reaches it. A graph fed
    the re-laid kernels with the old strides read garbage (spell9's bf16 KDA step, 2026-12-05)."""
    site = Site()
    kernels = [site.inputs[i] for i in site.kernels]
    compiled_for = [w.stride() for w in kernels]
    gm, permuted = site.stage()
    seen = []

    def baked(args):  # reads its inputs only with the strides it was compiled for
        seen.append([args[i].stride() for i in site.kernels])
        return gm(*args)

    step = permuted.wrap(baked)
    want = site.run(lambda args: site(*args))
    _assert_same(site.run(step), want)
    assert all(w.permute(2, 1, 0).is_contiguous() for w in kernels), "re-laid by the first call"
    with torch.no_grad():
        kernels[1].copy_(torch.ones_like(kernels[1]))
    _assert_same(site.run(step), site.run(lambda args: site(*args)))
    assert seen == [compiled_for, compiled_for]


# ---- left alone ---------------------------------------------------------------------------------

def _left_alone(site, fn=None, user=None, **options):
    fn = fn or site
    strides = [t.stride() for t in site.inputs]
    gm, permuted = site.stage(fn, user, **options)
    assert permuted is None, permuted
    assert [t.stride() for t in site.inputs] == strides
    _assert_same(site.run(lambda args: gm(*args)), site.run(lambda args: fn(*args)))


def test_a_kernel_read_otherwise_too_is_left_alone():
    """Each weight on its own: q's kernel, also summed into an output, keeps its layout; k's and v's
    are re-laid."""
    site = Site()
    q = site.kernels[0]

    def also_summed(*a):
        return site(*a), a[q].sum()

    stride = site.inputs[q].stride()
    gm, permuted = site.stage(also_summed)
    assert sorted(permuted.pending) == site.kernels[1:]
    want = site.run(lambda args: also_summed(*args))
    _assert_same(site.run(permuted.wrap(lambda args: gm(*args))), want)
    assert site.inputs[q].stride() == stride
    assert all(site.inputs[i].permute(2, 1, 0).is_contiguous() for i in site.kernels[1:])


def test_the_callers_input_is_left_alone():
    site = Site()
    _left_alone(site, user=site.user | set(site.kernels))


def test_no_weight_moves_with_pack_weights_off():
    _left_alone(Site(), pack_weights=False)


def test_a_weight_laid_out_so_or_not_permuted_is_left_alone():
    site = Site()
    for i in site.kernels:  # [taps, 1, C], the permuted view of a contiguous [C, 1, taps]
        site.inputs[i] = nn.Parameter(site.inputs[i].permute(2, 1, 0).contiguous()
                                      .permute(2, 1, 0), requires_grad=False)
    _left_alone(site)
    for i in site.kernels:  # the op's own layout [C, 1, taps], read as it is
        site.inputs[i] = nn.Parameter(site.inputs[i].permute(2, 1, 0).contiguous(),
                                      requires_grad=False)
    _left_alone(site, lambda *a: site.op(*a, *SCALARS))
