"""kda_decode / fb_kda_decode with three conv state buffers (`k_conv_state`, `v_conv_state`: one
per q / k / v, fla's three `ShortConvolution` caches, tests/models/spell8_k3.py): the op's
reference against the unfused step and against one q|k|v buffer, the pattern variant's rewrite
(also V-major), a one-buffer step left to the one-buffer variant, and the CUDA build (GPU). The
ops' schema (the conv states required, None with one buffer) and Inductor's in-place call are
the same on torch 2.11 and 2.13 (run this file under both)."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import fb_kda_decode, kda_decode

from k3compile.ops.kda_decode import KDAVariant
from tests.kernel_checks import assert_cuda_op_equals_cpu

from .pattern_checks import rewrite, targets

N = kda_decode.TENSORS  # the k and v conv states' positions in a three-state variant's inputs
NAMES = kda_decode.variant_names(True)
CONV, STATE = NAMES.index("conv_state"), NAMES.index("recurrent_state")


def _variant(T, B, dtype, v_major=False):
    return kda_decode._variant(T, B, dtype, variant=KDAVariant(state_v_major=v_major,
                                                               three_conv_states=True))


def _inputs(T, B, dtype):
    torch.manual_seed(0)
    args = _variant(T, B, dtype).example_inputs()
    args[NAMES.index("q_scale")] = kda_decode.K**-0.5
    return args


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _op_args(args, v_major=False):
    """the op's arguments: NAMES' order, the k and v conv states, then the variant (the three
    conv states are no part of it: the op reads them off the k and v states)"""
    return [*kda_decode.unthree(args), args[N], args[N + 1], "state_v_major" if v_major else ""]


def _unfused(*args, v_major=False):
    return kda_decode._step(*kda_decode.unthree(args), silu_written_out=False,
                            variant=KDAVariant(state_v_major=v_major, three_conv_states=True),
                            k_conv_state=args[N], v_conv_state=args[N + 1])


@pytest.mark.parametrize("dtype,B,T", [(torch.float32, 2, 1), (torch.float32, 2, 3),
                                       (torch.bfloat16, 1, 2)])
def test_reference_equals_the_unfused_step(dtype, B, T):
    args = _inputs(T, B, dtype)
    state, q_conv, k_conv, v_conv, o = _unfused(*_clone(args))
    got = _clone(args)
    o_op = torch.ops.k3.kda_decode(*_op_args(got))
    torch.testing.assert_close(o_op, o, rtol=0, atol=0)
    for g, w in zip((got[STATE], got[CONV], got[N], got[N + 1]), (state, q_conv, k_conv, v_conv)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["kda_decode", "fb_kda_decode"])
def test_conv_states_are_required_arguments_before_the_variant(op):
    """torch 2.11 drops trailing arguments left at their defaults before a custom op's
    ADInplaceOrView kernel, then indexes the mutated ones (session 25: an IndexError on every
    call with defaulted conv states); required ones are never dropped, on any torch"""
    args = getattr(torch.ops.k3, op).default._schema.arguments
    names = [a.name for a in args]
    i = names.index("k_conv_state")
    assert names[i:] == ["k_conv_state", "v_conv_state", "variant"]
    for a in args[i:i + 2]:
        assert not a.has_default_value() and a.alias_info is not None and a.alias_info.is_write
    assert all(a.has_default_value() for a in args[i + 2:])
    assert not any(a.has_default_value() for a in args[:i])


@pytest.mark.parametrize("three", [False, True], ids=["one_state", "three_states"])
def test_inductor_compiles_the_op_in_place(three):
    """as k3's executor on GPU graphs (`compile_fx_inner` on the graph with the op writing its
    states in place: Inductor's fallback kernel for it): the k and v conv states None or given,
    every output and state as eager, bit for bit (torch 2.11 and 2.13, session 30)"""
    from torch.fx.experimental.proxy_tensor import make_fx

    from k3compile.rewrite import inductor

    args = _inputs(1, 2, torch.float32)
    if three:
        args = _op_args(args)
    else:
        args = list(kda_decode.unthree(args))
        args[CONV] = torch.cat([args[CONV]] * 3, 1)  # one q|k|v buffer
        args += [None, None]
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def step(*ts):
        full = list(args)
        for i, t in zip(tensors, ts, strict=True):
            full[i] = t
        return (torch.ops.k3.kda_decode(*full),)

    inputs = [args[i] for i in tensors]
    gm = make_fx(step)(*_clone(inputs))
    inductor.register_fallbacks(gm)
    compiled = inductor.compile_fx_inner(gm, _clone(inputs))
    got, want = _clone(inputs), _clone(inputs)
    (o,) = compiled(list(got))  # a boxed call clears the list it is given
    torch.testing.assert_close(o, step(*want)[0], rtol=0, atol=0)
    for g, w, before in zip(got, want, inputs, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    written = sum(not torch.equal(w, before) for w, before in zip(want, inputs, strict=True))
    assert written == (4 if three else 2)


def test_three_states_equal_one_buffer():
    """the same values as one q|k|v buffer holding the three"""
    args = _inputs(2, 2, torch.float32)
    one = list(kda_decode.unthree(_clone(args)))
    one[CONV] = torch.cat([args[CONV], args[N], args[N + 1]], 1)
    o_3 = torch.ops.k3.kda_decode(*_op_args(args))
    o_1 = torch.ops.k3.kda_decode(*one, None, None)
    torch.testing.assert_close(o_3, o_1, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([args[CONV], args[N], args[N + 1]], 1), one[CONV],
                               rtol=0, atol=0)
    torch.testing.assert_close(args[STATE], one[STATE], rtol=0, atol=0)


@pytest.mark.parametrize("dtype,B,T,v_major", [(torch.float32, 2, 1, False),
                                               (torch.bfloat16, 1, 2, False),
                                               (torch.float32, 2, 2, True)])
def test_three_states_variant_rewrites_and_equals_eager(dtype, B, T, v_major):
    args = _inputs(T, B, dtype)

    def fn(*a):
        return _unfused(*a, v_major=v_major)

    gm, report = rewrite(fn, _clone(args), [_variant(T, B, dtype, v_major)], joint=True)
    assert [h.op for h in report.hits] == ["k3.kda_decode"], report
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.kda_decode.default")
    assert [a.name for a in op.args[19:21]] == [
        n.name for n in gm.graph.nodes if n.op == "placeholder"][N:N + 2]
    for w, g in zip(fn(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_one_buffer_step_is_not_the_three_states_variant():
    torch.manual_seed(0)
    one = kda_decode._variant(1, 2, torch.float32)
    args = one.example_inputs()
    args[kda_decode.NAMES.index("q_scale")] = kda_decode.K**-0.5

    def one_buffer(*a):
        return kda_decode._step(*a, silu_written_out=False)

    variant = _variant(1, 2, torch.float32)
    gm, report = rewrite(one_buffer, _clone(args), [variant], joint=True)
    assert not report.hits
    assert "k3.kda_decode.default" not in targets(gm)
    assert "three conv state" in variant.fits(gm.graph)


def _fb_step(*args):
    i = fb_kda_decode.NAMES.index
    n = len(fb_kda_decode.NAMES) - len(kda_decode.SCALARS)
    o = fb_kda_decode.search(*args[:n], *args[n + 2:], *args[n:n + 2])
    return o, args[i("conv_state")], args[n], args[n + 1], args[i("recurrent_state")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fb_three_states_variant_rewrites_and_equals_eager(dtype):
    torch.manual_seed(0)
    args = fb_kda_decode.example_inputs(dtype, three_states=True)
    args[-len(kda_decode.SCALARS) + 2] = kda_decode.K**-0.5  # q_scale
    gm, report = rewrite(_fb_step, _clone(args), fb_kda_decode.patterns())
    assert [h.pattern for h in report.hits] == ["fb_kda_decode[three_conv_states]"], report
    assert "aten.mm.default" not in targets(gm)
    for w, g in zip(_fb_step(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _kernel_inputs(B, T, S=5, three=True):
    from k3compile.kernels import kda_decode as kernel

    torch.manual_seed(0)
    H, K, taps = 2, kernel.HEAD_DIM, 4
    W = H * K
    bf = torch.bfloat16
    convs = [torch.randn(S, W, taps - 1, dtype=bf) for _ in range(3)]
    args = [*(torch.randn(B, T, W, dtype=bf) for _ in range(5)), torch.randn(B, T, H, dtype=bf),
            convs[0] if three else torch.cat(convs, 1), torch.randn(S, H, K, K) * 0.1,
            torch.tensor([4, 0, 2][:B]), *(torch.randn(W, 1, taps, dtype=bf) for _ in range(3)),
            torch.randn(H), torch.randn(W), torch.randn(K, dtype=bf), -5.0, 1e-6, K**-0.5, 1e-5]
    return args + (convs[1:] if three else [None, None])


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(2, 1), (3, 4)])
def test_cuda_op_equals_the_cpu_reference(cuda_kernels, B, T):
    """on CUDA, at K3's head dim: the three-state build against the CPU reference, the three
    conv states and the recurrent state included, two steps on the carried states"""
    args = _kernel_inputs(B, T)
    assert_cuda_op_equals_cpu(cuda_kernels, "kda_decode", args, (6, 7, 19, 20))


def test_kernel_takes_three_states_of_q_width():
    """the CUDA kernel's refusal (metadata): three [S, H·K, taps-1] states, not one of them
    missing, nor a state of the q|k|v width, nor time-major ones"""
    from k3compile.kernels import kda_decode as kernel

    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in _kernel_inputs(2, 1)]
    tensors, (k_conv, v_conv) = meta[:15], meta[19:21]
    assert kernel.refusal(*tensors, k_conv_state=k_conv, v_conv_state=v_conv) is None
    assert "three conv states" in kernel.refusal(*tensors, k_conv_state=k_conv)
    assert "three conv states" in kernel.refusal(*tensors, k_conv_state=k_conv,
                                                 v_conv_state=v_conv, variant="conv_time_major")
    wide = torch.empty(5, 3 * k_conv.shape[1], k_conv.shape[2], dtype=torch.bfloat16,
                       device="meta")
    assert "v_conv_state" in kernel.refusal(*tensors, k_conv_state=k_conv, v_conv_state=wide)
    one = [a.to("meta") if isinstance(a, torch.Tensor) else a
           for a in _kernel_inputs(2, 1, three=False)]
    assert kernel.refusal(*one[:15]) is None
    assert kernel.refusal(*one) is None  # the op's arguments in its order: None, None


@pytest.mark.parametrize("tested", [True, False])
def test_three_states_site_on_gpu_graphs(tested, monkeypatch):
    """As on a GPU graph (`kernels_only`): the three-state build fuses once it is in
    `GPU_TESTED_FLAGS` (its GPU test passed, session 30); a build not in it stays with Inductor,
    deferred naming the flag"""
    from k3compile.patterns import kda_decode as pattern

    if not tested:
        monkeypatch.setattr(pattern, "GPU_TESTED_FLAGS",
                            pattern.GPU_TESTED_FLAGS - {"three_conv_states"})
    args = _inputs(1, 2, torch.float32)
    gm, report = rewrite(_unfused, _clone(args), [_variant(1, 2, torch.float32)], joint=True,
                         kernels_only=True)
    if tested:
        assert len(report.hits) == 1 and "three_conv_states" in report.hits[0].pattern, report
        assert "k3.kda_decode.default" in targets(gm)
    else:
        assert not report.hits
        assert "three_conv_states" in report.deferred["kda_decode"], report.deferred
    for w, g in zip(_unfused(*_clone(args)), gm(*_clone(args))):
        torch.testing.assert_close(g, w)  # fused: the reference op; unfused: its own order
