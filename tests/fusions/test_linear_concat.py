"""linear_concat: the linears that read one input as one GEMM over their concatenated weights
(never cached; stage pack stores them back to back): KDA's q|k|v|g|f_a|b, also with q|k|v rows of
one stacked parameter; MLA's q_a|kv_a."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import linear_concat

import k3compile.ops.linear_concat as linear_concat_op
from k3compile.rewrite import apply_patterns

from .attention_checks import escape
from .pattern_checks import assert_near_miss, assert_rewritten_equal, graph, rewrite, targets

D, W, R, H = 64, 32, 16, 4  # hidden, heads x head dim, f_a rank, heads


def _weights(dtype, gen):
    shapes = [(W, D), (W, D), (W, D), (W, D), (R, D), (W, R), (H, D)]  # q k v g f_a f_b b
    return [(torch.randn(s, generator=gen) * s[1] ** -0.5).to(dtype) for s in shapes]


def kda_projections(x, w_q, w_k, w_v, w_g, w_fa, w_fb, w_b):
    """KimiDeltaAttention.forward's projections."""
    q, k, v, g2 = F.linear(x, w_q), F.linear(x, w_k), F.linear(x, w_v), F.linear(x, w_g)
    graw = F.linear(F.linear(x, w_fa), w_fb)
    beta = torch.sigmoid(F.linear(x, w_b).float())
    return q, k, v, g2, graw, beta


def _kda_args(dtype=torch.bfloat16, tokens=1):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, tokens, D, generator=gen).to(dtype), *_weights(dtype, gen)]


@pytest.mark.parametrize("tokens", [1, 8])
def test_kda_projections_become_one_gemm(tokens):
    args = _kda_args(tokens=tokens)
    gm, report = rewrite(kda_projections, args, linear_concat.patterns(), joint=True)
    assert_rewritten_equal(gm, report, kda_projections, args, "k3.linear_concat")  # bf16: exact
    assert targets(gm).count("aten.mm.default") == 1  # f_b stays a GEMM, on f_a's columns


def test_fp32_projections_agree():
    args = _kda_args(torch.float32)
    gm, report = rewrite(kda_projections, args, linear_concat.patterns(), joint=True)
    assert [h.pattern for h in report.hits] == ["linear_concat[kda]"]
    for got, want in zip(gm(*args), kda_projections(*args)):  # the wider GEMM may regroup sums
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# q|k|v as rows of one parameter, as code that runs them as one batched GEMM stores them (after
# rule gemm split that GEMM: k3compile/models/hf_k3.py): each spelling of the rows of one weight input
STACKED_QKV = {
    "select of [3, W, D]": (lambda ws: torch.stack(ws), lambda w: (w[0], w[1], w[2])),
    "row slices of [3W, D]": (lambda ws: torch.cat(ws), lambda w: (w[:W], w[W:2 * W], w[2 * W:])),
    "narrow of [3W, D]": (lambda ws: torch.cat(ws),
                          lambda w: tuple(w.narrow(0, i * W, W) for i in range(3))),
    "unbind of [3W, D] viewed [3, W, D]": (lambda ws: torch.cat(ws),
                                           lambda w: w.view(3, W, D).unbind(0)),
    "split of [3W, D]": (lambda ws: torch.cat(ws), lambda w: w.split(W)),
    "chunk of [3W, D]": (lambda ws: torch.cat(ws), lambda w: w.chunk(3)),
    "q|k stacked, v its own": (lambda ws: torch.stack(ws[:2]), lambda w: (w[0], w[1])),
}


