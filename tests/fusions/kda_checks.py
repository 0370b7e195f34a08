"""Helpers of the kda_decode / fb_kda_decode variant tests (a variant is the op's trailing flags,
the pattern variant that passes them, and the step that variant traces): seeded inputs, the op
against the unfused step, the fb variant's rewrite, the kernel's refusal of the flags."""

from __future__ import annotations

import torch
from k3compile.patterns import fb_kda_decode, kda_decode

from tests.kernel_checks import kda_kernel_inputs

from .pattern_checks import rewrite, targets

STATES = (kda_decode.NAMES.index("conv_state"), kda_decode.NAMES.index("recurrent_state"))


def clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def decode_inputs(args, names=kda_decode.NAMES):
    """A variant's example inputs (named `names`) with a decode-sized state and the head dim's
    q scale."""
    i = names.index
    args[i("recurrent_state")] = args[i("recurrent_state")] * 0.05
    args[i("q_scale")] = kda_decode.K**-0.5
    return args


def assert_op_equals_step(step, args, flags) -> None:
    """k3::kda_decode with `flags` equals the unfused step bit for bit, both states included,
    in the activations' dtype."""
    state, conv, o = step(*clone(args))
    got = clone(args)
    o_op = torch.ops.k3.kda_decode(*got, None, None, *flags)
    assert o_op.dtype == o.dtype
    torch.testing.assert_close(o_op, o, rtol=0, atol=0)
    torch.testing.assert_close(got[STATES[0]], conv, rtol=0, atol=0)
    torch.testing.assert_close(got[STATES[1]], state, rtol=0, atol=0)


def assert_variant_takes(variant, step, args, flags) -> None:
    """The pattern variant (traced by `kda_decode.patterns()`) takes the unfused step into one
    k3::kda_decode whose trailing arguments are `flags`, bit for bit."""
    assert variant.name in {p.name for p in kda_decode.patterns()}
    gm, report = rewrite(step, clone(args), [variant], joint=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.kda_decode.default")
    assert tuple(op.args[-len(flags):]) == flags
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


def assert_fb_variant_takes(flags, name: str, **options) -> None:
    """fb_kda_decode's patterns take the f_b GEMM into the kda_decode op with `flags` as the
    variant `name` (`options`: `rewrite`'s, e.g. kernels_only), bit for bit."""
    torch.manual_seed(0)
    args = decode_inputs(fb_kda_decode.example_inputs(torch.bfloat16), fb_kda_decode.NAMES)
    i = fb_kda_decode.NAMES.index

    def step(*a):
        return (fb_kda_decode.search(*a, None, None, *flags), a[i("conv_state")],
                a[i("recurrent_state")])

    gm, report = rewrite(step, clone(args), fb_kda_decode.patterns(), **options)
    assert [h.pattern for h in report.hits] == [name], report
    assert "aten.mm.default" not in targets(gm)
    for w, g in zip(step(*clone(args)), gm(*clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def kernel_refusal(flags, time_major: bool = False) -> str | None:
    """The CUDA kernel's refusal (metadata only) of K3-sized inputs with `flags`."""
    from k3compile.kernels import kda_decode as kernel

    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a
            for a in kda_kernel_inputs(2, 1, time_major)]
    return kernel.refusal(*meta, *flags)
