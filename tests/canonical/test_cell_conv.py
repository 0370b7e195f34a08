"""cell_conv: KDA's short conv for one token inside a scanned cell (spell9: the conv state's rows
and the token contracted with the taps by `einsum("bkc,kc->bc", ...)`) becomes the canonical
time-major convolution with its SiLU before the transpose and the token selected after; the
taps may be one weight or a cat of per-projection Flax kernels' slices. Values equal to the
unrewritten graph; with `token_select` and the rest of the canonical rules, spell9's KDA step
fuses as kda_decode. Look-alikes stay: a window that is not the conv state (not a gather, its
tail not written back, written to another buffer), taps computed at run time, a channel-mixing
contraction, no SiLU after it; in bf16 / fp16 (taken as the conv in that dtype, rounded) a
mul + sum of rounded products (B = 1) and a written-out SiLU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.canonical import cell_conv, token_select
from tests.conftest import rel_err

from .rule_checks import rewrite, targets

B, S, W, TAPS = 2, 5, 8, 4
C = 3 * W
aten = torch.ops.aten


def _window(x, state, slots):
    """spell9's cell: the carried window (the state's rows) and the token x[:, 0]"""
    return torch.cat([state[slots], x[:, 0].unsqueeze(1)], 1)


def flax(x, state, slots, kq, kk, kv):
    """spell9: taps = cat of the Flax kernels' [:, 0] slices [TAPS, C], einsum per token"""
    taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)
    win = _window(x, state, slots)
    y = F.silu(torch.einsum("bkc,kc->bc", win, taps))
    return y.split(W, -1)[1] * 2, torch.index_put(state, (slots,), win[:, 1:])


def one_weight(x, state, slots, w):
    """taps one [TAPS, C] weight, SiLU written out, the tail cut as window[:, -(TAPS-1):]"""
    win = _window(x, state, slots)
    y = torch.einsum("bkc,kc->bc", win, w)
    return y * torch.sigmoid(y), torch.index_put(state, (slots,), win[:, -(TAPS - 1):])


def channels_first(x, state, slots, w):
    """taps a [C, TAPS] weight (the conv1d weight's [C, taps] view)"""
    win = _window(x, state, slots)
    return F.silu(torch.einsum("bkc,ck->bc", win, w)), torch.index_put(state, (slots,), win[:, 1:])


def _args(batch=B, dtype=torch.float32, kinds=("flax",)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, C, generator=g).to(dtype)
    state = torch.randn(S, TAPS - 1, C, generator=g).to(dtype)
    slots = torch.tensor([3, 0][:batch])
    ws = {"flax": [torch.randn(TAPS, 1, W, generator=g).to(dtype) for _ in range(3)],
          "kc": [torch.randn(TAPS, C, generator=g).to(dtype)],
          "ck": [torch.randn(C, TAPS, generator=g).to(dtype)]}
    return [x, state, slots, *(w for k in kinds for w in ws[k])]


def _close(after, before, args, tol):
    for got, want in zip(after(*args), before(*args), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= tol


# batch 1: the contraction is a mul + sum (Inductor's bmm of dot products)
@pytest.mark.parametrize(("fn", "kind"), [(flax, "flax"), (one_weight, "kc"),
                                          (channels_first, "ck")])
@pytest.mark.parametrize("batch", [2, 1])
def test_the_cell_conv_becomes_the_time_major_conv(fn, kind, batch):
    args = _args(batch, kinds=(kind,))
    before, after, n = rewrite(cell_conv.RULE, fn, *args, joint=True)
    assert n == 1
    t = targets(after)
    assert t.count("aten.convolution.default") == 1 and "aten.bmm.default" not in t
    conv = next(x for x in after.graph.nodes if x.target is aten.convolution.default)
    assert conv.args[0].target is aten.permute.default  # the time-major window, transposed
    window = conv.args[0].args[0]
    assert window.args[0][1].op == "placeholder"  # the token itself, no select / unsqueeze
    if kind == "flax":  # q | k | v conv weights: the Flax kernels' [C_i, 1, taps] views
        assert conv.args[1].target is aten.cat.default
        assert [p.target for p in conv.args[1].args[0]] == [aten.permute.default] * 3
    (token,) = [u for u in after.graph.nodes if u.target is aten.select.int]
    back = token.args[0]  # the token of the conv's [B, 1, C], the SiLU before the transpose
    assert back.target is aten.permute.default and back.args[0].target is not conv.target
    _close(after, before, args, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_becomes_the_rounded_conv(dtype):
    """bf16 / fp16 (session 27): the bmm rounds the conv, the SiLU rounds again; the canonical
    form is the conv in that dtype (no upcast: its output rounded) and F.silu on it, which
    kda_decode's `conv_rounded` variant takes; within one ulp of the largest value of the
    unrewritten graph (the fp32 sums of four exact products, maybe in another order)"""
    args = _args(dtype=dtype)
    before, after, n = rewrite(cell_conv.RULE, flax, *args, joint=True)
    assert n == 1 and "aten.bmm.default" not in targets(after)
    (conv,) = [x for x in after.graph.nodes if x.target is aten.convolution.default]
    assert conv.meta["val"].dtype == dtype  # the conv itself in the activations' dtype
    _close(after, before, args, torch.finfo(dtype).eps)


def _written_out(x, state, slots, kq, kk, kv):
    """SiLU written x * sigmoid(x): in bf16 the sigmoid rounds too (not F.silu's rounding)"""
    taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)
    win = _window(x, state, slots)
    y = torch.einsum("bkc,kc->bc", win, taps)
    return y * torch.sigmoid(y), torch.index_put(state, (slots,), win[:, 1:])


@pytest.mark.parametrize(("fn", "batch"), [(flax, 1), (_written_out, 2)])
def test_low_precision_look_alikes_stay(fn, batch):
    """bf16 at B = 1 (a mul + sum: each product rounded, not the conv's rounding) and a SiLU
    written out (its sigmoid rounded) stay as written"""
    args = _args(batch, dtype=torch.bfloat16)
    before, after, n = rewrite(cell_conv.RULE, fn, *args, joint=True)
    assert n == 0 and "aten.convolution.default" not in targets(after)
    _close(after, before, args, 0)


def _not_gathered(x, state, slots, kq, kk, kv):
    """the window's past rows are the buffer's first rows, not the requests' (no gather)"""
    taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)
    win = torch.cat([state[:B], x[:, 0].unsqueeze(1)], 1)
    return F.silu(torch.einsum("bkc,kc->bc", win, taps)), torch.index_put(state, (slots,),
                                                                          win[:, 1:])


