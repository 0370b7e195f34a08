"""depth_mix: the AttnRes depth mix with its sources stacked by a cat of unsqueezes, or its
weighted sum written as an einsum, a matmul or a Python loop, becomes the form
`k3compile.math.depth_mix` traces to (stack = cat + view; Σ over dim 0 of alpha[..., None] ·
sources in fp32) with equal values, dtype and shape; other cats and weighted sums stay. A mix on
dim 0 whose scores are spelled otherwise (a paper's einsum against the folded weights) becomes
the whole canonical mix, as does one whose weighted sum is (its ops are then no canonical form's). A mix over
sources stacked on another dim ([B, T, S, D], [N, S, D]: transformers' and Moonshot's spellings)
(or such a stack with its leading dims flattened, [B*T, S, D]: spell11's) becomes the whole
canonical mix, bit-equal in bf16 where the spelling rounds as the canonical form
does, within fp32 rounding otherwise (Moonshot's folded norm weight in fp32); a bf16 mix whose
scores are fp32 throughout (Moonshot's) becomes the fp32-scores canonical mix."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import k3compile.backend as k3be
from k3compile.canonical import depth_mix
from k3compile.canonical.depth_mix import _VIEWS
from k3compile.math import depth_mix_scores_fp32, depth_mix_weights, rms_norm
from tests.canonical.rule_checks import rewrite
from tests.conftest import TOL, rel_err
from tests.fusions.attention_checks import compile_with
from tests.fusions.pattern_checks import graph, targets
from tests.models.spell12_k3 import AttnRes

B, T, D, EPS = 2, 1, 16, 1e-6


_rewrite = functools.partial(rewrite, depth_mix)


def _args(n_blocks=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(n_blocks)
    acts = [torch.randn(B, T, D, generator=g).to(dtype) for _ in range(n_blocks + 1)]
    return [*acts, (1 + 0.1 * torch.randn(D, generator=g)).to(dtype),
            torch.randn(1, D, generator=g).to(dtype)]


def _stack(srcs, how):
    return torch.cat([s.unsqueeze(0) for s in srcs]) if how == "cat" else torch.stack(srcs)


def _alpha(sources, wn, wp):
    return torch.softmax(F.linear(rms_norm(sources, wn, EPS), wp).squeeze(-1).float(), dim=0)


WEIGHTED_SUMS = {
    "canonical": lambda a, v, srcs: (a.unsqueeze(-1) * v.float()).sum(0),
    "einsum": lambda a, v, srcs: torch.einsum("sbtd,sbt->btd", v.float(), a),
    "einsum_ellipsis": lambda a, v, srcs: torch.einsum("s...,s...d->...d", a, v.float()),
    "matmul": lambda a, v, srcs: torch.matmul(a.permute(1, 2, 0).unsqueeze(-2),
                                              v.float().permute(1, 2, 0, 3)).squeeze(-2),
    "loop_stack": lambda a, v, srcs: sum(a[i].unsqueeze(-1) * v[i].float() for i in range(len(v))),
    "loop_sources": lambda a, v, srcs: sum(a[i, ..., None] * s.float() for i, s in enumerate(srcs)),
}


def _mix(stack: str, weighted_sum: str):
    def mix(*args):
        *srcs, wn, wp = args
        sources = _stack(srcs, stack)
        alpha = _alpha(sources, wn, wp)
        return WEIGHTED_SUMS[weighted_sum](alpha, sources, srcs).to(srcs[-1].dtype)

    return mix


def _is_canonical(gm) -> bool:
    """torch.stack's cat + view, and the weighted sum as sum(mul(unsqueeze(softmax), .), [0])."""
    nodes = list(gm.graph.nodes)
    cat = next(n for n in nodes if str(n.target) == "aten.cat.default")
    total = [n for n in nodes if str(n.target) == "aten.sum.dim_IntList" and n.args[1] == [0]
             and not n.args[2:]]  # the softmax's own sum keeps its dim
    stacked = (all(str(s.target) != "aten.unsqueeze.default" for s in cat.args[0])
               and [str(u.target) for u in cat.users] == ["aten.view.default"])
    weighted = len(total) == 1 and str(total[0].args[0].target) == "aten.mul.Tensor" and any(
        str(a.target) == "aten.unsqueeze.default" and str(a.args[0].target) == "aten.div.Tensor"
        for a in total[0].args[0].args)
    return stacked and weighted and "aten.bmm.default" not in targets(gm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted_sum", sorted(WEIGHTED_SUMS))
@pytest.mark.parametrize("stack", ["stack", "cat"])
def test_spelling_becomes_the_canonical_mix(stack, weighted_sum, dtype):
    fn, args = _mix(stack, weighted_sum), _args(3, dtype)
    before, after, n = _rewrite(fn, *args)
    # a weighted sum spelled otherwise makes the mix's ops no canonical form's: the whole mix is
    # rebuilt (one site); with the canonical sum, a cat of unsqueezes becomes the stack (one)
    assert n == (1 if weighted_sum != "canonical" else stack == "cat")
    assert _is_canonical(after)
    got, want = after(*args), before(*args)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert rel_err(got, want) <= 1e-6  # summation order only
    else:
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # the same fp32 sum, in bf16


def test_one_source_at_batch_one():
    """Size-1 dims everywhere ([1, 1, D] sources): the loop still becomes the canonical sum."""
    args = [a[:1] if a.dim() == 3 else a for a in _args(1)]
    fn = _mix("cat", "loop_sources")
    before, after, n = _rewrite(fn, *args)
    assert n == 1 and _is_canonical(after)
    assert rel_err(after(*args), before(*args)) <= 1e-6


def _not_a_mix(*args):
    *srcs, _, _ = args
    return torch.cat([s.unsqueeze(0) for s in srcs]).amax(0)  # a cat of sources, no softmax


def _bf16_weighted_sum(*args):
    *srcs, wn, wp = args
    sources = torch.stack(srcs)
    alpha = _alpha(sources, wn, wp).to(torch.bfloat16)
    return torch.einsum("sbtd,sbt->btd", sources, alpha)  # rounds in bf16: not the fp32 sum


def _squared_weights(*args):
    *srcs, wn, wp = args
    sources = torch.stack(srcs)
    alpha = _alpha(sources, wn, wp)
    return torch.einsum("sbtd,sbt->btd", sources.float(), alpha * alpha)


def _other_values(*args):
    *srcs, wn, wp = args
    sources = torch.stack(srcs)
    alpha = _alpha(sources, wn, wp)
    return torch.einsum("sbtd,sbt->btd", sources.float().tanh(), alpha)


def _escaping_alpha(*args):
    *srcs, wn, wp = args
    sources = torch.stack(srcs)
    alpha = _alpha(sources, wn, wp)
    return torch.einsum("sbtd,sbt->btd", sources.float(), alpha), alpha


def _softmax_over_batch(*args):
    *srcs, _, wp = args
    x = torch.stack(srcs, dim=1)  # [B, S, T, D]: dim 0 is the batch
    alpha = torch.softmax(F.linear(x, wp).squeeze(-1), dim=0)
    return torch.einsum("bstd,bst->std", x, alpha)


def _folded_squared(*args):
    """spell7's GEMM-free scores on dim 0, but of the squared normalised sources: not a mix."""
    *srcs, wn, wp = args
    src = torch.stack(srcs).float()
    normed = F.rms_norm(src, (src.shape[-1],), eps=EPS)
    scores = (normed * normed * (wn * wp.squeeze(0))).sum(-1)
    return (scores.softmax(dim=0).unsqueeze(-1) * src).sum(0)


LOOK_ALIKES = {"not_a_mix": _not_a_mix, "folded_squared": _folded_squared, "bf16_weighted_sum": _bf16_weighted_sum,
               "squared_weights": _squared_weights, "other_values": _other_values,
               "escaping_alpha": _escaping_alpha, "softmax_over_batch": _softmax_over_batch}


def _assert_left_alone(fn, args):
    """No site rewritten: the same ops, bit-equal outputs."""
    before, after, n = _rewrite(fn, *args)
    assert n == 0
    assert targets(after) == targets(before)
    for got, want in zip(*(torch.utils._pytree.tree_leaves(f(*args)) for f in (after, before))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(LOOK_ALIKES))
def test_look_alike_is_left_alone(name):
    _assert_left_alone(LOOK_ALIKES[name],
                       _args(2, torch.bfloat16 if name.startswith("bf16") else torch.float32))


class MixNorm(nn.Module):
    """The post-attention mix and norm of an AttnRes layer, sources stacked by a cat of
    unsqueezes and summed by an einsum."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.mix_norm = nn.Parameter(1 + 0.1 * torch.randn(D, generator=g))
        self.mix_proj = nn.Parameter(torch.randn(1, D, generator=g))
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(D, generator=g))

    def forward(self, prefix, delta, b0, b1):
        prefix = prefix + delta
        sources = torch.cat([s.unsqueeze(0) for s in (b0, b1, prefix)])
        alpha = _alpha(sources, self.mix_norm, self.mix_proj)
        h = torch.einsum("sbtd,sbt->btd", sources.float(), alpha).to(prefix.dtype)
        return rms_norm(h, self.norm, 1e-5), prefix


@pytest.mark.slow
def test_mix_written_with_cat_and_einsum_fuses():
    torch._dynamo.reset()
    model = MixNorm().requires_grad_(False)
    args = [torch.randn(B, T, D) for _ in range(4)]
    got = compile_with(model, "attn_res_mix_norm")(*args)
    report = next(iter(k3be.last_compiled().observer.reports.values()))
    assert [h.op for h in report.hits] == ["k3.attn_res_mix_norm"]
    for g, w in zip(got, model(*args)):
        assert rel_err(g, w) <= TOL["aten_cpu"]


# ---- sources stacked along another dim ([.., S, .., D]): the whole mix rebuilt -----------------


def _tokens(n_blocks=2, dtype=torch.float32, shape=(B, T, D)):
    """Sources [*shape] and the mix's weights (norm [D], pseudo-query [1, D])."""
    g = torch.Generator().manual_seed(10 + n_blocks)
    acts = [torch.randn(shape, generator=g).to(dtype) for _ in range(n_blocks + 1)]
    return [*acts, (1 + 0.1 * torch.randn(D, generator=g)).to(dtype),
            (torch.randn(1, D, generator=g) / D ** 0.5).to(dtype)]


def _scores(values, wn, wp):
    return F.linear(rms_norm(values, wn, EPS), wp).squeeze(-1).float()


def _hf(*args):
    """transformers-style: cat of unsqueeze(-2) [B, T, S, D], softmax over -1, sum over -2."""
    *srcs, wn, wp = args
    values = torch.cat([s.unsqueeze(-2) for s in srcs], dim=-2)
    probs = _scores(values, wn, wp).softmax(dim=-1)
    return (probs.unsqueeze(-1) * values.float()).sum(dim=-2).to(srcs[-1].dtype)


def _stack1_keepdim(*args):
    """torch.stack(dim=1) [B, S, T, D], scores kept [B, S, T, 1], softmax over dim 1."""
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=1)
    probs = F.linear(rms_norm(values, wn, EPS), wp).float().softmax(dim=1)
    return (probs * values.float()).sum(1).to(srcs[-1].dtype)


