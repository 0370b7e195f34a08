"""token_rows: an FFN written on [B, T, D] token tensors (T = 1 for one token, T = 3 verify rows)
becomes the same FFN on [B*T, D] rows, bit for bit, with its output viewed back to [B, T, D].

Positives, two spellings of a LatentMoE FFN (router, top-k, renormalised weights, a dense loop
over experts, the latent RMSNorm and up-projection, the shared experts) and a dense SiTU FFN:
spell8's own modules (tests/models/spell8_k3.py: `einsum("...d,od->...o")`, `F.one_hot`
routing, MXFP4 experts) and one written here on `h[:, None]` with `einsum("btd,ed->bte")`, masks
`ids == e` and weights handed in as inputs. Look-alikes left alone: a sum over T inside the FFN,
a conv window over the tokens inside it, attention reading a cache at `slots`, an FFN whose
output is summed over T after it, one whose hidden value is also returned, one mixing the rows
in a GEMM (`W @ x`)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from k3compile.canonical import token_rows
from k3compile.models import get_config
from tests.canonical.rule_checks import assert_same, rewrite, targets
from tests.conftest import rel_err
from tests.models import spell8_k3

_rewrite = functools.partial(rewrite, token_rows)
B, D, E, K, Z, I = 2, 64, 8, 2, 32, 32


def _g(seed):
    return torch.Generator().manual_seed(seed)


# ---- spelling 2: [B, D] rows lifted to [B, 1, D] by `h[:, None]`, einsum "btd,ed->bte" ---

def _weights(seed=0):
    g = _g(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    return {"router": w(E, D), "bias": 0.1 * torch.randn(E, generator=g), "down": w(Z, D),
            "w1": w(E, I, Z), "w3": w(E, I, Z), "w2": w(E, Z, I),
            "norm": 1 + 0.1 * torch.randn(Z, generator=g), "up": w(D, Z), "sg": w(I, D),
            "su": w(I, D), "sd": w(D, I)}


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _moe_tokens(x, router, bias, down, w1, w3, w2, norm, up, sg, su, sd):
    """A LatentMoE on x [B, T, D]."""
    s = torch.einsum("btd,ed->bte", x.float(), router.float()).sigmoid()
    ids = (s + bias).topk(K, dim=-1).indices
    w = s.gather(-1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
    z = torch.einsum("btd,ld->btl", x, down)
    acc = torch.zeros_like(z)
    for e in range(E):
        chosen = (w * (ids == e)).sum(-1, keepdim=True).to(x.dtype)
        a = F.silu(torch.einsum("btl,il->bti", z, w1[e])) * torch.einsum("btl,il->bti", z, w3[e])
        acc = acc + chosen * torch.einsum("bti,li->btl", a, w2[e])
    routed = torch.einsum("btl,dl->btd", _rms(acc.float(), norm.float()).to(x.dtype), up)
    shared = torch.einsum("bti,di->btd", F.silu(torch.einsum("btd,id->bti", x, sg))
                          * torch.einsum("btd,id->bti", x, su), sd)
    return routed + shared


def _routing_einsum(x, router, bias, w1, w2):
    """A dense [B, T, E] routing matrix as one small matmul per token (batched over the rows),
    then experts weighted by its columns."""
    s = torch.einsum("btd,ed->bte", x, router).sigmoid()
    top = (s + bias).topk(K, dim=-1)
    w = s.gather(-1, top.indices)
    routing = torch.einsum("btk,btke->bte", w, F.one_hot(top.indices, E).to(x.dtype))
    out = torch.zeros_like(x)
    for e in range(E):
        h = F.silu(torch.einsum("btd,id->bti", x, w1[e]))
        out = out + routing[..., e:e + 1] * torch.einsum("bti,di->btd", h, w2[e])
    return out


def _moe_unsqueezed(h, *weights):  # h [B, D]: one token per request
    return _moe_tokens(h[:, None], *weights)


def _moe_rows_of(x, *weights):  # x [B, T, D] (verify rows)
    return _moe_tokens(x, *weights)


# ---- spelling 1: spell8's modules ---------------------------------------------------------

@functools.cache
def _spell8_cfg():
    return dataclasses.replace(get_config("tiny"), num_hidden_layers=2)


def _spell8_moe(seed=0):
    torch.manual_seed(seed)
    moe = spell8_k3.LatentMoE(_spell8_cfg())
    for name, p in moe.named_parameters():
        p.data = torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1) + (
            1.0 if "norm" in name else 0.0)
    for name, b in moe.named_buffers():
        if b.dtype == torch.uint8:
            hi = 256 if name.endswith("_packed") else 130
            b.copy_(torch.randint(0 if hi == 256 else 122, hi, b.shape, dtype=torch.uint8))
    return moe


def _spell8_dense(seed=0):
    torch.manual_seed(seed)
    ffn = spell8_k3.DenseFFN(_spell8_cfg(), 64)
    for p in ffn.parameters():
        p.data = torch.randn_like(p) * p.shape[-1] ** -0.5
    return ffn


def _as_fn(module):
    """(fn(x, *weights), weights): the module with its parameters and buffers as inputs."""
    named = dict(module.named_parameters()) | dict(module.named_buffers())

    def fn(x, *tensors):
        return torch.func.functional_call(module, dict(zip(named, tensors, strict=True)), (x,))

    return fn, [t.detach() for t in named.values()]


def _tokens(T, d, seed=1, dtype=torch.float32):
    return torch.randn(B, T, d, generator=_g(seed)).to(dtype)


def _close_to_eager(gm, fn, args):
    """The graph against the function run eagerly (einsum's own kernels: not bit for bit)."""
    for got, want in zip(pytree.tree_leaves(gm(*args)), pytree.tree_leaves(fn(*args)), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got, want) <= (2e-2 if want.dtype == torch.bfloat16 else 1e-5)


def _rank3_compute(gm, T):
    """The non-view ops whose value still has the token dims [B, T, ...] (a bmm batched over
    the rows keeps its [B*T, M, N], which at T = 1 reads as [B, 1, N])."""
    skip = token_rows.VIEWS | {torch.ops.aten.bmm.default}
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target not in skip
            and isinstance(v := n.meta.get("val"), torch.Tensor) and v.dim() >= 3
            and tuple(v.shape[:2]) == (B, T)]


