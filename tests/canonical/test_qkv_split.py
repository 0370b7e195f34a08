"""qkv_split's taps: a depthwise conv over cat([state, cat([q, k, v], -1).permute]) whose taps are
ONE [3W, 1, K] tensor (vLLM's conv weight, the red-team spelling's `conv_taps`, here behind a
q|k|v|g|f_a|b in-projection that the GEMM split does not take) gets its taps as the cat of the
pieces' row slices, the canonical form; bit-equal. Taps already a cat (our model's), pieces that
do not tile the channels and a conv that is not depthwise stay. (The GEMM split itself:
tests/canonical/test_conv_einsum.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import qkv_split
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite

B, T, W, D, TAPS = 2, 1, 16, 32, 4


def _args(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, D, generator=g).to(dtype),
            torch.randn(4 * W + 8 + 2, D, generator=g).to(dtype),  # q|k|v|g|f_a|b, one GEMM
            torch.randn(5, 3 * W, TAPS - 1, generator=g).to(dtype), torch.tensor([3, 1]),
            torch.randn(3 * W, 1, TAPS, generator=g).to(dtype)]


def _front(taps_of, pieces_of=lambda q, k, v: (q, k, v), upcast=False):
    def fn(x, w, state, slots, taps):
        q, k, v, g, fa, b = F.linear(x, w).split([W, W, W, W, 8, 2], -1)
        window = torch.cat([state[slots], torch.cat(pieces_of(q, k, v), -1).transpose(1, 2)], -1)
        taps = taps_of(taps)
        if upcast:
            window, taps = window.float(), taps.float()
        y = F.silu(F.conv1d(window, taps, groups=taps.shape[0])).transpose(1, 2)
        return *y.split(W, -1), g, fa, b, window[..., T:]
    return fn


one = _front(lambda t: t)
cat = _front(lambda t: torch.cat([t[:W], t[W:2 * W], t[2 * W:]]))  # the canonical form


@pytest.mark.parametrize(("dtype", "upcast"), [(torch.float32, False), (torch.bfloat16, True)])
def test_one_taps_tensor_becomes_a_cat_of_row_slices(dtype, upcast):
    args = _args(dtype)
    fn, canonical = (_front(lambda t: t, upcast=upcast),
                     _front(lambda t: torch.cat([t[:W], t[W:2 * W], t[2 * W:]]), upcast=upcast))
    before, after, n = rewrite(qkv_split, fn, *args, joint=True)
    assert n == 1
    _, want, _ = rewrite(qkv_split, canonical, *args, joint=True)
    assert ops(after) == ops(want) and ops(after)["slice.Tensor"] == ops(before)["slice.Tensor"] + 3
    assert_same(before, after, args)


def test_uneven_pieces_are_cut_as_the_cat_has_them():
    fn = _front(lambda t: t, lambda q, k, v: (q, torch.cat([k, v], -1)))
    args = _args()
    before, after, n = rewrite(qkv_split, fn, *args, joint=True)
    assert n == 1
    slices = [n.args[2:4] for n in after.graph.nodes
              if str(n.target) == "aten.slice.Tensor" and n.args[0].name == "taps_1"]
    assert [tuple(s) for s in slices] == [(0, W), (W, 3 * W)]
    assert_same(before, after, args)


@pytest.mark.parametrize("name", ["cat", "no_cat", "not_depthwise"])
def test_lookalikes_stay(name):
    args = _args()
    if name == "cat":
        fn = cat
    elif name == "no_cat":  # the window's new columns are one slice of the GEMM: no pieces
        def fn(x, w, state, slots, taps):
            y = F.linear(x, w)[..., :3 * W]
            window = torch.cat([state[slots], y.transpose(1, 2)], -1)
            return F.conv1d(window, taps, groups=3 * W), y
    else:
        def fn(x, w, state, slots, taps):
            q, k, v, *_ = F.linear(x, w).split([W, W, W, W, 8, 2], -1)
            window = torch.cat([state[slots], torch.cat([q, k, v], -1).transpose(1, 2)], -1)
            return F.conv1d(window, taps.view(W, 3, TAPS), groups=W)  # 3 channels a group
    before, after, n = rewrite(qkv_split, fn, *args, joint=True)
    assert n == 0 and ops(after) == ops(before)
    assert_same(before, after, args)
