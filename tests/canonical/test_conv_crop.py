"""conv_crop: a padded 1-d conv of which only outputs reading no padding are kept (spell6's
`conv1d(window, taps, groups=C, padding=K-1)[..., K-1 : K-1+T]`) becomes the unpadded conv
(sliced where less than all of it is kept), equal to the unrewritten graph; slices reaching into
the padding, strided slices and convs read elsewhere stay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import conv_crop
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite

C, K = 24, 4


def _args(t, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, C, K - 1 + t, generator=g).to(dtype),
            torch.randn(C, 1, K, generator=g).to(dtype)]


def _causal(t):  # spell6's KDA._conv
    return lambda x, w: F.silu(F.conv1d(x, w, groups=C, padding=K - 1)[..., K - 1: K - 1 + t])


def _inner(x, w):  # a part of the valid outputs, padding 2, negative end
    return F.conv1d(x, w, groups=C, padding=2)[..., 3:-3]


def _bias(x, w):  # a bias, a dense (not depthwise) conv, a negative end
    return F.conv1d(x, w.view(C, 1, K).expand(C, C, K), torch.ones(C, dtype=x.dtype), padding=1)[:, :, 1:-1]


SPELLED = {"causal_t1": (_causal(1), 1), "causal_t3": (_causal(3), 3), "inner": (_inner, 4),
           "bias_dense_open_end": (_bias, 5)}


def _read_elsewhere(x, w):
    y = F.conv1d(x, w, groups=C, padding=K - 1)
    return y[..., K - 1: K], y


LOOKALIKES = {
    "reads_left_padding": lambda x, w: F.conv1d(x, w, groups=C, padding=K - 1)[..., K - 2: K],
    "reads_right_padding": lambda x, w: F.conv1d(x, w, groups=C, padding=K - 1)[..., K - 1:],
    "strided_slice": lambda x, w: F.conv1d(x, w, groups=C, padding=K - 1)[..., K - 1: K + 2: 2],
    "channel_slice": lambda x, w: F.conv1d(x, w, groups=C, padding=K - 1)[:, 4:8],
    "dilated": lambda x, w: F.conv1d(x, w, groups=C, padding=K - 1, dilation=2)[..., K - 1: K],
    "read_elsewhere": _read_elsewhere,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(SPELLED))
def test_padded_conv_cropped_to_valid_outputs_is_the_unpadded_conv(name, dtype):
    fn, t = SPELLED[name]
    args = _args(t, dtype)
    before, after, n = rewrite(conv_crop.RULE, fn, *args, joint=True)
    assert n == 1
    pads = [list(n.args[4]) for n in after.graph.nodes
            if str(n.target) == "aten.convolution.default"]
    assert pads == [[0]]
    assert_same(before, after, args)


def test_whole_valid_output_needs_no_slice():
    args = _args(3)
    before, after, n = rewrite(conv_crop.RULE, _causal(3), *args, joint=True)
    assert n == 1 and ops(after).get("slice.Tensor", 0) == ops(before)["slice.Tensor"] - 1


@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_stay(name):
    args = _args(3)
    before, after, n = rewrite(conv_crop.RULE, LOOKALIKES[name], *args, joint=True)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)
