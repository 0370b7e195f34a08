"""conv_round: KDA's short conv run in bf16 / fp16 (`F.conv1d` on the activations, its SiLU after
it in that dtype: the red-team spelling) becomes the canonical fp32 conv + SiLU rounded once, to
rounding (2 ulps of the largest value, as conv_einsum takes the bmm form); look-alikes stay: an
fp32 conv, a conv with no SiLU, another activation, a channel-mixing conv."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import conv_round
from tests.conftest import rel_err
from tests.fusions.pattern_checks import graph, targets

B, C, TAPS = 2, 48, 4


def _args(dtype=torch.bfloat16, batch=B):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, C, generator=g).to(dtype),
            torch.randn(5, C, TAPS - 1, generator=g).to(dtype), torch.tensor([3, 1][:batch]),
            (torch.randn(C, 1, TAPS, generator=g) * 0.5).to(dtype)]


def _window(x, state, slots):
    return torch.cat([state[slots], x.unsqueeze(-1)], -1)


def _red_team(x, state, slots, taps):
    """the red-team spelling's conv: bf16 conv1d, then F.silu in bf16"""
    window = _window(x, state, slots)
    return F.silu(F.conv1d(window, taps, groups=C)), window[..., 1:]


def _rewrite(fn, args):
    before, after = graph(fn, *args, joint=True), graph(fn, *args, joint=True)
    n = conv_round.apply(after.graph)
    after.graph.eliminate_dead_code()
    after.recompile()
    return before, after, n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
def test_low_precision_conv_and_silu_become_the_fp32_conv_rounded_once(dtype, batch):
    args = _args(dtype, batch)
    before, after, n = _rewrite(_red_team, args)
    assert n == 1
    conv = next(n for n in after.graph.nodes if str(n.target) == "aten.convolution.default")
    assert conv.meta["val"].dtype == torch.float32
    exact = _red_team(*[a.double() if a.is_floating_point() else a for a in args])
    eps = torch.finfo(dtype).eps
    for got, want, truth in zip(after(*args), before(*args), exact, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 2 * eps
        assert rel_err(got, truth) <= max(rel_err(want, truth), eps / 2)


def test_the_canonical_form_follows():
    """what the rule writes is kda_decode's conv: fp32 conv, c·σ(c), one cast"""
    _, after, _ = _rewrite(_red_team, _args())
    t = targets(after)
    assert t.count("prims.convert_element_type.default") == 3  # window, taps, the result
    assert "aten.sigmoid.default" in t and "aten.neg.default" not in t


def _tanh_tail(x, state, slots, taps):
    return torch.tanh(F.conv1d(_window(x, state, slots), taps, groups=C) * 2)


def _no_tail(x, state, slots, taps):
    return F.conv1d(_window(x, state, slots), taps, groups=C) + x.unsqueeze(-1)


def _mixing(x, state, slots, taps):
    """a conv that mixes channels (groups 1): not a short conv"""
    return F.silu(F.conv1d(_window(x, state, slots), taps[:4].expand(4, C, TAPS).contiguous()))


LOOK_ALIKES = {
    "fp32": (_red_team, torch.float32),
    "tanh_tail": (_tanh_tail, torch.bfloat16),
    "no_tail": (_no_tail, torch.bfloat16),
    "mixing": (_mixing, torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alikes_stay(name):
    fn, dtype = LOOK_ALIKES[name]
    args = _args(dtype)
    before, after, n = _rewrite(fn, args)
    assert n == 0 and targets(after) == targets(before)
    for got, want in zip(after(*args), before(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
