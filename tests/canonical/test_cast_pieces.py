"""cast_pieces: a split of a bf16 / fp16 value's upcast seen through permutes and views (spell14's
KDA `qkv.transpose(1, 2).float().view(B, T, 3, H, K).unbind(2)` once rule `unbind_split` has cut
it, and its probe `cast`, the upcast before the transpose) becomes the split of the value through
them, then an upcast of each piece, as the kda_decode pattern cuts its conv output; bit-equal. An
upcast also read whole, a computing op or a node read elsewhere on the chain, and a downcast
stay. (spell14 end to end: tests/e2e/test_spell14_spelling.py; a KDA step written in the test:
tests/fusions/test_kda_decode.py `test_a_gpt_fast_cut_and_gate_fuse_as_the_rounded_conv`.)"""

from __future__ import annotations

import pytest
import torch

from k3compile.canonical import cast_pieces, unbind_split
from tests.canonical.rule_checks import assert_same, rewritten, targets, trace

B, T, H, K = 2, 1, 4, 8
W = H * K
aten = torch.ops.aten
CAST = torch.ops.prims.convert_element_type.default


def _conv_out(dtype=torch.bfloat16):  # a short conv's channel-major output [B, 3W, T]
    return torch.randn(B, 3 * W, T, generator=torch.Generator().manual_seed(0)).to(dtype)


def _use(q, k, v):  # the pieces as the KDA step reads them: per head, each its own way
    return q * 2, k.sum(-1), v + 1


SPELLINGS = {
    # spell14 as written: transpose back to time-major, one upcast, cut by a view and unbind
    "spell14": lambda x: _use(*x.transpose(1, 2).float().view(B, T, 3, H, K).unbind(2)),
    # spell14's probe `cast`: the upcast before the transpose
    "spell14_cast_first": lambda x: _use(*x.float().transpose(1, 2).view(B, T, 3, H, K)
                                         .unbind(2)),
    # written here: upcast, `.mT`, split into three widths, then heads
    "mT_split": lambda x: _use(*(p.view(B, T, H, K) for p in x.float().mT.split(W, -1))),
}


def _canonical(x):  # the pattern's order: transpose and cut the bf16 value, upcast each piece
    return _use(*(p.float().view(B, T, H, K) for p in x.transpose(1, 2).split(W, -1)))


def _split_reads_an_upcast(gm) -> bool:
    for split in (n for n in gm.graph.nodes if n.target in cast_pieces.cast_split.SPLITS):
        node = split.args[0]
        while node.target in cast_pieces.MOVES:
            node = node.args[0]
        if node.target is CAST:
            return True
    return False


@pytest.mark.parametrize("name", sorted(SPELLINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_upcast_moves_to_each_piece(name, dtype):
    args = (_conv_out(dtype),)
    gm, (_, n) = rewritten(SPELLINGS[name], args, unbind_split.RULE, cast_pieces.RULE)
    assert n == 1 and not _split_reads_an_upcast(gm)
    assert [t for t in targets(gm) if "convert" in t] == ["prims.convert_element_type.default"] * 3
    assert_same(gm(*args), SPELLINGS[name](*args))


def test_spell14_cut_becomes_the_canonical_form():
    args = (_conv_out(),)
    gm, _ = rewritten(SPELLINGS["spell14"], args, unbind_split.RULE, cast_pieces.RULE)
    canonical, (n,) = rewritten(_canonical, args, cast_pieces.RULE)
    assert n == 0
    assert sorted(targets(gm)) == sorted(targets(trace(_canonical, args)))
    assert_same(gm(*args), canonical(*args))


def _read_whole(x):
    up = x.transpose(1, 2).float()
    q, k, v = up.split(W, -1)
    return q * k + v, up.sum()


def _computed(x):  # a product between the upcast and the cut: not a value-moving op
    return (x.float() * 2).transpose(1, 2).split(W, -1)


def _downcast(x):  # an fp32 value rounded, then cut (the patterns round before the cut)
    return (x.float() * 2).to(torch.bfloat16).transpose(1, 2).split(W, -1)


def _permute_read_elsewhere(x):
    t = x.float().transpose(1, 2)
    q, k, v = t.split(W, -1)
    return q + k + v, t * 3


def _integer(x):
    return (x > 0).to(torch.int32).transpose(1, 2).split(W, -1)


@pytest.mark.parametrize("fn", [_read_whole, _computed, _downcast, _permute_read_elsewhere,
                                _integer])
def test_look_alikes_are_left_alone(fn):
    args = (_conv_out(),)
    gm, (n,) = rewritten(fn, args, cast_pieces.RULE)
    assert n == 0
    assert targets(gm) == targets(trace(fn, args))
    assert_same(gm(*args), fn(*args))
