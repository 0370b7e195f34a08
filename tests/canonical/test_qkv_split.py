"""qkv_split's taps: a depthwise conv over cat([state, cat([q, k, v], -1).permute]) whose taps are
ONE [3W, 1, K] tensor (vLLM's conv weight, the red-team spelling's `conv_taps`, here behind a
q|k|v|g|f_a|b in-projection that the GEMM split does not take) gets its taps as the cat of the
pieces' row slices, the canonical form; bit-equal. Taps already a cat (our model's), pieces that
do not tile the channels and a conv that is not depthwise stay. (The GEMM split itself:
tests/canonical/test_conv_einsum.py; spell6's cut by `unflatten(-1, (3, H, D)).unbind(2)`, and its padded
conv cropped to the causal outputs after rule conv_crop: below.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import conv_crop, qkv_split
from tests.canonical.rewrite_checks import assert_same, ops
from tests.canonical.rule_checks import rewrite
from tests.conftest import rel_err
from tests.fusions import pattern_checks

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


# spell6's KDA front (tests/models/spell6_k3.py, KDA._conv / forward): one q|k|v GEMM, the conv
# output cut by unflatten(-1, (3, H, D)).unbind(2) rather than split; H * D = W
H = 2


def _spell6_front(padded=False, pieces=3, dim=2):
    def fn(x, w, state, slots, taps):
        mixed = F.linear(x, w[:3 * W])
        window = torch.cat([state.index_select(0, slots), mixed.transpose(1, 2)], -1)
        if padded:  # spell6 as written: rule conv_crop takes it first
            y = F.conv1d(window, taps, groups=3 * W, padding=TAPS - 1)[..., TAPS - 1: TAPS - 1 + T]
        else:
            y = F.conv1d(window, taps, groups=3 * W)
        y = F.silu(y).transpose(1, 2)
        head = 3 * W // pieces // H
        return *y.unflatten(-1, (pieces, H, head)).unbind(dim), window[..., -(TAPS - 1):]
    return fn


def _split_front(x, w, state, slots, taps):  # the same with split: the form qkv_split took before
    mixed = F.linear(x, w[:3 * W])
    window = torch.cat([state.index_select(0, slots), mixed.transpose(1, 2)], -1)
    y = F.silu(F.conv1d(window, taps, groups=3 * W)).transpose(1, 2)
    return *(p.unflatten(-1, (H, W // H)) for p in y.split(W, -1)), window[..., -(TAPS - 1):]


def _gemm_split(after) -> list[tuple[int, int]]:
    return [tuple(n.args[2:4]) for n in after.graph.nodes
            if str(n.target) == "aten.slice.Tensor" and n.args[0].name != "taps_1"
            and n.args[1] == 0 and tuple(n.args[2:4]) != (0, 3 * W)]


@pytest.mark.parametrize("fn", ["unbind", "split"])
def test_unflatten_unbind_cuts_the_gemm_as_split_does(fn):
    args = _args()
    before, after, n = rewrite(qkv_split, _spell6_front() if fn == "unbind" else _split_front,
                               *args, joint=True)
    assert n == 1
    assert _gemm_split(after) == [(0, W), (W, 2 * W), (2 * W, 3 * W)]
    assert ops(after)["mm"] == 3
    for got, ref in zip(after(*args), before(*args), strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-6


def test_padded_conv_cropped_then_unbound_is_taken_after_conv_crop():
    """spell6 as written: no site for qkv_split alone; after conv_crop, one."""
    args = _args()
    fn = _spell6_front(padded=True)
    _, _, alone = rewrite(qkv_split, fn, *args, joint=True)
    before, after = (pattern_checks.graph(fn, *args, joint=True) for _ in range(2))
    counts = [conv_crop.RULE.apply(after.graph), qkv_split.RULE.apply(after.graph)]
    after.graph.eliminate_dead_code()
    after.recompile()
    assert alone == 0 and counts == [1, 1] and ops(after)["mm"] == 3
    for got, ref in zip(after(*args), before(*args), strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-6


@pytest.mark.parametrize(("pieces", "dim"), [(3, 3), (6, 2)], ids=["unbind_heads", "six"])
def test_unbind_lookalikes(pieces, dim):
    """unbind on another dim than the pieces' (the heads) stays; six equal pieces are six cuts"""
    args = _args()
    fn = _spell6_front(pieces=pieces, dim=dim)
    before, after, n = rewrite(qkv_split, fn, *args, joint=True)
    if dim == 3:
        assert n == 0 and ops(after) == ops(before)
    else:
        assert n == 1 and ops(after)["mm"] == 6
    for got, ref in zip(after(*args), before(*args), strict=True):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-6