def _einsum(*args):
    """torch.stack(dim=-2) [B, T, S, D] and an einsum over the sources."""
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=-2)
    probs = torch.softmax(_scores(values, wn, wp), dim=-1)
    return torch.einsum("btsd,bts->btd", values.float(), probs).to(srcs[-1].dtype)


def _moonshot(*args, flat: bool = True):
    """Moonshot's dataflow: tokens [N, D], the block list grown by cats from `new_zeros(N, 0,
    D)`, the norm weight folded into the pseudo-query in fp32, `matmul` over the sources."""
    *srcs, wn, wp = args
    shape = srcs[0].shape
    if not flat:
        srcs = [s.view(-1, D) for s in srcs]
    blocks = srcs[0].new_zeros(srcs[0].shape[0], 0, D)
    for s in srcs[:-1]:
        blocks = torch.cat([blocks, s.unsqueeze(1)], dim=1)
    v = torch.cat((blocks, srcs[-1].unsqueeze(1)), dim=1).float()
    k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
    probs = (k * (wn.float() * wp.squeeze(0).float())).sum(-1).softmax(-1).unsqueeze(1)
    out = torch.matmul(probs, v).squeeze(1).to(srcs[-1].dtype)
    return out if flat else out.view(shape)


def _moonshot_tokens(*args):
    """Moonshot's mix of [B, T, D] sources flattened to tokens and viewed back."""
    return _moonshot(*args, flat=False)