def _positive(fn, args, T, sites=1):
    before, after, n = _rewrite(fn, *args)
    assert n == sites
    assert_same(after(*args), before(*args))
    _close_to_eager(after, fn, args)
    assert _rank3_compute(before, T)
    assert _rank3_compute(after, T) == []  # every op of the FFN on rows
    return after


@pytest.mark.parametrize("T", [1, 3])
def test_spell8_latent_moe_goes_to_rows(T):
    fn, weights = _as_fn(_spell8_moe())
    after = _positive(fn, [_tokens(T, _spell8_cfg().hidden_size), *weights], T)
    ops = targets(after)
    assert "aten.topk.default" in ops and "aten.sigmoid.default" in ops


@pytest.mark.parametrize("T", [1, 3])
def test_spell8_dense_ffn_goes_to_rows(T):
    fn, weights = _as_fn(_spell8_dense())
    _positive(fn, [_tokens(T, _spell8_cfg().hidden_size), *weights], T)


def test_unsqueezed_moe_goes_to_rows():
    w = _weights()
    h = torch.randn(B, D, generator=_g(3))
    after = _positive(_moe_unsqueezed, [h, *w.values()], 1)
    # the router's sigmoid reads the router GEMM itself, on [B, E] rows (moe_front / moe_route)
    (sig,) = [n for n in after.graph.nodes if n.target == torch.ops.aten.sigmoid.default]
    assert tuple(sig.meta["val"].shape) == (B, E)


@pytest.mark.parametrize("T", [1, 3])
def test_token_tensor_moe_goes_to_rows(T):
    _positive(_moe_rows_of, [_tokens(T, D), *_weights().values()], T)


@pytest.mark.parametrize("T", [1, 3])
def test_routing_matmul_per_token_goes_to_rows(T):
    w = _weights()
    args = [_tokens(T, D), w["router"], w["bias"], torch.randn(E, I, D, generator=_g(4)) * 0.1,
            torch.randn(E, D, I, generator=_g(5)) * 0.1]
    _positive(_routing_einsum, args, T)


def test_bf16_moe_goes_to_rows():
    w = {k: v.bfloat16() for k, v in _weights().items()}
    w["bias"] = w["bias"].float()
    _positive(_moe_rows_of, [_tokens(1, D, dtype=torch.bfloat16), *w.values()], 1)


def _ffn_chunked(x, w13, wd):
    """gate|up as one GEMM cut by `chunk` (hf_k3's shared expert): a tuple-valued node in the
    region, which has no tensor shape (the rule raised a TypeError on it before session 24's fix)."""
    g, u = F.linear(x, w13).chunk(2, -1)
    return F.linear(F.silu(g) * u, wd)