def _tail_not_written(x, state, slots, kq, kk, kv):
    """the window is never written back: not the conv state"""
    taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)
    win = _window(x, state, slots)
    return (F.silu(torch.einsum("bkc,kc->bc", win, taps)),)


def _other_rows_written(x, state, slots, kq, kk, kv):
    """the window's head, not its tail, written back"""
    taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)
    win = _window(x, state, slots)
    return F.silu(torch.einsum("bkc,kc->bc", win, taps)), torch.index_put(state, (slots,),
                                                                          win[:, :-1])


def _written_elsewhere(x, state, slots, kq, kk, kv):
    """the tail written into another buffer"""
    taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)
    win = _window(x, state, slots)
    return F.silu(torch.einsum("bkc,kc->bc", win, taps)), torch.index_put(state * 2, (slots,),
                                                                          win[:, 1:])


def _taps_at_run_time(x, state, slots, kq, kk, kv):
    """taps computed from the token (not a weight)"""
    taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1) * x[0, 0]
    win = _window(x, state, slots)
    return F.silu(torch.einsum("bkc,kc->bc", win, taps)), torch.index_put(state, (slots,),
                                                                          win[:, 1:])


def _channels_mixed(x, state, slots, kq, kk, kv):
    """every channel's taps summed into every output: not depthwise"""
    taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)
    win = _window(x, state, slots)
    return F.silu(torch.einsum("bkc,kd->bd", win, taps)), torch.index_put(state, (slots,),
                                                                          win[:, 1:])


def _no_silu(x, state, slots, kq, kk, kv):
    """no SiLU after the contraction (the canonical form has it)"""
    taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)
    win = _window(x, state, slots)
    return torch.einsum("bkc,kc->bc", win, taps), torch.index_put(state, (slots,), win[:, 1:])


@pytest.mark.parametrize("fn", [_not_gathered, _tail_not_written, _other_rows_written,
                                _written_elsewhere, _taps_at_run_time, _channels_mixed, _no_silu])
def test_look_alikes_stay(fn):
    args = _args()
    before, after, n = rewrite(cell_conv.RULE, fn, *args, joint=True)
    assert n == 0 and "aten.convolution.default" not in targets(after)
    _close(after, before, args, 0)


