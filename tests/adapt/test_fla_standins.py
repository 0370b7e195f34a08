"""k3compile's torch stand-ins for fla (`k3compile.adapt.fla`) against fla's documented semantics,
each written here a second, independent way: the KDA recurrence as fla's naive reference states
it (state [K, V] per head, decay in log space, q·S after the update), ShortConvolution as
`nn.Conv1d` with causal padding, FusedRMSNormGated from its formula. Step-by-step decoding with
the cache equals the whole-sequence result in both cache layouts (fla's W, the adapter's W - 1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.adapt import fla

B, T, H, K = 2, 5, 3, 8


def _kda_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, graw = (torch.randn(B, T, H, K, generator=g) for _ in range(4))
    beta = torch.randn(B, T, H, generator=g)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.5, torch.randn(H * K, generator=g) * 0.5
    return q, k, v, graw, beta, A_log, dt_bias


def naive_kda(q, k, v, graw, beta, A_log, dt_bias, lower_bound, state=None):
    """fla's naive recurrence with the in-kernel gate, l2norm and sigmoid(beta)."""
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    f = graw + dt_bias.view(H, K)
    if lower_bound is None:
        log_decay = -A_log.exp().view(H, 1) * F.softplus(f)
    else:
        log_decay = lower_bound * torch.sigmoid(A_log.exp().view(H, 1) * f)
    b = torch.sigmoid(beta)
    S = torch.zeros(B, H, K, K) if state is None else state.clone()
    out = torch.zeros_like(v)
    for i in range(T):
        S = S * log_decay[:, i, ..., None].exp()
        delta = v[:, i] - (k[:, i, ..., None] * S).sum(-2)
        S = S + torch.einsum("bhk,bhv->bhkv", b[:, i, :, None] * k[:, i], delta)
        out[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i], S)
    return out, S


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("v_first", [False, True])
def test_fused_recurrent_kda_is_the_gated_delta_rule(lower_bound, v_first):
    q, k, v, graw, beta, A_log, dt_bias = _kda_inputs()
    h0 = torch.randn(B, H, K, K) * 0.1
    want_o, want_s = naive_kda(q, k, v, graw, beta, A_log, dt_bias, lower_bound, h0)
    init = h0.transpose(-1, -2) if v_first else h0
    o, s = fla.fused_recurrent_kda(q, k, v, graw, beta, A_log=A_log, dt_bias=dt_bias,
                                   initial_state=init, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound,
                                   transpose_state_layout=v_first)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.transpose(-1, -2) if v_first else s, want_s, rtol=1e-5,
                               atol=1e-6)
    assert s.dtype == torch.float32 and o.dtype == v.dtype


def test_chunk_kda_equals_token_by_token_decoding():
    q, k, v, graw, beta, A_log, dt_bias = _kda_inputs(1)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, output_final_state=True)
    whole, final = fla.chunk_kda(q, k, v, graw, beta, safe_gate=True, **kw)
    state, outs = None, []
    for t in range(T):
        sl = slice(t, t + 1)
        o, state = fla.fused_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], graw[:, sl],
                                           beta[:, sl], initial_state=state, **kw)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, final, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kept", ["fla", "adapter"])
def test_short_convolution_is_a_causal_depthwise_conv(kept):
    torch.manual_seed(0)
    D, W = 6, 4
    conv = fla.ShortConvolution(D, W, activation="silu")
    x = torch.randn(B, T, D)
    reference = torch.nn.Conv1d(D, D, W, groups=D, bias=False, padding=W - 1)
    reference.weight.data.copy_(conv.weight)
    want = F.silu(reference(x.transpose(1, 2))[..., :T]).transpose(1, 2)
    y, _ = conv(x)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    # decoding one token at a time through the cache gives the same outputs
    cache = torch.zeros(B, D, W if kept == "fla" else W - 1)
    steps = []
    for t in range(T):
        y_t, cache = conv(x[:, t:t + 1], cache=cache, output_final_state=True)
        steps.append(y_t)
        assert cache.shape[-1] == (W if kept == "fla" else W - 1)
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[..., -(W - 1):], x[:, -(W - 1):].transpose(1, 2))


def test_fused_rms_norm_gated_is_its_formula():
    torch.manual_seed(0)
    norm = fla.FusedRMSNormGated(K, eps=1e-5, activation="sigmoid")
    norm.weight.data.normal_()
    x, g = torch.randn(B, T, H, K).bfloat16(), torch.randn(B, T, H, K).bfloat16()
    xf = x.float()
    want = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight * \
        torch.sigmoid(g.float())
    got = norm(x, g)  # fp32 math inside, one rounding: within one bf16 step of the formula
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(norm(xf, g.float()), want, rtol=1e-6, atol=1e-6)


def test_installed_stand_ins_are_importable_and_then_gone():
    import sys

    before = "fla" in sys.modules
    with fla.installed():
        from fla.modules import ShortConvolution
        from fla.ops.kda import fused_recurrent_kda

        assert ShortConvolution is fla.ShortConvolution
        assert fused_recurrent_kda is fla.fused_recurrent_kda
    assert ("fla" in sys.modules) == before
