"""Helpers of the kda_decode / fb_kda_decode variant tests (a variant is a `KDAVariant`: the op's
`variant` argument, its spec; the pattern variant that passes it, and the step that variant
traces): seeded inputs, the op against the unfused step, the fb variant's rewrite, the kernel's
refusal of the variant."""

from __future__ import annotations

import torch
from k3compile.patterns import fb_kda_decode, kda_decode

from k3compile.ops.kda_decode import KDAVariant
from tests.kernel_checks import kda_kernel_inputs

from .pattern_checks import rewrite, targets

STATES = (kda_decode.NAMES.index("conv_state"), kda_decode.NAMES.index("recurrent_state"))


def spec(variant: KDAVariant) -> tuple[str, ...]:
    """The op's arguments after the k and v conv states for `variant`: its spec, none for the
    default (as the pattern variants call the op)."""
    return (variant.spec,) if variant.spec else ()


def clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def decode_inputs(args, names=kda_decode.NAMES):
    """A variant's example inputs (named `names`) with a decode-sized state and the head dim's
    q scale."""
    i = names.index
    args[i("recurrent_state")] = args[i("recurrent_state")] * 0.05
    args[i("q_scale")] = kda_decode.K**-0.5
    return args


def assert_op_equals_step(step, args, variant: KDAVariant) -> None:
    """k3::kda_decode with `variant` equals the unfused step bit for bit, both states included,
    in the activations' dtype."""
    state, conv, o = step(*clone(args))
    got = clone(args)
    o_op = torch.ops.k3.kda_decode(*got, None, None, *spec(variant))
    assert o_op.dtype == o.dtype
    torch.testing.assert_close(o_op, o, rtol=0, atol=0)
    torch.testing.assert_close(got[STATES[0]], conv, rtol=0, atol=0)
    torch.testing.assert_close(got[STATES[1]], state, rtol=0, atol=0)


def assert_variant_takes(pattern, step, args, variant: KDAVariant) -> None:
    """The pattern variant (traced by `kda_decode.patterns()`) takes the unfused step into one
    k3::kda_decode whose `variant` argument is `variant`'s spec, bit for bit."""
    assert pattern.name in {p.name for p in kda_decode.patterns()}
    gm, report = rewrite(step, clone(args), [pattern], joint=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.kda_decode.default")
    assert tuple(op.args[21:]) == spec(variant)
    for w, g in zip(step(*clone(args)), gm(*clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def assert_variant_leaves(variant, step, args):
    """The pattern variant takes nothing of the unfused step, whose values stay bit for bit.
    Returns the graph after it."""
    gm, report = rewrite(step, clone(args), [variant], joint=True)
    assert not report.hits and "k3.kda_decode.default" not in targets(gm)
    for w, g in zip(step(*clone(args)), gm(*clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    return gm


def assert_fb_variant_takes(variant: KDAVariant, name: str, **options) -> None:
    """fb_kda_decode's patterns take the f_b GEMM into the kda_decode op with `variant` as the
    pattern variant `name` (`options`: `rewrite`'s, e.g. kernels_only), bit for bit."""
    torch.manual_seed(0)
    args = decode_inputs(fb_kda_decode.example_inputs(torch.bfloat16), fb_kda_decode.NAMES)
    i = fb_kda_decode.NAMES.index

    def step(*a):
        return (fb_kda_decode.search(*a, None, None, *spec(variant)), a[i("conv_state")],
                a[i("recurrent_state")])

    gm, report = rewrite(step, clone(args), fb_kda_decode.patterns(), **options)
    assert [h.pattern for h in report.hits] == [name], report
    assert "aten.mm.default" not in targets(gm)
    for w, g in zip(step(*clone(args)), gm(*clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def kernel_refusal(variant: KDAVariant) -> str | None:
    """The CUDA kernel's refusal (metadata only) of K3-sized inputs (one conv state buffer, in
    `variant`'s layout) with `variant`."""
    from k3compile.kernels import kda_decode as kernel

    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a
            for a in kda_kernel_inputs(2, 1, variant.conv_time_major)]
    return kernel.refusal(*meta, variant.spec)
