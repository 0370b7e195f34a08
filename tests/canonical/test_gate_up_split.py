"""gate_up_split: a GLU's gate and up halves cut from one gate|up GEMM become two GEMMs on the
weight's row halves (the form two nn.Linear trace to), and slices of a cat that are one of its
inputs become that input; equal values, dtype and shape; other splits of a GEMM stay."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import k3compile.backend as k3be
from k3compile.canonical import gate_up_split
from k3compile.math import situ
from tests.canonical.rule_checks import rewrite
from tests.conftest import TOL, rel_err
from tests.fusions.attention_checks import compile_with
from tests.fusions.pattern_checks import targets

D, I, BETA, LBETA = 32, 24, 4.0, 25.0


_rewrite = functools.partial(rewrite, gate_up_split)


def _args(rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(rank)
    lead = (2, 1) if rank == 3 else (3,)
    return torch.randn(*lead, D, generator=g).to(dtype), torch.randn(2 * I, D, generator=g).to(dtype)


def _situ_chunk(x, w):
    g, u = F.linear(x, w).chunk(2, -1)
    return situ(g, u, BETA, LBETA)


def _situ_slices(x, w):
    y = x @ w.T
    return situ(y[..., :I], y[..., I:], BETA, LBETA)


def _swiglu_split(x, w):
    g, u = F.linear(x, w).split(I, dim=-1)
    return F.silu(g) * u


def _situ_unbind(x, w):
    """gate|up as [..., 2, I] halves unbound (tests/spellings/blind_k3.py's shared experts)."""
    y = F.linear(x, w)
    g, u = y.view(*y.shape[:-1], 2, I).unbind(-2)
    return situ(g, u, BETA, LBETA)


def _situ_negative_slice(x, w):
    y = F.linear(x, w)
    return situ(y[..., :-I], y[..., -I:], BETA, LBETA)


def _moonshot_cat(x, w):
    """Moonshot's SituAndMul on cat([w1(x), w3(x)], -1)."""
    gate_up = torch.cat([F.linear(x, w[:I]), F.linear(x, w[I:])], dim=-1)
    d = gate_up.shape[-1] // 2
    g, u = gate_up[..., :d].float(), gate_up[..., d:].float()
    act = BETA * torch.tanh(g / BETA) * torch.sigmoid(g)
    return (act * (LBETA * torch.tanh(u / LBETA))).to(x.dtype)


SPLIT_GEMM = {"chunk": _situ_chunk, "slices": _situ_slices, "swiglu_split": _swiglu_split,
              "unbind": _situ_unbind, "negative_slice": _situ_negative_slice}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("name", sorted(SPLIT_GEMM))
def test_halves_of_one_gemm_become_two_gemms(name, rank, dtype):
    x, w = _args(rank, dtype)
    before, after, n = _rewrite(SPLIT_GEMM[name], x, w)
    assert n == 1
    mms = [node for node in after.graph.nodes if str(node.target) == "aten.mm.default"]
    assert len(mms) == 2
    rows = []
    for mm in mms:  # mm(x, permute(slice(W, 0, lo, hi), [1, 0])): F.linear on a row block
        perm = mm.args[1]
        assert str(perm.target) == "aten.permute.default" and list(perm.args[1]) == [1, 0]
        assert str(perm.args[0].target) == "aten.slice.Tensor" and perm.args[0].args[1] == 0
        rows.append(tuple(perm.args[0].args[2:4]))
    assert sorted(rows) == [(0, I), (I, 2 * I)]
    assert not {"aten.split.Tensor", "aten.split_with_sizes.default"} & set(targets(after))
    got, want = after(x, w), before(x, w)
    assert got.dtype == want.dtype and got.shape == want.shape
    # a GEMM's column depends on its weight row only; BLAS may block the two shapes differently
    assert rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("rank", [2, 3])
def test_slices_of_a_cat_are_its_inputs(rank):
    x, w = _args(rank)
    before, after, n = _rewrite(_moonshot_cat, x, w)
    assert n == 2
    assert "aten.cat.default" not in targets(after)
    # no arithmetic moved, but CPU tanh / sigmoid take other code paths on the contiguous input
    # than on the strided slice (an ulp apart)
    assert rel_err(after(x, w), before(x, w)) <= 1e-6


def _kv_a_split(x, w):
    """MLA's kv_a: one GEMM split into the latent (normed) and the rope part (canonical as is)."""
    c, pe = F.linear(x, w).split([I + 8, I - 8], dim=-1)
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
    return c, pe


def _escaping_half(x, w):
    g, u = F.linear(x, w).chunk(2, -1)
    return situ(g, u, BETA, LBETA), g  # the gate half is also an output


def _reductions(x, w):
    g, u = F.linear(x, w).chunk(2, -1)
    return g.sum(-1, keepdim=True) * u


def _whole_also_used(x, w):
    y = F.linear(x, w)
    g, u = y.chunk(2, -1)
    return F.silu(g) * u, y


def _three_parts(x, w):
    a, b, c = F.linear(x, w).split(2 * I // 3, -1)
    return a * b * c


def _interleaved(x, w):
    y = F.linear(x, w)
    return F.silu(y[..., 0::2]) * y[..., 1::2]


def _unbind_interleaved(x, w):
    """[..., I, 2].unbind(-1) takes every other column: not the two halves."""
    y = F.linear(x, w)
    g, u = y.view(*y.shape[:-1], I, 2).unbind(-1)
    return F.silu(g) * u


def _unbind_not_last(x, w):
    """a view splitting a leading dim, unbound there: no cut of the GEMM's columns."""
    y = F.linear(x, w)
    a, b = y.view(2, -1, y.shape[-1])[:, :1].unbind(0) if y.dim() == 3 else (y, y)
    return a * b


def _cat_slice_straddles(x, w):
    gate_up = torch.cat([F.linear(x, w[:I]), F.linear(x, w[I:])], dim=-1)
    return gate_up[..., 4:I + 4]


LOOK_ALIKES = {"kv_a_split": _kv_a_split, "escaping_half": _escaping_half,
               "reductions": _reductions, "whole_also_used": _whole_also_used,
               "three_parts": _three_parts, "interleaved": _interleaved,
               "unbind_interleaved": _unbind_interleaved, "unbind_not_last": _unbind_not_last,
               "cat_slice_straddles": _cat_slice_straddles}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alike_is_left_alone(name):
    x, w = _args(3)
    before, after, n = _rewrite(LOOK_ALIKES[name], x, w)
    assert n == 0
    assert targets(after) == targets(before)
    for got, want in zip(*(torch.utils._pytree.tree_leaves(f(x, w)) for f in (after, before))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- q_a | kv_a as one GEMM: cut before each RMS-normed piece --------------------------------

Q, C, R = 16, 12, 4  # 2 * I = Q + C + R + 16: the g columns trail in the no-norm look-alike


def _rms(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _qkv_a(x, w):
    """vLLM's fused_qkv_a_proj: one GEMM split [cq | c_kv | k_pe], cq and c_kv normed."""
    cq, ckv, kpe = F.linear(x, w[:Q + C + R]).split([Q, C, R], dim=-1)
    return _rms(cq, torch.ones(Q, dtype=x.dtype)), _rms(ckv, torch.ones(C, dtype=x.dtype)), kpe


def _qkv_a_slices(x, w):
    y = x @ w[:Q + C + R].T
    return _rms(y[..., :Q], 1.0), _rms(y[..., Q:Q + C], 1.0), y[..., Q + C:] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("fn", [_qkv_a, _qkv_a_slices])
def test_qkv_a_gemm_is_cut_into_q_a_and_kv_a(fn, rank, dtype):
    x, w = _args(rank, dtype)
    before, after, n = _rewrite(fn, x, w)
    assert n == 1
    rows = sorted(tuple(node.args[1].args[0].args[2:4]) for node in after.graph.nodes
                  if str(node.target) == "aten.mm.default")
    assert rows == [(0, Q), (Q, Q + C + R)]  # q_a; kv_a = [c_kv | k_pe] stays one GEMM
    for got, want in zip(*(torch.utils._pytree.tree_leaves(f(x, w)) for f in (after, before)),
                         strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)


def _qkv_a_no_norm(x, w):
    """the same cut with no norm (e.g. q|k|v): one GEMM, left to the other rules."""
    return F.linear(x, w[:Q + C + R]).split([Q, C, R], dim=-1)


def _qkv_a_norm_of_part(x, w):
    """a norm over part of a piece (per head): not a latent's norm."""
    cq, ckv = F.linear(x, w[:Q + C]).split([Q, C], dim=-1)
    ckv = ckv.view(*ckv.shape[:-1], 2, C // 2)
    return cq, _rms(ckv, 1.0)


def _qkv_a_overlap(x, w):
    y = F.linear(x, w[:Q + C])
    return y[..., :Q + 2], _rms(y[..., Q:], 1.0)


@pytest.mark.parametrize("fn", [_qkv_a_no_norm, _qkv_a_norm_of_part, _qkv_a_overlap, _kv_a_split])
def test_gemm_without_a_normed_piece_after_the_first_stays(fn):
    x, w = _args(3)
    before, after, n = _rewrite(fn, x, w)
    assert n == 0
    assert targets(after) == targets(before)


class GateUpMLP(nn.Module):
    """A SiTU-GLU MLP written with one gate|up linear (chunked or unbound; or Moonshot's cat of
    two)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.gate_up = nn.Linear(D, 2 * I, bias=False)
        self.down = nn.Linear(I, D, bias=False)

    def forward(self, x):
        if self.spelling == "cat":
            return self.down(_moonshot_cat(x, self.gate_up.weight))
        if self.spelling == "unbind":
            return self.down(_situ_unbind(x, self.gate_up.weight))
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(situ(g, u, BETA, LBETA))


@pytest.mark.parametrize("spelling", ["chunk", "cat", "unbind"])
def test_mlp_with_one_gate_up_linear_fuses(spelling):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GateUpMLP(spelling).requires_grad_(False)
    x = torch.randn(2, 1, D)
    got = compile_with(model, "situ_gate_up")(x)
    report = next(iter(k3be.last_compiled().observer.reports.values()))
    assert [h.op for h in report.hits] == ["k3.situ_gate_up"]
    assert rel_err(got, model(x)) <= TOL["aten_cpu"]
