"""proj_groups: one GEMM over stacked projections, read only as pieces tiling its columns (spell12's
`MergedLinear`: `F.linear(x, W).split(sizes, -1)`; `chunk`, `narrow`, `tensor_split`, slices) ->
one GEMM per projection on the weight's row slices, MLA's kv_a [latent | rope] kept one GEMM (the
latent RMS-normed, the rope not); then `linear_concat` (and `mla_lowrank_norm`) fuse them again.
Look-alikes stay: kv_a alone, a GEMM also read whole, a cut that does not tile, a computed weight,
a step input as the weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import linear_concat, mla_lowrank_norm

from k3compile.canonical import proj_groups, slice_split
from k3compile.math import rms_norm
from k3compile.rewrite import apply_patterns
from tests.canonical.rule_checks import rewrite, targets
from tests.conftest import rel_err
from tests.fusions import pattern_checks

HID, H, D = 32, 2, 8
W, FA = H * D, D  # KDA: q|k|v|g of W rows, f_a of rank D, b of H
Q, C, R, G = 24, 16, 8, 16  # MLA: q_a, kv_a = [latent C | rope R], gate G
EPS = 1e-6
aten = torch.ops.aten


def _x(dtype, lead=(2, 1), seed=0):
    return torch.randn(*lead, HID, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _w(rows, cols=HID, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * cols**-0.5).to(dtype)


# ---- KDA's q|k|v|g|f_a|b in one weight --------------------------------------------------------


def _kda_tail(q, k, v, g, fa, b, w_fb):
    """what the pieces feed: q|k|v joined again (the conv's input), the gate, f_b, beta."""
    qkv = torch.cat([q, k, v], -1)
    return qkv * 2.0, torch.sigmoid(g), F.linear(fa, w_fb), torch.sigmoid(b.float())


def kda_split(x, w, w_fb):
    """spell12's MergedLinear: split with the projections' sizes"""
    return _kda_tail(*F.linear(x, w).split([W, W, W, W, FA, H], -1), w_fb)


def kda_slices(x, w, w_fb):
    """tensor slicing and narrow"""
    y = F.linear(x, w)
    return _kda_tail(y[..., :W], y[..., W:2 * W], y.narrow(-1, 2 * W, W), y[..., 3 * W:4 * W],
                     y.narrow(-1, 4 * W, FA), y[..., 4 * W + FA:], w_fb)


def kda_chunk(x, w, w_fb):
    """q|k|v|g as one weight cut by chunk (f_a, b their own linears)"""
    q, k, v, g = F.linear(x, w[:4 * W]).chunk(4, -1)
    return _kda_tail(q, k, v, g, F.linear(x, w[4 * W:4 * W + FA]), F.linear(x, w[4 * W + FA:]),
                     w_fb)


def kda_tensor_split(x, w, w_fb):
    """spell11's torch.tensor_split(x @ W.mT, 4, -1)"""
    q, k, v, g = torch.tensor_split(x @ w[:4 * W].mT, 4, -1)
    return _kda_tail(q, k, v, g, F.linear(x, w[4 * W:4 * W + FA]), F.linear(x, w[4 * W + FA:]),
                     w_fb)


KDA = {"split": kda_split, "slices": kda_slices, "chunk": kda_chunk,
       "tensor_split": kda_tensor_split}


def _kda_args(dtype, lead=(2, 1)):
    return _x(dtype, lead), _w(4 * W + FA + H, dtype=dtype), _w(W, FA, seed=2, dtype=dtype)


def _gemm_rows(gm) -> list[tuple[int, int]]:
    """the row block of the weight each GEMM reads (F.linear on a row slice), in graph order"""
    rows = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (aten.mm.default, aten.addmm.default):
            perm = node.args[-1]
            src = perm.args[0]
            if src.target is aten.slice.Tensor and src.args[1] == 0:
                start, end = src.args[2:4]
                rows.append((start, min(end, src.args[0].meta["val"].shape[0])))
            else:
                rows.append(("whole", tuple(src.meta["val"].shape)))
    return rows


def _close(after, before, args, dtype):
    """a column of a GEMM depends only on its weight row: equal up to the GEMM's blocking
    (bit-equal at these shapes on the CPU; 1.5 ulps of the largest value measured at K3's)"""
    for got, want in zip(*(torch.utils._pytree.tree_leaves(f(*args)) for f in (after, before)),
                         strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("lead", [(2, 1), (2, 3), (3,)])  # one token, verify rows, flat rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(KDA))
def test_kda_in_projection_is_one_gemm_per_piece(name, dtype, lead):
    args = _kda_args(dtype, lead)
    before, after, n = rewrite(proj_groups, KDA[name], *args)
    assert n == 1
    pieces = [(0, W), (W, 2 * W), (2 * W, 3 * W), (3 * W, 4 * W)]
    pieces += [(4 * W, 4 * W + FA), (4 * W + FA, 4 * W + FA + H)]  # (chunk: linears already)

    assert sorted(r for r in _gemm_rows(after) if r[0] != "whole") == sorted(pieces)
    assert not {"aten.split.Tensor", "aten.split_with_sizes.default"} & set(targets(after))
    _close(after, before, args, dtype)


@pytest.mark.parametrize("fn", [kda_split, kda_slices])
def test_then_linear_concat_fuses_the_six(fn):
    args = _kda_args(torch.bfloat16)
    before, after, n = rewrite(proj_groups, fn, *args)
    assert n == 1
    report = apply_patterns(after.graph, linear_concat.patterns())
    after.recompile()
    assert [h.pattern for h in report.hits] == ["linear_concat[kda]"]
    assert _gemm_rows(after) == [("whole", (W, FA))]  # f_b's, on f_a's columns
    _close(after, before, args, torch.bfloat16)


# ---- MLA: q_a | kv_a [latent | rope] (| g) in one weight -------------------------------------


def _norms(dtype):
    g = torch.Generator().manual_seed(3)
    return (1 + 0.1 * torch.randn(Q, generator=g)).to(dtype), \
        (1 + 0.1 * torch.randn(C, generator=g)).to(dtype)


def mla_spell12(x, w, w_qn, w_kvn):
    """spell12: [q_a | kv_a | g], kv_a cut into latent and rope afterwards and joined again"""
    cq, ckv, g = F.linear(x, w).split([Q, C + R, G], -1)
    row = torch.cat([rms_norm(ckv[..., :C], w_kvn, EPS), ckv[..., C:]], -1)
    return rms_norm(cq, w_qn, EPS), row, torch.sigmoid(g)


def mla_vllm(x, w, w_qn, w_kvn):
    """vLLM's fused_qkv_a_proj: [q_a | latent | rope] (g its own linear)"""
    cq, c_kv, k_pe = F.linear(x, w[:Q + C + R]).split([Q, C, R], -1)
    row = torch.cat([rms_norm(c_kv, w_kvn, EPS), k_pe], -1)
    return rms_norm(cq, w_qn, EPS), row, torch.sigmoid(F.linear(x, w[Q + C + R:]))


def mla_vllm_gate(x, w, w_qn, w_kvn):
    """[q_a | latent | rope | g] sliced: the rope stays with its latent, not the gate"""
    y = x @ w.T
    row = torch.cat([rms_norm(y[..., Q:Q + C], w_kvn, EPS), y[..., Q + C:Q + C + R]], -1)
    return rms_norm(y[..., :Q], w_qn, EPS), row, torch.sigmoid(y[..., Q + C + R:])


MLA = {"spell12": mla_spell12, "vllm": mla_vllm, "vllm_gate": mla_vllm_gate}


def _mla_args(dtype, lead=(2, 1)):
    return (_x(dtype, lead), _w(Q + C + R + G, dtype=dtype), *_norms(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MLA))
def test_mla_is_cut_into_q_a_kv_a_and_g_never_latent_from_rope(name, dtype):
    args = _mla_args(dtype)
    before, after, n = rewrite(proj_groups, MLA[name], *args)
    assert n == 1
    want = [(0, Q), (Q, Q + C + R), (Q + C + R, Q + C + R + G)]
    assert sorted(_gemm_rows(after)) == sorted(want)
    _close(after, before, args, dtype)


@pytest.mark.parametrize("lead", [(2, 1), (3,)])
@pytest.mark.parametrize("name", sorted(MLA))
def test_then_mla_lowrank_norm_and_linear_concat_fuse(name, lead):
    args = _mla_args(torch.bfloat16, lead)
    before, after, n = rewrite(proj_groups, MLA[name], *args)
    assert n == 1
    slice_split.apply(after.graph)  # (ORDER: later) spell12's kv_a[..., :C], [..., C:] -> a split
    norm = apply_patterns(after.graph, mla_lowrank_norm.patterns())
    concat = apply_patterns(after.graph, linear_concat.patterns())
    after.recompile()
    assert [h.op for h in norm.hits] == ["k3.mla_lowrank_norm"]
    assert [h.pattern.split("[")[1].split(",")[0].rstrip("]") for h in concat.hits] == ["mla+g"]
    assert "aten.mm.default" not in targets(after)
    _close(after, before, args, torch.bfloat16)


# ---- look-alikes --------------------------------------------------------------------------------


def kv_a_alone(x, w, w_qn, w_kvn):
    """the canonical kv_a itself: [latent | rope], one GEMM"""
    c_kv, k_pe = F.linear(x, w[:C + R]).split([C, R], -1)
    return torch.cat([rms_norm(c_kv, w_kvn, EPS), k_pe], -1)


def read_whole(x, w, w_qn, w_kvn):
    """the pieces and the whole GEMM"""
    y = F.linear(x, w)
    cq, ckv, g = y.split([Q, C + R, G], -1)
    return rms_norm(cq, w_qn, EPS), ckv * 2.0, torch.sigmoid(g), y.sum(-1)


def gap(x, w, w_qn, w_kvn):
    """a column read by no piece"""
    y = F.linear(x, w)
    return rms_norm(y[..., :Q], w_qn, EPS), y[..., Q + 1:]


def overlap(x, w, w_qn, w_kvn):
    y = F.linear(x, w)
    return rms_norm(y[..., :Q], w_qn, EPS), y[..., Q - 1:] * 2.0


def computed_weight(x, w, w_qn, w_kvn):
    """a weight computed in the step (a product): no projection's parameter"""
    cq, ckv, g = F.linear(x, w * 2.0).split([Q, C + R, G], -1)
    return cq, ckv, g


def strided(x, w, w_qn, w_kvn):
    """every other column: no cut of the columns into ranges"""
    y = F.linear(x, w)
    return y[..., 0::2], y[..., 1::2]


LOOK_ALIKES = {"kv_a_alone": kv_a_alone, "read_whole": read_whole, "gap": gap,
               "overlap": overlap, "computed_weight": computed_weight, "strided": strided}


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alike_is_left_alone(name):
    args = _mla_args(torch.float32)
    before, after, n = rewrite(proj_groups, LOOK_ALIKES[name], *args)
    assert n == 0
    assert targets(after) == targets(before)


def test_a_step_input_as_the_weight_is_left_alone():
    """x times the transpose of another step input is no projection (stage canonicalize marks
    the step's inputs `k3_user_input`)"""
    args = _mla_args(torch.float32)
    gm = pattern_checks.graph(mla_spell12, *args)
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        node.meta["k3_user_input"] = i < 2
    assert proj_groups.apply(gm.graph) == 0


@pytest.mark.slow
def test_spell12_projections_fuse_with_the_rule_and_not_without():
    """spell12's `MergedLinear`s (KDA q|k|v|g|f_a|b, MLA q_a|kv_a|g cut by `split`):
    linear_concat and mla_lowrank_norm fuse in MLA's layers 2, 3 with the rule, and not without
    it. KDA's (layers 0, 1) fuses either way in fp32 since session 33: rule window_stack makes
    its conv window a convolution, and `proj_split` then cuts the merged GEMM first."""
    from tests.models.spell12_k3 import from_builtin
    from tests.spellings import foreign

    for rules, want in (((), 1), (("proj_groups",), 0)):
        got = foreign.plan_with_rules_off(from_builtin, rules)
        for layer in (2, 3):
            for op in ("linear_concat", "mla_lowrank_norm"):
                assert got[layer][op] == want, (rules, layer, op, dict(got[layer]))
        for layer in (0, 1):
            assert got[layer]["linear_concat"] == 1, (rules, layer, dict(got[layer]))