def _bmm(*args):
    """stack(dim=1) of [N, D] tokens and a bmm of the weights [N, 1, S] with them."""
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=1)
    probs = _scores(values, wn, wp).softmax(dim=1)
    return torch.bmm(probs.unsqueeze(1), values.float()).squeeze(1).to(srcs[-1].dtype)


def _spell7(*args):
    """spell7 (a serving file): sources stacked on dim 0 by a cat of unsqueezes, scores as the
    RMS-normalised sources times the folded weight `w_norm * w_proj` summed over D (no GEMM;
    spell7 writes `F.rms_norm(src, (D,), w_norm * w_proj)`, whose decomposition here is not
    functionalised), softmax over dim 0, the canonical weighted sum."""
    *srcs, wn, wp = args
    src = torch.cat([s.unsqueeze(0) for s in srcs]).float()
    normed = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + EPS)
    scores = (normed * (wn.float() * wp.float().squeeze(0))).sum(-1)
    return (scores.softmax(dim=0).unsqueeze(-1) * src).sum(0).to(srcs[-1].dtype)


def _spell11(*args, rsqrt_first: bool = False):
    """tests/models/spell11_k3.py: the bank grown by cats on dim -2 from an empty [B, T, 0, D]
    and sliced, the sources [B, T, S, D] flattened to [B*T, S, D] after the cat (and the cast to
    fp32), the scores `bmm(sources, w_norm * w_proj) * rsqrt(mean(v²) + eps)` (the rsqrt after
    the projection; `rsqrt_first`: before it), softmax over dim 1, the mix `bmm(alpha [M, 1, S],
    sources)` viewed back to [B, T, D]."""
    *srcs, wn, wp = args
    prefix = srcs[-1]
    bank = prefix.new_empty(*prefix.shape[:-1], 0, prefix.shape[-1])
    for s in srcs[:-1]:
        bank = torch.cat([bank, s.unsqueeze(-2)], -2)
    src = torch.cat([bank[..., :len(srcs) - 1, :], prefix.unsqueeze(-2)], -2).float().flatten(0, 1)
    inv = torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + EPS)  # [M, S, 1]
    query = (wn * wp[0]).float()[None, :, None].expand(src.shape[0], -1, 1)
    score = torch.bmm(src * inv, query) if rsqrt_first else torch.bmm(src, query) * inv
    alpha = torch.softmax(score, 1).transpose(1, 2)  # [M, 1, S]
    return torch.bmm(alpha, src).squeeze(1).view_as(prefix).to(prefix.dtype)


def _spell11_rsqrt_first(*args):
    return _spell11(*args, rsqrt_first=True)


def _flat_reshape(*args):
    """torch.stack(dim=-2) [B, T, S, D] reshaped to [B*T, S, D], scores as the normalised sources
    times the folded weight summed over D, an einsum over the sources, reshaped back."""
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=-2).reshape(-1, len(srcs), D)
    normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + EPS)
    probs = (normed * (wn * wp.view(D))).sum(-1).softmax(-1)  # [M, S]
    return torch.einsum("ms,msd->md", probs, values).reshape(srcs[-1].shape)


# name -> (fn, source shape, dtypes it is taken in: bf16 Moonshot in
# test_fp32_scores_in_bf16_become_the_fp32_scores_mix)
FP32, BOTH = (torch.float32,), (torch.float32, torch.bfloat16)
RELAID = {"hf": (_hf, (B, T, D), BOTH), "stack1_keepdim": (_stack1_keepdim, (B, T, D), BOTH),
          "einsum": (_einsum, (B, T, D), BOTH), "bmm": (_bmm, (3, D), BOTH),
          "moonshot": (_moonshot, (3, D), FP32),
          "moonshot_tokens": (_moonshot_tokens, (B, T, D), FP32),
          "spell7": (_spell7, (3, D), FP32), "spell11": (_spell11, (B, 3, D), FP32),
          "spell11_rsqrt_first": (_spell11_rsqrt_first, (B, 3, D), FP32),
          "flat_reshape": (_flat_reshape, (B, 3, D), FP32)}


def _canonical_targets(args) -> list[str]:
    *srcs, wn, wp = args
    return targets(graph(lambda *a: depth_mix_weights(a[-3], list(a[:-3]), a[-2], a[-1], EPS),
                         *srcs, wn, wp))


@pytest.mark.parametrize(("name", "dtype"), [(name, t) for name in sorted(RELAID)
                                             for t in RELAID[name][2]])
def test_relaid_spelling_becomes_the_canonical_mix(name, dtype):
    fn, shape, _ = RELAID[name]
    for n_blocks in (1, 3):
        args = _tokens(n_blocks, dtype, shape)
        before, after, n = _rewrite(fn, *args)
        assert n == 1
        assert targets(after) == _canonical_targets(args)  # the form the patterns match
        got, want = after(*args), before(*args)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        # fp32: summation order and the folded weight's association; bf16: the same roundings
        assert rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 0)


def test_pseudo_query_as_a_vector():
    """A pseudo-query kept as a [D] vector and applied by `(normed * q).sum(-1)`: both weights
    have D values, the evaluation decides which is the norm's; the canonical projection takes
    q viewed as [1, D] (fp32: the mm's summation order only)."""
    *srcs, wn, wp = args = [*_tokens(2)[:-1], _tokens(2)[-1].view(D)]

    def mix(*args):
        *srcs, wn, q = args
        values = torch.stack(srcs, dim=-2)
        probs = (rms_norm(values, wn, EPS) * q).sum(-1).softmax(-1)
        return (probs.unsqueeze(-1) * values).sum(-2)

    before, after, n = _rewrite(mix, *args)
    assert n == 1
    q = [n for n in after.graph.nodes if n.op == "placeholder"][-1]
    (as_row,) = q.users  # q.view(1, D), then the canonical projection's permute
    shape, uses = as_row.args[1], [str(u.target) for u in as_row.users]
    assert list(shape) == [1, D] and uses == ["aten.permute.default"]
    rest = [str(n.target) for n in after.graph.nodes if n.op == "call_function" and n is not as_row]
    assert rest == _canonical_targets([*srcs, wn, wp.view(1, D)])
    assert rel_err(after(*args), before(*args)) <= 1e-6