@pytest.mark.parametrize("spelling", STACKED_QKV)
def test_kda_q_k_v_rows_of_one_stacked_weight(spelling):
    stack, rows = STACKED_QKV[spelling]
    x, w_q, w_k, w_v, *rest = _kda_args()
    stacked = stack([w_q, w_k, w_v])
    own = [] if stacked.numel() == 3 * W * D else [w_v]

    def projections(x, stacked, *ws):
        return kda_projections(x, *rows(stacked), *ws)

    args = [x, stacked, *own, *rest]
    gm, report = rewrite(projections, args, linear_concat.patterns(), joint=True)
    assert_rewritten_equal(gm, report, projections, args, "k3.linear_concat")  # bf16: exact
    for got, want in zip(gm(*args), kda_projections(x, w_q, w_k, w_v, *rest)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (op,) = (n for n in gm.graph.nodes if str(n.target) == "k3.linear_concat.default")
    views = [w for w in op.args[1] if w.op != "placeholder"]
    assert len(views) == 3 - len(own)
    assert {v.meta["val"].storage_offset() for v in views} == {i * W * D for i in range(len(views))}


def test_kda_weight_columns_are_refused():
    """A [W, D] slice of the columns of a wider weight: no rows the group can be stored with."""
    x, w_q, *rest = _kda_args()
    wide = torch.cat([w_q, w_q], dim=1)  # [W, 2D]
    _, report = rewrite(lambda x, wide, *ws: kda_projections(x, wide[:, :D], *ws),
                        [x, wide, *rest], linear_concat.patterns()[:1], joint=True)
    assert not report.hits
    assert_near_miss(report, "linear_concat[kda]", "check refused", "not contiguous rows")


def mla_in_proj(x, w_qa, w_kva, w_g, w_qn, w_kvn):
    """GatedMLA.forward's first GEMMs, after the mla_lowrank_norm pattern took the norms."""
    cq, c_kv, k_pe = torch.ops.k3.mla_lowrank_norm(F.linear(x, w_qa), F.linear(x, w_kva), w_qn,
                                                   w_kvn, 1e-6)
    return cq, c_kv, k_pe, F.linear(x, w_g)


def _mla_args(tokens=1):
    gen = torch.Generator().manual_seed(1)
    shapes = [(2, tokens, D), (24, D), (20, D), (W, D), (24,), (16,)]
    return [torch.randn(s, generator=gen).bfloat16() for s in shapes]


@pytest.mark.parametrize("tokens", [1, 8])
def test_mla_q_a_kv_a_and_g_become_one_gemm(tokens):
    args = _mla_args(tokens)
    gm, report = rewrite(mla_in_proj, args, linear_concat.patterns(), joint=True)
    assert [h.pattern for h in report.hits] == ["linear_concat[mla+g]"]
    assert_rewritten_equal(gm, report, mla_in_proj, args, "k3.linear_concat")  # bf16: exact
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.linear_concat.default")
    assert [w.name for w in op.args[1]] == ["w_qa_1", "w_kva_1", "w_g_1"]
    assert "aten.mm.default" not in targets(gm)


def test_mla_rows_become_one_gemm():
    """[N, D] rows (vLLM's flattened tokens): the ",rows" variant, plain mm GEMMs."""
    args = _mla_args()
    args[0] = args[0].view(2, D)
    gm, report = rewrite(mla_in_proj, args, linear_concat.patterns(), joint=True)
    assert [h.pattern for h in report.hits] == ["linear_concat[mla+g,rows]"]
    assert_rewritten_equal(gm, report, mla_in_proj, args, "k3.linear_concat")
    assert "aten.mm.default" not in targets(gm)


def test_mla_without_g_fuses_q_a_and_kv_a():
    """A g_proj on another input (or none): q_a|kv_a still fuse, the other GEMM stays."""
    def other_input_gate(x, w_qa, w_kva, w_g, w_qn, w_kvn):
        cq, c_kv, k_pe, _ = mla_in_proj(x, w_qa, w_kva, w_g, w_qn, w_kvn)
        return cq, c_kv, k_pe, F.linear(x * 2, w_g)

    args = _mla_args()
    gm, report = rewrite(other_input_gate, args, linear_concat.patterns(), joint=True)
    assert [h.pattern for h in report.hits] == ["linear_concat[mla]"]
    assert_rewritten_equal(gm, report, other_input_gate, args, "k3.linear_concat")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.linear_concat.default")
    assert [w.name for w in op.args[1]] == ["w_qa_1", "w_kva_1"]
    assert targets(gm).count("aten.mm.default") == 1  # the other gate GEMM


def test_mla_g_computed_in_the_graph_is_refused():
    """A gate weight cast every step is no weight input: its concatenation would be per step."""
    args = _mla_args()
    args[3] = args[3].float()
    _, report = rewrite(lambda x, a, b, g, qn, kvn: mla_in_proj(x, a, b, g.to(x.dtype), qn, kvn),
                         args, linear_concat.patterns()[1:2], joint=True)
    assert_near_miss(report, "linear_concat[mla+g]", "check refused", "w_g is computed")


def test_reference_is_separate_gemms_and_reads_weights_at_every_call():
    x, *ws = _kda_args()
    ws = ws[:5]
    x = torch.randn(64, *x.shape[1:], dtype=x.dtype)  # 64 rows: one GEMM over the concatenation
    want = torch.cat([F.linear(x, w) for w in ws], dim=-1)  # would round differently on CPU
    torch.testing.assert_close(torch.ops.k3.linear_concat(x, ws), want, rtol=0, atol=0)
    new = torch.randn_like(ws[1])
    ws[1].data.copy_(new)  # a write through .data bumps no version counter: nothing may be cached
    y = torch.ops.k3.linear_concat(x, ws)
    torch.testing.assert_close(y[..., W:2 * W], F.linear(x, new), rtol=0, atol=0)


def _feeds_mm(node, depth=3) -> bool:
    """node reaches an mm through at most `depth` views (f_a's output feeds f_b's GEMM)."""
    for user in node.users:
        if user.target is torch.ops.aten.mm.default:
            return True
        views = (torch.ops.aten.view.default, torch.ops.aten.permute.default,
                 torch.ops.aten.reshape.default, torch.ops.aten.t.default)
        if depth and user.target in views and _feeds_mm(user, depth - 1):
            return True
    return False


def test_escaping_f_a_output_is_a_near_miss():
    mm = torch.ops.aten.mm.default
    gm = graph(kda_projections, *_kda_args(), joint=True)
    escape(gm, lambda n: n.target is mm and _feeds_mm(n))  # f_a's output
    report = apply_patterns(gm.graph, linear_concat.patterns())
    assert_near_miss(report, "linear_concat[kda]", "users")


def test_check_refuses_float64():
    args = _kda_args(torch.float64)
    _, report = rewrite(kda_projections, args, linear_concat.patterns(), joint=True)
    assert_near_miss(report, "linear_concat[kda]", "check refused", "float64")


def mla_in_proj_fp32_weight(x, w_qa, w_kva, w_g, w_qn, w_kvn):
    """The same after mla_lowrank_norm[...,weight_fp32] took a Flax-style port's norms."""
    cq, c_kv, k_pe = torch.ops.k3.mla_lowrank_norm(F.linear(x, w_qa), F.linear(x, w_kva), w_qn,
                                                   w_kvn, 1e-6, True)
    return cq, c_kv, k_pe, F.linear(x, w_g)


@pytest.mark.parametrize("rows", [False, True])
def test_mla_fp32_weight_norm_call_fuses_and_keeps_its_flag(rows):
    """q_a|kv_a|g become one GEMM before the flagged norm call too; the flag stays on it."""
    args = _mla_args()
    if rows:
        args[0] = args[0].view(2, D)
    fn = mla_in_proj_fp32_weight
    gm, report = rewrite(fn, args, linear_concat.patterns(), joint=True)
    assert [h.pattern for h in report.hits] == [
        f"linear_concat[mla+g{',rows' if rows else ''},weight_fp32]"]
    assert_rewritten_equal(gm, report, fn, args, "k3.linear_concat")
    op = next(n for n in gm.graph.nodes if str(n.target) == "k3.mla_lowrank_norm.default")
    assert op.args[-2:] == (1e-6, True)
    assert "aten.mm.default" not in targets(gm)


def test_kda_projections_on_flat_token_rows_become_one_gemm():
    """vLLM's flat [N, D] tokens (rule `proj_split` leaves one GEMM per piece so): each GEMM a
    plain mm, `linear_concat[kda,rows]`; f_b stays one mm of f_a's columns."""
    args = _kda_args(tokens=3)
    args[0] = args[0].reshape(6, D)
    gm, report = rewrite(kda_projections, args, linear_concat.patterns(), joint=True)
    assert [h.pattern for h in report.hits] == ["linear_concat[kda,rows]"]
    assert_rewritten_equal(gm, report, kda_projections, args, "k3.linear_concat")  # bf16: exact
    assert targets(gm).count("aten.mm.default") == 1
