"""depth_mix_scores: an AttnRes depth mix over sources stacked on dim 0 whose scores are spelled
otherwise than a canonical form (a paper's einsum against the folded `w_norm * w_proj[0]`, a
broadcast product summed over D, a matmul with the folded vector) becomes the canonical mix
(`k3compile.math.depth_mix_weights`'s ops), with its values within fp32 rounding, dtype and shape.
A mix already canonical (also one whose ops are a canonical form's: `(v * rsqrt(..) * wn * wp).sum(-1)`
is left to rule `depth_mix`), one of other values (no norm, squared weights), one rounding in bf16
where the canonical form does not, and a softmax over another dim are left alone."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import depth_mix_scores
from k3compile.canonical.depth_mix import _VIEWS
from k3compile.math import depth_mix_weights
from tests.canonical.rule_checks import rewrite, targets
from tests.conftest import rel_err
from tests.fusions.pattern_checks import graph

B, T, D, EPS = 2, 1, 16, 1e-5

_rewrite = functools.partial(rewrite, depth_mix_scores)


def _args(n_blocks=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(n_blocks)
    acts = [torch.randn(B, T, D, generator=g).to(dtype) for _ in range(n_blocks + 1)]
    return [*acts, (1 + 0.1 * torch.randn(D, generator=g)).to(dtype),
            (D ** -0.5 * torch.randn(1, D, generator=g)).to(dtype)]


def _normed(v):
    return v / torch.sqrt(torch.mean(v ** 2, dim=-1, keepdim=True) + EPS)


def _einsum_folded(*args):  # tests/models/spell8_k3.py
    *srcs, wn, wp = args
    v = torch.stack(srcs, dim=0).float()
    scores = torch.einsum("s...d,d->s...", _normed(v), wn.float() * wp[0].float())
    return torch.einsum("s...,s...d->...d", torch.softmax(scores, dim=0), v).to(srcs[-1].dtype)


def _broadcast_sum(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    scores = (_normed(v) * (wn * wp.view(-1))).sum(-1)
    alpha = scores.softmax(0)
    return (alpha.unsqueeze(-1) * v).sum(0).to(srcs[-1].dtype)


def _matmul_folded(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    alpha = torch.softmax(_normed(v) @ (wn * wp.squeeze(0)), dim=0)
    return torch.einsum("sbt,sbtd->btd", alpha, v).to(srcs[-1].dtype)


SPELLINGS = {"einsum_folded": _einsum_folded, "broadcast_sum": _broadcast_sum,
             "matmul_folded": _matmul_folded}


def _canonical(*args):
    *srcs, wn, wp = args
    return depth_mix_weights(srcs[-1], list(srcs[:-1]), wn, wp, EPS)


def _ops(gm) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes
                               if n.op == "call_function" and n.target not in _VIEWS)


@pytest.mark.parametrize("n_blocks", [1, 3])
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spelling_becomes_the_canonical_mix(name, n_blocks):
    args = _args(n_blocks)
    before, after, n = _rewrite(SPELLINGS[name], *args)
    assert n == 1
    assert _ops(after) == _ops(graph(_canonical, *args))
    got, want = after(*args), before(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 1e-6  # summation order and the fold's association only


def _no_norm(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    scores = torch.einsum("s...d,d->s...", v, wn * wp[0])
    return torch.einsum("s...,s...d->...d", torch.softmax(scores, dim=0), v)


def _squared_weights(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    alpha = torch.softmax(torch.einsum("s...d,d->s...", _normed(v), wn * wp[0]), dim=0)
    return torch.einsum("s...,s...d->...d", alpha * alpha, v)


def _softmax_over_batch(*args):
    *srcs, wn, wp = args
    x = torch.stack(srcs, dim=1).float()  # [B, S, T, D]: dim 0 is the batch
    alpha = torch.softmax(torch.einsum("bstd,d->bst", _normed(x), wn * wp[0]), dim=0)
    return torch.einsum("bstd,bst->std", x, alpha)


def _bf16_scores(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs)  # bf16 throughout: rounds where the canonical forms do not
    scores = torch.einsum("s...d,d->s...", _normed(v), wn * wp[0]).float()
    return torch.einsum("s...,s...d->...d", torch.softmax(scores, dim=0), v.float())


def _canonical_ops(*args):  # the canonical form's ops, spelled by hand: left to depth_mix
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    scores = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * wn * wp.view(-1)).sum(-1)
    return (scores.softmax(0).unsqueeze(-1) * v).sum(0)


LOOK_ALIKES = {"canonical": _canonical, "canonical_ops": _canonical_ops, "no_norm": _no_norm, "squared_weights": _squared_weights,
               "softmax_over_batch": _softmax_over_batch, "bf16_scores": _bf16_scores}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alike_is_left_alone(name):
    args = _args(2, torch.bfloat16 if name.startswith("bf16") else torch.float32)
    before, after, n = _rewrite(LOOK_ALIKES[name], *args)
    assert n == 0
    assert targets(after) == targets(before)
    torch.testing.assert_close(after(*args), before(*args), rtol=0, atol=0)


def test_a_mix_whose_alpha_escapes_is_left_alone():
    def escaping(*args):
        *srcs, wn, wp = args
        v = torch.stack(srcs).float()
        alpha = torch.softmax(torch.einsum("s...d,d->s...", _normed(v), wn * wp[0]), dim=0)
        return torch.einsum("s...,s...d->...d", alpha, v), F.relu(alpha)

    args = _args(2)
    before, after, n = _rewrite(escaping, *args)
    assert n == 0 and targets(after) == targets(before)