def _fp32_scores_linear(*args):
    """The scores in fp32 as a norm then a projection (not folded), sources stacked on dim -2,
    an einsum for the weighted sum."""
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=-2).float()
    normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + EPS) * wn.float()
    probs = F.linear(normed, wp.float()).squeeze(-1).softmax(-1)
    return torch.einsum("btsd,bts->btd", values, probs).to(srcs[-1].dtype)


FP32_SCORES = {"moonshot": (_moonshot, (3, D)), "moonshot_tokens": (_moonshot_tokens, (B, T, D)),
               "linear": (_fp32_scores_linear, (B, T, D))}


def _fp32_scores_targets(args) -> list[str]:
    *srcs, wn, wp = args
    return targets(graph(lambda *a: depth_mix_scores_fp32(a[-3], list(a[:-3]), a[-2], a[-1], EPS),
                         *srcs, wn, wp))


@pytest.mark.parametrize("name", sorted(FP32_SCORES))
def test_fp32_scores_in_bf16_become_the_fp32_scores_mix(name):
    """A bf16 mix whose scores are fp32 throughout (Moonshot's fold `(w_norm * w_proj)` on the
    fp32-normalised sources, or a norm and a projection in fp32) skips the roundings to bf16 of
    the built-in form: it becomes the second canonical form, `depth_mix_scores_fp32` (fp32
    summation order only: at most an ulp of the bf16 result apart)."""
    fn, shape = FP32_SCORES[name]
    for n_blocks in (1, 3):
        args = _tokens(n_blocks, torch.bfloat16, shape)
        before, after, n = _rewrite(fn, *args)
        assert n == 1 and targets(after) == _fp32_scores_targets(args)
        got, want = after(*args), before(*args)
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=8e-3, atol=0)
        built_in = depth_mix_weights(args[n_blocks], list(args[:n_blocks]), *args[-2:], EPS)
        assert not torch.equal(built_in.view(want.shape), want)  # another bf16 computation


def _unnormalised(*args):
    *srcs, _, wp = args
    values = torch.stack(srcs, dim=-2)
    probs = F.linear(values, wp).squeeze(-1).softmax(-1)  # no norm: one weight
    return (probs.unsqueeze(-1) * values).sum(-2)


def _tempered(*args):
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=-2)
    probs = (_scores(values, wn, wp) / 2.0).softmax(-1)  # a temperature: other weights
    return (probs.unsqueeze(-1) * values).sum(-2)


def _sum_over_tokens(*args):
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=-2)  # [B, T, S, D]
    probs = _scores(values, wn, wp).softmax(-1)
    return (probs.unsqueeze(-1) * values).sum(-3)  # over T, not the sources


def _escaping_probs(*args):
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=-2)
    probs = _scores(values, wn, wp).softmax(-1)
    return (probs.unsqueeze(-1) * values).sum(-2), probs


def _gated_sources(*args):
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=-2)
    probs = _scores(values, wn, wp).softmax(-1)
    return (probs.unsqueeze(-1) * values.sigmoid()).sum(-2)  # mixes other values


RELAID_LOOK_ALIKES = {"unnormalised": _unnormalised, "tempered": _tempered,
                      "sum_over_tokens": _sum_over_tokens, "escaping_probs": _escaping_probs,
                      "gated_sources": _gated_sources}


@pytest.mark.parametrize("name", sorted(RELAID_LOOK_ALIKES))
def test_relaid_look_alike_is_left_alone(name):
    _assert_left_alone(RELAID_LOOK_ALIKES[name], _tokens(2))


class RelaidMixNorm(nn.Module):
    """The post-attention mix and norm of an AttnRes layer in a spelling of RELAID."""

    def __init__(self, mix):
        super().__init__()
        *_, wn, wp = _tokens(2)
        self.mix = mix
        self.mix_norm, self.mix_proj = nn.Parameter(wn), nn.Parameter(wp)
        gen = torch.Generator().manual_seed(4)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(D, generator=gen))

    def forward(self, prefix, delta, b0, b1):
        prefix = prefix + delta
        h = self.mix(b0, b1, prefix, self.mix_norm, self.mix_proj)
        return rms_norm(h, self.norm, 1e-5), prefix


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype"), [("hf", torch.float32),
                                             ("moonshot_tokens", torch.float32),
                                             ("moonshot_tokens", torch.bfloat16),
                                             ("fp32_scores_linear", torch.bfloat16),
                                             ("spell11", torch.float32),
                                             ("spell12", torch.float32),
                                             ("spell12", torch.bfloat16)])
def test_relaid_mix_fuses(name, dtype):
    """Under the backend; bf16 with fp32 scores (Moonshot's, spell12's sources scored apart, and
    a norm + projection in fp32) as the op's scores_fp32 variant."""
    torch._dynamo.reset()
    mix = RELAID[name][0] if name in RELAID else APART.get(name, _fp32_scores_linear)
    model = RelaidMixNorm(mix).requires_grad_(False).to(dtype)
    args = [torch.randn(B, T, D).to(dtype) for _ in range(4)]
    got = compile_with(model, "attn_res_mix_norm")(*args)
    report = next(iter(k3be.last_compiled().observer.reports.values()))
    assert [h.op for h in report.hits] == ["k3.attn_res_mix_norm"]
    assert report.hits[0].pattern.endswith(",scores_fp32]") == (dtype == torch.bfloat16)
    for g, w in zip(got, model(*args)):
        assert g.dtype == w.dtype == dtype
        assert rel_err(g, w) <= (TOL["aten_cpu"] if dtype == torch.float32 else TOL["bfloat16"])


def _moonshot_with(normed, fold, scores_dtype=torch.float32):
    """Moonshot's mix of [N, D] tokens with the normalised sources and the folded weight spelled
    by `normed(v_fp32, rstd)` and `fold(wn, wp)`, the scores summed in `scores_dtype`."""
    def mix(*args):
        *srcs, wn, wp = args
        v = torch.stack(srcs, dim=1).float()
        k = normed(v, torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS))
        score_weight = fold(wn, wp.squeeze(0))
        scores = (k.to(scores_dtype) * score_weight.to(scores_dtype)).sum(-1).float()
        probs = scores.softmax(-1).unsqueeze(1)
        return torch.matmul(probs, v).squeeze(1).to(srcs[-1].dtype)

    return mix