def _moe_flat_experts(x, router, bias, down, w1, w3, w2, norm, up, sg, su, sd, *, roll=False):
    """spell9's LatentMoE on x [B, T, D]: the experts on tokens the spelling flattens itself
    (`z.reshape(-1, Z)`, `ids.reshape(-1, K)`), gathered by the routed ids, one expert for one
    token `torch.vmap`ped over the slots and the tokens. `roll`: a look-alike whose experts read
    the previous token's latent (rows mixed)."""
    s = torch.einsum("btd,ed->bte", x.float(), router.float()).sigmoid()
    ids = (s + bias).topk(K, dim=-1).indices
    w = s.gather(-1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
    z = torch.einsum("btd,ld->btl", x, down)
    flat_z, flat_ids = z.reshape(-1, Z), ids.reshape(-1, K)
    if roll:
        flat_z = torch.roll(flat_z, 1, 0)

    def expert(a, b, c, t):
        return c @ (F.silu(a @ t) * (b @ t))

    ys = torch.vmap(torch.vmap(expert, in_dims=(0, 0, 0, None)))(w1[flat_ids], w3[flat_ids],
                                                                  w2[flat_ids], flat_z)
    acc = torch.einsum("...k,...kd->...d", w, ys.reshape(*ids.shape, -1))
    routed = torch.einsum("btl,dl->btd", _rms(acc.float(), norm.float()).to(x.dtype), up)
    shared = torch.einsum("bti,di->btd", F.silu(torch.einsum("btd,id->bti", x, sg))
                          * torch.einsum("btd,id->bti", x, su), sd)
    return routed + shared


@pytest.mark.parametrize("T", [1, 3])
def test_moe_with_experts_on_its_own_flat_rows_goes_to_rows(T):
    """spell9: the experts' gathers by the routed ids and per-expert bmm's read values already
    on rows; they are kept as written (session 25), the rest goes to rows."""
    def fn(x, *weights):
        return _moe_flat_experts(x, *weights)

    _positive(fn, [_tokens(T, D), *_weights().values()], T)


@pytest.mark.parametrize("T", [1, 3])
def test_flat_experts_reading_another_row_are_left_alone(T):
    args = [_tokens(T, D), *_weights().values()]
    def fn(x, *weights):
        return _moe_flat_experts(x, *weights, roll=True)

    _, _, n = _rewrite(fn, *args)
    assert n == 0


@pytest.mark.parametrize("T", [1, 3])
def test_a_chunked_gate_up_goes_to_rows(T):
    g = _g(8)
    args = [_tokens(T, D), torch.randn(2 * I, D, generator=g) * 0.1,
            torch.randn(D, I, generator=g) * 0.1]
    _positive(_ffn_chunked, args, T)


# ---- look-alikes ---------------------------------------------------------------------------------

def _ffn(x, wg, wd):
    return torch.einsum("bti,di->btd", F.silu(torch.einsum("btd,id->bti", x, wg)), wd)


def _sum_over_t_inside(x, wg, wd):
    h = F.silu(torch.einsum("btd,id->bti", x, wg))
    h = h.cumsum(1)  # each token reads the ones before it
    return torch.einsum("bti,di->btd", h, wd)


def _conv_over_t_inside(x, wg, wd, wc):
    h = F.silu(torch.einsum("btd,id->bti", x, wg))  # [B, T, I]
    c = F.conv1d(F.pad(h.transpose(1, 2), (2, 0)), wc, groups=wc.shape[0])  # window over T
    return torch.einsum("bti,di->btd", c.transpose(1, 2), wd)


def _attention_like(x, wg, wd, cache, slots):
    q = torch.einsum("btd,id->bti", x, wg)
    kv = cache[slots]  # [B, L, I], read at the requests' slots
    p = torch.softmax(torch.einsum("bti,bli->btl", q, kv), dim=-1)
    return torch.einsum("bti,di->btd", torch.einsum("btl,bli->bti", p, kv), wd)


def _summed_after(x, wg, wd):
    return _ffn(x, wg, wd).sum(1, keepdim=True)


def _hidden_escapes(x, wg, wd):
    h = F.silu(torch.einsum("btd,id->bti", x, wg))
    return torch.einsum("bti,di->btd", h, wd), h


def _rows_mixed(x, wg, wd, wt):
    h = F.silu(torch.einsum("btd,id->bti", x, wg))
    mixed = torch.einsum("cb,bti->cti", wt, h)  # a weight over the batch rows
    return torch.einsum("bti,di->btd", mixed, wd)


def _lookalike_args(name, T):
    g = _g(7)
    x, wg, wd = (torch.randn(B, T, D, generator=g), torch.randn(I, D, generator=g) * 0.1,
                 torch.randn(D, I, generator=g) * 0.1)
    extra = {"conv": [torch.randn(I, 1, 3, generator=g)],
             "attention": [torch.randn(4, 5, I, generator=g), torch.tensor([2, 0])],
             "rows_mixed": [torch.randn(B, B, generator=g)]}.get(name, [])
    return [x, wg, wd, *extra]


LOOKALIKES = {"cumsum_over_t": _sum_over_t_inside, "conv": _conv_over_t_inside,
              "attention": _attention_like, "summed_after": _summed_after,
              "hidden_escapes": _hidden_escapes, "rows_mixed": _rows_mixed}


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("name", sorted(LOOKALIKES))
def test_lookalikes_are_left_alone(name, T):
    fn, args = LOOKALIKES[name], _lookalike_args(name, T)
    before, after, n = _rewrite(fn, *args)
    assert n == 0, name
    assert targets(after) == targets(before)
    _close_to_eager(after, fn, args)


def test_the_plain_ffn_of_the_lookalikes_is_taken():
    """The look-alikes' FFN itself (the control): taken, T = 1 and 3."""
    for T in (1, 3):
        _positive(_ffn, _lookalike_args("plain", T), T)
