"""token_linear: the projections of a [B, K] token row, each GEMM's output viewed [B, 1, N] (the
red team's KDA in-projection once `token_dim` lifted its recurrence and `proj_split` cut it; a
row-major spelling's `F.linear(x, w).unsqueeze(1)`) -> F.linear of the row viewed [B, 1, K], the
form `linear_concat[kda]` is traced on; then that pattern fuses the six GEMMs. Bit for bit
against the unrewritten graph (every view only moves a size-1 dim). Look-alikes stay: a view that
is no unit dim at 1, a GEMM also read whole, a cast between the GEMM and its view, a row GEMM of
x left unviewed beside the viewed ones (or f_b on f_a read as rows), the T form itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from k3compile.patterns import linear_concat, mla_lowrank_norm

from k3compile.canonical import gemm, token_linear
from k3compile.math import rms_norm
from k3compile.rewrite import apply_patterns
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.conftest import rel_err
from tests.fusions import pattern_checks

HID, H, D = 32, 2, 8
W, FA = H * D, D  # KDA: q|k|v|g of W rows, f_a of rank D, b of H
SIZES = (W, W, W, W, FA, H)
aten = torch.ops.aten
MLA_C = 16  # MLA: c_kv's width (kv_a is [c_kv | k_pe])
PER_DTYPE = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def _args(dtype, rows=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HID, generator=g).to(dtype)
    ws = [(torch.randn(n, HID, generator=g) * HID**-0.5).to(dtype) for n in SIZES]
    w_fb = (torch.randn(W, FA, generator=g) * FA**-0.5).to(dtype)
    return x, *ws, w_fb


def _rewritten(fn, dtype, rows=2):
    """(inputs, fn's graph, the graph the rule rewrote, sites)"""
    args = _args(dtype, rows)
    return args, *rewrite(token_linear, fn, *args)


def _kda_tail(q, k, v, g, fa, b, w_fb):
    """what KDA reads of the six (as `_kda_tail` of test_proj_groups): q|k|v joined for the conv,
    the gate, f_b on f_a's [B, 1, FA] (F.linear at T = 1: its view of a view), beta"""
    return (torch.cat([q, k, v], -1) * 2.0, torch.sigmoid(g), F.linear(fa, w_fb),
            torch.sigmoid(b.float()))


def redteam(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """tests/models/redteam_k3.py's in-projection on [B, D] rows after token_dim (each output
    viewed [B, 1, N]) and proj_split (one GEMM per piece)"""
    b = x.shape[0]
    return _kda_tail(*(F.linear(x, w).view(b, 1, -1) for w in (w_q, w_k, w_v, w_g, w_fa, w_b)),
                     w_fb)


def unsqueezed(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """row-major serving code: each projection of the row, then `.unsqueeze(1)` for the T dim"""
    return _kda_tail(*(F.linear(x, w).unsqueeze(1) for w in (w_q, w_k, w_v, w_g, w_fa, w_b)),
                     w_fb)


def reshaped(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """`reshape(B, 1, N)` after each GEMM"""
    b = x.shape[0]
    ys = (F.linear(x, w) for w in (w_q, w_k, w_v, w_g, w_fa, w_b))
    return _kda_tail(*(y.reshape(b, 1, y.shape[-1]) for y in ys), w_fb)


def canonical(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """the form `linear_concat[kda]` is traced on (our model's KDA at T = 1)"""
    x3 = x.view(x.shape[0], 1, x.shape[-1])
    return _kda_tail(*(F.linear(x3, w) for w in (w_q, w_k, w_v, w_g, w_fa, w_b)), w_fb)


SPELLINGS = {"redteam": redteam, "unsqueezed": unsqueezed, "reshaped": reshaped}


def _row_inputs(gm) -> list:
    """the first operand of every GEMM whose weight is a [N, HID] projection (not f_b)"""
    return [n.args[0] for n in gm.graph.nodes
            if n.target is aten.mm.default and n.args[1].meta["val"].shape[0] == HID]


@pytest.mark.parametrize("rows", [1, 2, 5])
@PER_DTYPE
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_the_row_is_viewed_before_the_gemms(name, dtype, rows):
    args, before, after, n = _rewritten(SPELLINGS[name], dtype, rows)
    assert n == 1
    inputs = _row_inputs(after)
    assert len(inputs) == 6
    x3 = {i.args[0] for i in inputs}  # one [B, 1, K] row that every projection views [B, K]
    assert len(x3) == 1 and all(i.target is aten.view.default for i in inputs)
    assert list(next(iter(x3)).meta["val"].shape) == [rows, 1, HID]
    assert "aten.unsqueeze.default" not in targets(after)
    assert targets(after).count("aten.view.default") >= 6
    assert_same(after(*args), before(*args))
    assert_same(after(*args), SPELLINGS[name](*args))  # eager, bit for bit
    assert_same(after(*args), canonical(*args))


@PER_DTYPE
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_then_linear_concat_fuses_the_six(name, dtype):
    args, _, after, n = _rewritten(SPELLINGS[name], dtype)
    assert n == 1
    report = apply_patterns(after.graph, linear_concat.patterns())
    after.recompile()
    assert [h.pattern for h in report.hits] == ["linear_concat[kda]"]
    assert targets(after).count("aten.mm.default") == 1  # f_b's, on f_a's columns
    # eager: the fused GEMM's CPU reference is per weight, bit for bit; f_b reads f_a as a column
    # slice of the fused output (a strided GEMM input), which may move its last bit
    for got, want in zip(after(*args), SPELLINGS[name](*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 2 * torch.finfo(dtype).eps


def test_without_it_the_six_stay_apart():
    """the gap the rule closes: the red team's form matches no linear_concat[kda] variant"""
    args = _args(torch.float32)
    gm = pattern_checks.graph(redteam, *args)
    report = apply_patterns(gm.graph, linear_concat.patterns())
    assert not report.hits
    assert targets(gm).count("aten.mm.default") == 7


def test_a_biased_projection_is_taken_too():
    """F.linear with a bias on rows is an addmm; the T form views its input likewise"""
    def fn(x, w, bias, w2):
        b = x.shape[0]
        return F.linear(x, w, bias).view(b, 1, -1), F.linear(x, w2).view(b, 1, -1)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, HID, generator=g), torch.randn(W, HID, generator=g),
            torch.randn(W, generator=g), torch.randn(H, HID, generator=g))
    before, after, n = rewrite(token_linear, fn, *args)
    assert n == 1
    assert all(gm.args[1].target is aten.view.default for gm in after.graph.nodes
               if gm.target is aten.addmm.default)
    assert_same(after(*args), before(*args))


def test_gemm_then_token_linear_take_the_unsqueeze_before_the_linears():
    """`F.linear(x.unsqueeze(1), w)`: rule `gemm` (earlier in ORDER) may fold the unsqueeze into
    the GEMM's input; whatever it leaves, this rule ends in the T form, values unchanged"""
    def fn(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
        x3 = x.unsqueeze(1)
        return _kda_tail(*(F.linear(x3, w) for w in (w_q, w_k, w_v, w_g, w_fa, w_b)), w_fb)

    args = _args(torch.bfloat16, 3)
    _, after, _ = rewrite(gemm, fn, *args)
    token_linear.apply(after.graph)
    after.graph.lint()
    after.recompile()
    x3 = {i.args[0] for i in _row_inputs(after)}
    assert len(x3) == 1 and list(next(iter(x3)).meta["val"].shape) == [3, 1, HID]
    report = apply_patterns(after.graph, linear_concat.patterns())
    assert [h.pattern for h in report.hits] == ["linear_concat[kda]"]
    after.recompile()
    assert_same(after(*args), fn(*args))


def mla_rows_viewed(x, w_qa, w_kva, w_g, w_qn, w_kvn):
    """Gated MLA's front on [B, K] rows, each GEMM's output viewed [B, 1, N] (the red team's MLA
    layers after token_dim and gate_up_split): q_a, kv_a [c_kv | k_pe], the two norms, g_proj"""
    b = x.shape[0]
    q_a, kv_a, g = (F.linear(x, w).view(b, 1, -1) for w in (w_qa, w_kva, w_g))
    c_kv, k_pe = kv_a.split([MLA_C, kv_a.shape[-1] - MLA_C], dim=-1)
    return rms_norm(q_a, w_qn, 1e-6), rms_norm(c_kv, w_kvn, 1e-6), k_pe, g


@PER_DTYPE
def test_mla_rows_viewed_fuse_through_the_t_form(dtype):
    """mla_lowrank_norm and linear_concat[mla+g] have no variant for rows viewed [B, 1, N] (removed
    in session 36): the rule lifts them to the T form, which the T-form variants fuse"""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, HID), (24, HID), (MLA_C + 8, HID), (W, HID)]
    ws = [torch.randn(s, generator=g) * s[-1] ** -0.5 for s in shapes]
    args = [t.to(dtype) for t in (*ws, 1 + 0.1 * torch.randn(24, generator=g),
                                  1 + 0.1 * torch.randn(MLA_C, generator=g))]
    _, after, n = rewrite(token_linear, mla_rows_viewed, *args, joint=True)
    assert n == 1
    hits = [h.pattern for pats in (mla_lowrank_norm.patterns(), linear_concat.patterns())
            for h in apply_patterns(after.graph, pats).hits]
    after.recompile()
    assert hits == [f"mla_lowrank_norm[{str(dtype).removeprefix('torch.')}]",
                    "linear_concat[mla+g]"]
    assert "aten.mm.default" not in targets(after)
    for got, want in zip(after(*args), mla_rows_viewed(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= 2 * torch.finfo(dtype).eps


# ---- look-alikes --------------------------------------------------------------------------------


def heads(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """one output viewed [B, H, D] (a head split, no unit dim)"""
    b = x.shape[0]
    return F.linear(x, w_q).view(b, H, D), F.linear(x, w_k).view(b, 1, -1)


def trailing_unit(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """`unsqueeze(-1)`: [B, N, 1], a column, not a token"""
    return F.linear(x, w_q).unsqueeze(-1), F.linear(x, w_k).unsqueeze(-1)


def read_whole(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """a GEMM's [B, N] output read as well as its view"""
    b = x.shape[0]
    q = F.linear(x, w_q)
    return q.view(b, 1, -1), F.linear(x, w_k).view(b, 1, -1), q.sum(-1)


def cast_between(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """an upcast between the GEMM and its view (the view reads another dtype)"""
    b = x.shape[0]
    return F.linear(x, w_q).double().view(b, 1, -1), F.linear(x, w_k).double().view(b, 1, -1)


def one_unviewed(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """two projections viewed, a third read as rows: the rows form stays the row's form"""
    b = x.shape[0]
    return F.linear(x, w_q).view(b, 1, -1), F.linear(x, w_k).view(b, 1, -1), F.linear(x, w_g)


def computed_rhs(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """x times a computed matrix (no F.linear of a weight): `x @ (w_q.T * 2)`"""
    b = x.shape[0]
    return (x @ (w_q * 2.0).T).view(b, 1, -1)


def chained_unviewed(x, w_q, w_k, w_v, w_g, w_fa, w_b, w_fb):
    """f_b on f_a's rows, its output read as rows: f_a's GEMM is read by no token view"""
    b = x.shape[0]
    return F.linear(x, w_q).view(b, 1, -1), F.linear(F.linear(x, w_fa), w_fb)


LOOK_ALIKES = {"canonical": canonical, "heads": heads, "trailing_unit": trailing_unit,
               "read_whole": read_whole, "cast_between": cast_between,
               "one_unviewed": one_unviewed, "computed_rhs": computed_rhs,
               "chained_unviewed": chained_unviewed}


@PER_DTYPE
@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alike_is_left_alone(name, dtype):
    args, before, after, n = _rewritten(LOOK_ALIKES[name], dtype)
    assert n == 0
    assert targets(after) == targets(before)
    assert_same(after(*args), LOOK_ALIKES[name](*args))


def test_a_symbolic_row_count_is_left_alone():
    """the rule reads static shapes (each bucket is compiled with its batch)"""
    args = _args(torch.float32)
    gm = torch.fx.experimental.proxy_tensor.make_fx(redteam, tracing_mode="symbolic")(*args)
    assert token_linear.apply(gm.graph) == 0


@pytest.mark.slow
def test_redteam_in_projection_fuses_with_the_rule_and_not_without():
    """tests/models/redteam_k3.py (fp32): linear_concat in KDA layers 0, 1 and linear_concat with
    mla_lowrank_norm in MLA layers 2, 3 with the rule, none of them without it (until session
    36 the MLA layers fused without it too, by the `rows_viewed` variants, now removed)"""
    from tests.models.redteam_k3 import from_builtin
    from tests.spellings import foreign

    for rules, want in (((), 1), (("token_linear",), 0)):
        got = foreign.plan_with_rules_off(from_builtin, rules)
        for layer in (0, 1):
            assert got[layer]["linear_concat"] == want, (rules, layer, dict(got[layer]))
        for layer in (2, 3):
            for op in ("linear_concat", "mla_lowrank_norm"):
                assert got[layer][op] == want, (rules, layer, op, dict(got[layer]))