# one bf16 rounding away from the fp32-scores form (and from the built-in one)
FP32_SCORES_LOOK_ALIKES = {
    # the scores in bf16, the weights multiplied first (in bf16)
    "bf16_scores_fold_first": _moonshot_with(lambda v, r: v * r, lambda wn, wp: wn * wp,
                                             torch.bfloat16),
    # fp32 scores, but the fold wn·wp rounded to bf16
    "fold_rounded": _moonshot_with(lambda v, r: v * r, lambda wn, wp: (wn * wp).float()),
    # fp32 scores, but the normalised sources rounded to bf16 once
    "normed_rounded": _moonshot_with(lambda v, r: (v * r).bfloat16().float(),
                                     lambda wn, wp: wn.float() * wp.float()),
}


@pytest.mark.parametrize("name", sorted(FP32_SCORES_LOOK_ALIKES))
def test_fp32_scores_look_alike_is_left_alone(name):
    """A bf16 mix one rounding away from Moonshot's fp32 scores is neither canonical form: left
    as it is (no scores_fp32 variant can take it), bit-equal."""
    fn = FP32_SCORES_LOOK_ALIKES[name]
    for n_blocks in (1, 3):
        args = _tokens(n_blocks, torch.bfloat16, (3, D))
        _assert_left_alone(fn, args)
        exact = _moonshot_with(lambda v, r: v * r, lambda wn, wp: wn.float() * wp.float())
        assert not torch.equal(fn(*args), exact(*args))  # another bf16 computation


def test_fp32_scores_spelled_with_the_helper_is_taken():
    """The same helper with every factor in fp32 (Moonshot's spelling) is taken as the
    fp32-scores form: the look-alikes above fail by their one rounding, not by their spelling."""
    fn = _moonshot_with(lambda v, r: v * r, lambda wn, wp: wn.float() * wp.float())
    args = _tokens(3, torch.bfloat16, (3, D))
    before, after, n = _rewrite(fn, *args)
    assert n == 1 and targets(after) == _fp32_scores_targets(args)
    torch.testing.assert_close(after(*args), before(*args), rtol=8e-3, atol=0)


# ---- a block bank: preallocated, written by slice assignment, read by a slice -------------------


def _bank_mix(prefix, bank, n, wn, wp):
    """The red-team spelling's mix over [bank[:, :n], prefix] ([N, D] tokens, a bmm)."""
    src = torch.cat((bank[:, :n], prefix.unsqueeze(1)), dim=1).float()
    normed = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + EPS)
    score = normed @ (wn.float() * wp.float()[0])
    e = torch.exp(score - score.amax(-1, keepdim=True))
    return torch.bmm((e / e.sum(-1, keepdim=True)).unsqueeze(1), src).squeeze(1).to(prefix.dtype)


def _bank_select(*args):
    """bank[:, j] = block (select_scatter), read bank[:, :2] of 3 slots, and bank[:, :1] after."""
    b0, b1, prefix, wn, wp = args
    bank = prefix.new_zeros(prefix.shape[0], 3, D)
    bank[:, 0] = b0
    first = _bank_mix(prefix, bank, 1, wn, wp)
    bank[:, 1] = b1
    return first, _bank_mix(prefix, bank, 2, wn, wp), _bank_mix(prefix, bank, 1, wn, wp)


def _bank_full(*args):
    """Every slot written, the bank read whole (no slice), a slot overwritten first."""
    b0, b1, prefix, wn, wp = args
    bank = prefix.new_zeros(prefix.shape[0], 2, D)
    bank[:, 1] = prefix
    bank[:, 0] = b0
    bank[:, 1] = b1  # the latest write of slot 1 wins
    return _bank_mix(prefix, bank, 2, wn, wp)


def _bank_slices(*args):
    """Slots written by slice_scatter (`bank[:, j:j + 1] = x[:, None]`, two at once by a stack)."""
    b0, b1, prefix, wn, wp = args
    bank = prefix.new_zeros(prefix.shape[0], 4, D)
    bank[:, 1:3] = torch.stack((b0, b1), dim=1)
    bank[:, 0:1] = b1.unsqueeze(1)
    return _bank_mix(prefix, bank[:, 1:], 2, wn, wp), _bank_mix(prefix, bank, 1, wn, wp)


def _one_block_stack(*args):
    """Blocks kept in a list and read by torch.stack(dim=1): one block is a view, no cat."""
    b0, b1, prefix, wn, wp = args
    return (_bank_mix(prefix, torch.stack([b0], dim=1), 1, wn, wp),
            _bank_mix(b1, torch.stack([b0, prefix], dim=1), 2, wn, wp))


def _written_in_place(*args):
    """A slot changed in place after it was written (bank[:, 0] += x): the slot's source is the
    sum, the latest write."""
    b0, b1, prefix, wn, wp = args
    bank = prefix.new_zeros(prefix.shape[0], 2, D)
    bank[:, 0] = b0
    bank[:, 1] = b1
    bank[:, 0] += b1
    return _bank_mix(prefix, bank, 2, wn, wp)


# name -> (fn, mixes rewritten)
BANKS = {"select": (_bank_select, 3), "full": (_bank_full, 1), "slices": (_bank_slices, 2),
         "one_block_stack": (_one_block_stack, 2), "written_in_place": (_written_in_place, 1)}


def _bank_args(dtype=torch.float32):
    *acts, wn, wp = _tokens(2, dtype, (3, D))
    return [*acts, wn, wp]


def _functional(fn):
    return torch.func.functionalize(fn)  # slice assignment as the backend sees it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(BANKS))
def test_bank_spelling_becomes_the_canonical_mix(name, dtype):
    """The sources of bank[:, :n] are the tensors last written at 0..n-1: each mix becomes the
    canonical mix over them (fp32 summation order; bf16: fp32 scores, at most an ulp)."""
    fn, sites = BANKS[name]
    args = _bank_args(dtype)
    before, after, n = _rewrite(_functional(fn), *args)
    assert n == sites
    assert "aten.bmm.default" not in targets(after)
    if name != "written_in_place":  # the bank is read by no mix any more: dead
        assert not {"aten.select_scatter.default", "aten.slice_scatter.default"} & set(
            targets(after))
    for got, want in zip(after(*args), before(*args), strict=True):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        if dtype == torch.float32:
            assert rel_err(got, want) <= 1e-6
        else:
            torch.testing.assert_close(got, want, rtol=8e-3, atol=0)