def test_the_token_select_then_moves_below_the_feature_math():
    """with token_select: the cell's split, head view and L2 norm run on [B, 1, ...], the token
    selected after them (the pattern's `q[:, t]`), bit for bit the same values"""
    def cell(x, state, slots, kq, kk, kv):
        taps = torch.cat([kq[:, 0], kk[:, 0], kv[:, 0]], -1)
        win = _window(x, state, slots)
        z = F.silu(torch.einsum("bkc,kc->bc", win, taps))
        q = z.split(W, -1)[0].unflatten(-1, (2, W // 2))
        q = q * torch.rsqrt(torch.sum(torch.square(q), -1, keepdim=True) + 1e-6) * 0.5
        return q.unsqueeze(-1), torch.index_put(state, (slots,), win[:, 1:])

    args = _args()
    before, after, n = rewrite(cell_conv.RULE, cell, *args, joint=True)
    assert n == 1
    moved = token_select.apply(after.graph)
    after.graph.eliminate_dead_code()
    after.recompile()
    assert moved >= 5
    (sel,) = [x for x in after.graph.nodes if x.target is aten.select.int]
    assert sel.args[0].target is aten.mul.Tensor and sel.args[0].args[1] == 0.5
    _close(after, before, args, 1e-5)


class Spell9KDA(torch.nn.Module):
    """spell9's `kda_step` alone (tiny config's sizes): its Flax parameter tree, a time-major conv
    state and the fp32 recurrent state, written back by `index_copy_` as spell9's step does."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        from k3compile.models import get_config
        from tests.models import spell9_k3 as s9

        self.cfg, self.s9 = get_config("tiny"), s9
        H, dk, D = self.cfg.kda_num_heads, self.cfg.kda_head_dim, self.cfg.hidden_size
        g = torch.Generator().manual_seed(0)

        def r(*shape):
            return torch.randn(*shape, generator=g) / shape[0] ** 0.5

        flat = {f"{m}.kernel": r(D, H * dk) for m in ("wq", "wk", "wv", "wg")}
        flat |= {"wf_a.kernel": r(D, dk), "wf_b.kernel": r(dk, H * dk), "wb.kernel": r(D, H),
                 "wo.kernel": r(H * dk, D), "A_log": r(H), "dt_bias": r(H * dk),
                 "o_norm.scale": r(dk) + 1}
        flat |= {f"{m}_conv.kernel": r(TAPS, 1, H * dk) for m in "qkv"}
        self.params = s9.ParamTree({k: v.to(dtype) for k, v in flat.items()})
        self.register_buffer("conv_state", r(S, TAPS - 1, 3 * H * dk).to(dtype))
        self.register_buffer("recurrent_state", r(S, H, dk, dk))  # fp32, as spell9's
        self.policy = s9.Policy(dtype)

    def forward(self, x, slots):
        self.s9._probes = frozenset()  # the Flax [in, out] kernels; an earlier test's probe may be left
        state = (self.conv_state[slots], self.recurrent_state[slots])
        y, new = self.s9.kda_step(self.policy, self.cfg, self.params.flat(), x, state)
        for buf, v in zip((self.conv_state, self.recurrent_state), new):
            buf.index_copy_(0, slots, v)
        return y


@pytest.mark.slow
@pytest.mark.parametrize(("batch", "dtype"), [(2, torch.float32), (1, torch.float32),
                                              (2, torch.bfloat16)])
def test_spell9_kda_step_fuses_as_kda_decode(batch, dtype):
    """spell9's own KDA step (tests/models/spell9_k3.py: the scanned cell with its conv inside,
    the vmapped delta rule, the Flax conv kernels), canonicalised by every rule, matches
    kda_decode's time-major T = 1 variant, and the canonical graph computes what the graph
    before the rules did (outputs and both states). `pack_weights` off: stage kernel_layout then
    moves no Flax kernel under the graph's inputs, which the comparison reads as given."""
    from k3compile.ops.kda_decode import KDAVariant
    from k3compile.rewrite.engine import apply_patterns
    from patterns import kda_decode
    from tests.canonical.compiled import assert_same_values, canonicalize

    model = Spell9KDA(dtype)
    x = torch.randn(batch, 1, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    c = canonicalize(None, {"x": x.to(dtype), "slots": torch.tensor([3, 0][:batch])},
                     module=model, stage_cache=False, pack_weights=False)
    assert c.counts["cell_conv"] == 1 and c.counts["token_select"] > 0
    assert_same_values(c, rel=1e-5)
    # bf16 (session 27): the conv in bf16 (rounded), spell9's Flax output norm on the fp32 o
    spec = "conv_time_major,o_fp32,norm_weight_fp32,conv_rounded" if \
        dtype == torch.bfloat16 else "conv_time_major"
    variant = kda_decode._variant(1, batch, dtype, variant=KDAVariant.parse(spec))
    report = apply_patterns(c.after.graph, [variant])
    assert [h.pattern for h in report.hits] == [variant.name]


@pytest.mark.slow
def test_spell9_bf16_kda_step_compiled_equals_eager():
    """spell9's bf16 KDA step under backend k3 (the step fused as kda_decode's conv_rounded,
    norm_weight_fp32 variant; CPU: the op's reference) against its eager twin, three steps on
    the carried states: the output and the conv state bit for bit, the fp32 recurrent state
    within fp32 summation order"""
    import torch._dynamo

    eager, model = Spell9KDA(torch.bfloat16), Spell9KDA(torch.bfloat16)
    torch._dynamo.reset()
    step = torch.compile(model, backend="k3", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 1, eager.cfg.hidden_size, generator=g).bfloat16()
        slots = torch.tensor([3, 0])
        assert torch.equal(step(x, slots), eager(x, slots))
        assert torch.equal(model.conv_state, eager.conv_state)
        assert rel_err(model.recurrent_state, eager.recurrent_state) <= 1e-6