def _unwritten_slot(*args):
    """bank[:, :2] with slot 1 never written: its zeros are a source, no block: left alone."""
    b0, _, prefix, wn, wp = args
    bank = prefix.new_zeros(prefix.shape[0], 3, D)
    bank[:, 0] = b0
    return _bank_mix(prefix, bank, 2, wn, wp)


def _bank_from_input(*args):
    """A bank that is an input (slot 1 holds whatever the caller passed): left alone."""
    b0, b1, prefix, wn, wp = args
    bank = torch.stack((b1, b1, b1), dim=1).sin()
    bank[:, 0] = b0
    return _bank_mix(prefix, bank, 2, wn, wp)


def _write_other_dim(*args):
    """A write along the batch dim after the slot writes: the chain is not known, left alone."""
    b0, b1, prefix, wn, wp = args
    bank = prefix.new_zeros(prefix.shape[0], 2, D)
    bank[:, 0] = b0
    bank[:, 1] = b1
    bank[0] = prefix[1:].expand(2, D)
    return _bank_mix(prefix, bank, 2, wn, wp)


BANK_LOOK_ALIKES = {"unwritten_slot": _unwritten_slot, "bank_from_input": _bank_from_input,
                    "write_other_dim": _write_other_dim}


@pytest.mark.parametrize("name", sorted(BANK_LOOK_ALIKES))
def test_bank_look_alike_is_left_alone(name):
    """A read index that no known scatter with a static index writes: the graph stays as it is."""
    _assert_left_alone(_functional(BANK_LOOK_ALIKES[name]), _bank_args())


# ---- sources flattened after the stack ([B, T, S, D] -> [B*T, S, D], spell11) -----------------
# (RELAID's spell11, spell11_rsqrt_first, flat_reshape: fp32, summation order)


def _master_weights(n_blocks: int) -> list[torch.Tensor]:
    """bf16 sources and fp32 mix weights (spell11's fp32 master weights in its bf16 step)."""
    *acts, wn, wp = _tokens(n_blocks, torch.float32, (B, 3, D))
    return [*(a.to(torch.bfloat16) for a in acts), wn, wp]


def test_spell11_bf16_with_fp32_weights_becomes_the_fp32_scores_mix():
    """spell11's bf16 step: bf16 sources cast to fp32 before the flatten, the fold of fp32
    weights, scores and mix in fp32: the fp32-scores canonical form over the unflattened
    sources, within an ulp of the bf16 result (fp32 summation order; measured bit-equal)."""
    for n_blocks in (1, 3):
        args = _master_weights(n_blocks)
        before, after, n = _rewrite(_spell11, *args)
        assert n == 1 and "aten.bmm.default" not in targets(after)
        got, want = after(*args), before(*args)
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=8e-3, atol=0)
        scores_fp32 = depth_mix_scores_fp32(args[n_blocks], list(args[:n_blocks]), *args[-2:], EPS)
        torch.testing.assert_close(got, scores_fp32, rtol=8e-3, atol=0)


def test_spell11_bf16_fold_is_left_alone():
    """bf16 weights: spell11's fold `w_norm * w_proj[0]` rounds in bf16, as no canonical form
    does (up to 4.7e-3 of the output apart from either form, measured: not rounding order):
    left alone."""
    _assert_left_alone(_spell11, _tokens(2, torch.bfloat16, (B, 3, D)))


def _merged_source_dim(*args):
    """torch.stack(dim=1) [B, S, T, D] flattened to [B*S, T, D]: the flatten merges the source
    dim; the softmax runs over T (a mix over tokens, not sources)."""
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=1).flatten(0, 1)
    probs = _scores(values, wn, wp).softmax(1)
    return torch.bmm(probs.unsqueeze(1), values).squeeze(1)


def _softmax_over_merged_tokens(*args):
    """[B, T, S, D] flattened to [B*T, S, D], softmax over the flattened tokens (dim 0)."""
    *srcs, wn, wp = args
    values = torch.stack(srcs, dim=-2).flatten(0, 1)
    probs = _scores(values, wn, wp).softmax(0)
    return (probs.unsqueeze(-1) * values).sum(0)


FLAT_LOOK_ALIKES = {"merged_source_dim": _merged_source_dim,
                    "softmax_over_merged_tokens": _softmax_over_merged_tokens}


@pytest.mark.parametrize("name", sorted(FLAT_LOOK_ALIKES))
def test_flattened_look_alike_is_left_alone(name):
    _assert_left_alone(FLAT_LOOK_ALIKES[name], _tokens(2, torch.float32, (B, 3, D)))


# ---- sources on dim 0, scores spelled otherwise: the whole mix rebuilt -------------------------
# (until session 27 rule `depth_mix_scores`): a paper's einsum against the folded
# `w_norm * w_proj[0]` (spell8), a broadcast product summed over D, a matmul with the folded
# vector become the canonical mix; a mix already canonical, one of other values (no norm, squared
# weights) and a softmax over another dim are left alone.

FOLD_EPS = 1e-5

def _folded_args(n_blocks=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(n_blocks)
    acts = [torch.randn(B, T, D, generator=g).to(dtype) for _ in range(n_blocks + 1)]
    return [*acts, (1 + 0.1 * torch.randn(D, generator=g)).to(dtype),
            (D ** -0.5 * torch.randn(1, D, generator=g)).to(dtype)]


def _folded_normed(v):
    return v / torch.sqrt(torch.mean(v ** 2, dim=-1, keepdim=True) + FOLD_EPS)


def _einsum_folded(*args):  # tests/models/spell8_k3.py
    *srcs, wn, wp = args
    v = torch.stack(srcs, dim=0).float()
    scores = torch.einsum("s...d,d->s...", _folded_normed(v), wn.float() * wp[0].float())
    return torch.einsum("s...,s...d->...d", torch.softmax(scores, dim=0), v).to(srcs[-1].dtype)


def _broadcast_sum(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    scores = (_folded_normed(v) * (wn * wp.view(-1))).sum(-1)
    alpha = scores.softmax(0)
    return (alpha.unsqueeze(-1) * v).sum(0).to(srcs[-1].dtype)


def _matmul_folded(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    alpha = torch.softmax(_folded_normed(v) @ (wn * wp.squeeze(0)), dim=0)
    return torch.einsum("sbt,sbtd->btd", alpha, v).to(srcs[-1].dtype)


FOLDED = {"einsum_folded": _einsum_folded, "broadcast_sum": _broadcast_sum,
             "matmul_folded": _matmul_folded}


def _folded_canonical(*args):
    *srcs, wn, wp = args
    return depth_mix_weights(srcs[-1], list(srcs[:-1]), wn, wp, FOLD_EPS)


def _non_view_ops(gm) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes
                               if n.op == "call_function" and n.target not in _VIEWS)


@pytest.mark.parametrize("n_blocks", [1, 3])
@pytest.mark.parametrize("name", sorted(FOLDED))
def test_folded_scores_become_the_canonical_mix(name, n_blocks):
    args = _folded_args(n_blocks)
    before, after, n = _rewrite(FOLDED[name], *args)
    assert n == 1
    assert _non_view_ops(after) == _non_view_ops(graph(_folded_canonical, *args))
    got, want = after(*args), before(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 1e-6  # summation order and the fold's association only


def _folded_no_norm(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    scores = torch.einsum("s...d,d->s...", v, wn * wp[0])
    return torch.einsum("s...,s...d->...d", torch.softmax(scores, dim=0), v)


def _folded_squared_weights(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    alpha = torch.softmax(torch.einsum("s...d,d->s...", _folded_normed(v), wn * wp[0]), dim=0)
    return torch.einsum("s...,s...d->...d", alpha * alpha, v)


def _folded_softmax_over_batch(*args):
    *srcs, wn, wp = args
    x = torch.stack(srcs, dim=1).float()  # [B, S, T, D]: dim 0 is the batch
    alpha = torch.softmax(torch.einsum("bstd,d->bst", _folded_normed(x), wn * wp[0]), dim=0)
    return torch.einsum("bstd,bst->std", x, alpha)


def _folded_bf16_scores(*args):
    *srcs, wn, wp = args
    v = torch.stack(srcs)  # bf16 throughout: rounds where the canonical forms do not
    scores = torch.einsum("s...d,d->s...", _folded_normed(v), wn * wp[0]).float()
    return torch.einsum("s...,s...d->...d", torch.softmax(scores, dim=0), v.float())


def _folded_canonical_ops(*args):  # the canonical form's ops, spelled by hand, no GEMM
    *srcs, wn, wp = args
    v = torch.stack(srcs).float()
    scores = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + FOLD_EPS) * wn * wp.view(-1)).sum(-1)
    return (scores.softmax(0).unsqueeze(-1) * v).sum(0)


FOLDED_LOOK_ALIKES = {"canonical": _folded_canonical, "squared_weights": _folded_squared_weights,
                      "softmax_over_batch": _folded_softmax_over_batch}


@pytest.mark.parametrize("name", sorted(FOLDED_LOOK_ALIKES))
def test_folded_look_alike_is_left_alone(name):
    _assert_left_alone(FOLDED_LOOK_ALIKES[name], _folded_args(2))


def test_folded_mix_whose_alpha_escapes_is_left_alone():
    def escaping(*args):
        *srcs, wn, wp = args
        v = torch.stack(srcs).float()
        alpha = torch.softmax(torch.einsum("s...d,d->s...", _folded_normed(v), wn * wp[0]), dim=0)
        return torch.einsum("s...,s...d->...d", alpha, v), F.relu(alpha)

    args = _folded_args(2)
    before, after, n = _rewrite(escaping, *args)
    assert n == 0 and targets(after) == targets(before)


def test_folded_canonical_ops_without_a_gemm_are_rebuilt():
    """A mix whose ops (views aside) are already a canonical form's but whose scores reach the
    softmax through no GEMM (`(v * rsqrt(..) * wn * wp).sum(-1)`, spell7's kind) is rebuilt as
    the canonical mix (with its projection), within fp32 rounding."""
    args = _folded_args(2)
    before, after, n = _rewrite(_folded_canonical_ops, *args)
    assert n == 1
    assert targets(after) == targets(graph(_folded_canonical, *args))
    got, want = after(*args), before(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 1e-6


def _at_softmax(gm) -> tuple[list[str], list[str]]:
    """The targets up to the softmax's amax (the stack and the scores), and those after it."""
    found = targets(gm)
    cut = found.index("aten.amax.default") + 1
    return found[:cut], found[cut:]


@pytest.mark.parametrize(("name", "dtype"), [("no_norm", torch.float32),
                                             ("bf16_scores", torch.bfloat16)])
def test_folded_scores_of_other_values_stay(name, dtype):
    """Scores of other values than the canonical ones (no norm; rounded in bf16 where the
    canonical forms do not): the whole mix is not taken and the scores stay as written; only
    the einsum weighted sum (a bmm) becomes the canonical fp32 sum."""
    fn = {"no_norm": _folded_no_norm, "bf16_scores": _folded_bf16_scores}[name]
    args = _folded_args(2, dtype)
    before, after, n = _rewrite(fn, *args)
    assert n == 1
    (scores, rest), (kept, new) = _at_softmax(before), _at_softmax(after)
    assert kept == scores and "aten.bmm.default" in rest and "aten.bmm.default" not in new
    assert new[-2:] == ["aten.mul.Tensor", "aten.sum.dim_IntList"]
    got, want = after(*args), before(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 1e-6  # the same fp32 sum, in another order


# ---- sources scored apart: one score chain per source, a sum of terms (spell12) -----------------


with torch.device("meta"):
    _SPELL12_MIX = AttnRes(D, EPS)  # weightless, as the model's skeleton


def _spell12(*args):
    """tests/models/spell12_k3.py's `AttnRes` as written (the model's own module, run by
    `functional_call` as the model runs it): each source scored by its own
    `vecdot(rms_normalize(v), w_norm * w_proj)`, the scores stacked on -1 and softmaxed, the mix
    a running Python sum `out = out + alpha[..., i, None] * v_i`."""
    *srcs, wn, wp = args
    weights = {"norm_weight": wn, "proj_weight": wp}
    return torch.func.functional_call(_SPELL12_MIX, weights, (tuple(srcs),))


def _normed(v):
    v = v.float()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)


def _reversed_loop(*args):
    """Scores stacked on dim 0 by `torch.stack`, the terms picked as `alpha[i]` and summed last
    source first by `sum()` over a list (its 0 start folded away by the trace)."""
    *srcs, wn, wp = args
    query = wn.float() * wp[0].float()
    scores = [(_normed(v) * query).sum(-1) for v in srcs]
    alpha = torch.stack(scores).softmax(0)
    terms = [alpha[i].unsqueeze(-1) * srcs[i].float() for i in reversed(range(len(srcs)))]
    return functools.reduce(torch.add, terms).to(srcs[-1].dtype)


def _sliced_terms(*args):
    """The scores cat'ed from [.., 1] pieces, the weights picked by `alpha[..., i:i + 1]` (a
    slice, no unsqueeze), the running sum starting from the prefix's term."""
    *srcs, wn, wp = args
    query = wn.float() * wp[0].float()
    parts = [torch.linalg.vecdot(_normed(v), query).unsqueeze(-1)
             for v in srcs]
    alpha = torch.cat(parts, -1).softmax(-1)
    out = alpha[..., -1:] * srcs[-1].float()
    for i in range(len(srcs) - 1):
        out = alpha[..., i:i + 1] * srcs[i].float() + out
    return out.to(srcs[-1].dtype)


def _python_sum(*args):
    """`sum()` of a generator of terms (its start 0 added first), the folded query in the
    sources' dtype: the form the look-alikes below depart from, one change each."""
    *srcs, wn, wp = args
    scores = [torch.linalg.vecdot(_normed(v), wn.float() * wp[0].float()) for v in srcs]
    alpha = torch.stack(scores, -1).softmax(-1)
    return sum(alpha[..., i, None] * v.float() for i, v in enumerate(srcs)).to(srcs[-1].dtype)


APART = {"spell12": _spell12, "reversed_loop": _reversed_loop, "sliced_terms": _sliced_terms,
         "python_sum": _python_sum}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(APART))
def test_sources_scored_apart_become_the_canonical_mix(name, dtype):
    """n score chains stacked and an n-term sum -> the whole canonical mix over the stacked
    sources: in fp32 the built-in form (fp32 rounding of the scores' fold and the sum's order:
    docs/decisions.md, session 33 mix12); in bf16 the fp32-scores form, which rounds where the
    spelling does (once, the fp32 sum to bf16): at most one bf16 rounding flip apart."""
    for n_blocks in (1, 3):
        args = _tokens(n_blocks, dtype)
        before, after, n = _rewrite(APART[name], *args)
        assert n == 1
        form = _canonical_targets if dtype == torch.float32 else _fp32_scores_targets
        assert targets(after) == form(args)
        got, want = after(*args), before(*args)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 2 ** -8)


def test_scores_apart_are_the_stacked_scores_bit_for_bit():
    """Why stacking is exact: a source's vecdot with the query is `sum(x * q, -1)`, the same
    reduction over D that the stacked scores run per row (measured: 0 ulps at D = 16 and 7168)."""
    g = torch.Generator().manual_seed(0)
    for width in (D, 7168):
        srcs, q = [torch.randn(B, 3, width, generator=g) for _ in range(4)], torch.randn(width)
        apart = torch.stack([torch.linalg.vecdot(v, q) for v in srcs], -1)
        assert torch.equal(apart, (torch.stack(srcs, -2) * q).sum(-1))


def _query_per_source(*args):
    """Each source scored against its own query (the last one doubled): not one pseudo-query."""
    *srcs, wn, wp = args
    query = wn * wp[0]
    scores = [torch.linalg.vecdot(_normed(v), query * (2.0 if i == len(srcs) - 1
                                                                   else 1.0))
              for i, v in enumerate(srcs)]
    alpha = torch.stack(scores, -1).softmax(-1)
    return sum(alpha[..., i, None] * v for i, v in enumerate(srcs))


def _own_weights(*args):
    """The first source scored with other weights (the norm weight squared): the same two
    weights, another query for one source (the check tells)."""
    *srcs, wn, wp = args
    scores = [torch.linalg.vecdot(_normed(v), (wn * wn if i == 0 else wn) * wp[0])
              for i, v in enumerate(srcs)]
    alpha = torch.stack(scores, -1).softmax(-1)
    return sum(alpha[..., i, None] * v for i, v in enumerate(srcs))


def _missing_term(*args):
    """The sum leaves out the last source's term."""
    *srcs, wn, wp = args
    scores = [torch.linalg.vecdot(_normed(v), wn * wp[0]) for v in srcs]
    alpha = torch.stack(scores, -1).softmax(-1)
    return sum(alpha[..., i, None] * v for i, v in enumerate(srcs[:-1]))


def _source_twice(*args):
    """The sum weighs the first source by the last weight too (the last source never summed)."""
    *srcs, wn, wp = args
    scores = [torch.linalg.vecdot(_normed(v), wn * wp[0]) for v in srcs]
    alpha = torch.stack(scores, -1).softmax(-1)
    return sum(alpha[..., i, None] * v for i, v in enumerate([*srcs[:-1], srcs[0]]))


def _swapped_terms(*args):
    """Each index's weight applied to another source (the first two swapped)."""
    *srcs, wn, wp = args
    scores = [torch.linalg.vecdot(_normed(v), wn * wp[0]) for v in srcs]
    alpha = torch.stack(scores, -1).softmax(-1)
    return sum(alpha[..., i, None] * v for i, v in enumerate([srcs[1], srcs[0], *srcs[2:]]))


def _weight_twice(*args):
    """One weight used for two terms (alpha[..., 0] for the first two sources)."""
    *srcs, wn, wp = args
    scores = [torch.linalg.vecdot(_normed(v), wn * wp[0]) for v in srcs]
    alpha = torch.stack(scores, -1).softmax(-1)
    return sum(alpha[..., max(i - 1, 0), None] * v for i, v in enumerate(srcs))


APART_LOOK_ALIKES = {"query_per_source": _query_per_source, "own_weights": _own_weights,
                     "missing_term": _missing_term, "source_twice": _source_twice,
                     "swapped_terms": _swapped_terms, "weight_twice": _weight_twice}


@pytest.mark.parametrize("name", sorted(APART_LOOK_ALIKES))
def test_scored_apart_look_alike_is_left_alone(name):
    _assert_left_alone(APART_LOOK_ALIKES[name], _tokens(2))
