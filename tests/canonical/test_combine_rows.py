"""Rule `combine_rows` (expert_combine after token_rows) with `token_rows` keeping the experts'
view chains: a LatentMoE on [B, T, D] token tensors whose experts run on rows the spelling
flattens itself fuses into `k3.moe_experts` (T = 1, where the [B, 1, ...] chains read as tokens,
and T = 3), on two spellings: a hand-written one (einsum experts, the finalize an einsum over the
tokens) and spell9's own (`torch.vmap`ped experts, tests/models/spell9_k3.py). Look-alikes: an
AttnRes-like mix on tokens (a weighted sum of sources that are no experts' outputs) is left to
its own rule. Each rewritten graph is compared with the unrewritten one on the compile's inputs."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import moe_experts

from k3compile.math import e2m1_table, mxfp4_dequant, situ
from k3compile.models import mxfp4
from k3compile.rewrite import apply_patterns
from tests.canonical.compiled import assert_same_values, canonicalize, run
from tests.conftest import rel_err

B, D, E, K, L, I = 2, 64, 8, 2, 64, 32


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    w1 = mxfp4.random_mxfp4((E, I, L), L**-0.5, g)
    w3 = mxfp4.random_mxfp4((E, I, L), L**-0.5, g)
    w2 = mxfp4.random_mxfp4((E, L, I), I**-0.5, g)
    return {"router": w(E, D), "bias": 0.1 * torch.randn(E, generator=g), "down": w(L, D),
            "norm": 1 + 0.1 * torch.randn(L, generator=g), "up": w(D, L),
            "w1p": w1[0], "w1s": w1[1], "w3p": w3[0], "w3s": w3[1], "w2p": w2[0], "w2s": w2[1],
            "lut": e2m1_table()}


def moe_tokens(x, router, bias, down, norm, up, w1p, w1s, w3p, w3s, w2p, w2s, lut):
    """A LatentMoE on x [B, T, D]; the experts on the tokens flattened by the spelling
    (`z.reshape(-1, L)`), the finalize on the tokens again."""
    s = torch.einsum("btd,ed->bte", x, router).sigmoid()
    ids = (s + bias).topk(K, dim=-1).indices
    w = s.gather(-1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
    z = torch.einsum("btd,ld->btl", x, down)
    flat_z, flat_ids = z.reshape(-1, L), ids.reshape(-1, K)
    w1, w3, w2 = (mxfp4_dequant(p[flat_ids], s_[flat_ids], lut)
                  for p, s_ in ((w1p, w1s), (w3p, w3s), (w2p, w2s)))
    act = situ(torch.einsum("nl,nkil->nki", flat_z, w1), torch.einsum("nl,nkil->nki", flat_z, w3),
               4.0, 25.0)
    ys = torch.einsum("nki,nkli->nkl", act, w2).reshape(*ids.shape, L)
    u = torch.einsum("btk,btkl->btl", w, ys)
    u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    return x + torch.einsum("btl,dl->btd", u, up)


def _fused(fn, args: dict, module=None):
    """(canonicalized, its graph after the moe_experts patterns, their report)."""
    c = canonicalize(fn, args, module)
    gm = c.after
    gm.meta["real_inputs"] = c.inputs  # the E2M1 table's value, as stage fuse hands it over
    report = apply_patterns(gm.graph, moe_experts.patterns())
    gm.recompile()
    return c, gm, report


def _assert_fused(c, gm, report, want):
    assert c.counts["combine_rows"] == 1, c.counts
    assert [h.pattern.split("[")[0] for h in report.hits] == ["moe_experts"], report.hits
    assert_same_values(c, rel=1e-5)  # the rules: the finalize's sum in another order
    (got,) = run(gm, c.inputs)[:1]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("T", [1, 3])
def test_experts_on_flattened_tokens_fuse(T):
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(T))
    args = {"x": x, **_weights()}
    want = moe_tokens(*args.values())
    _assert_fused(*_fused(moe_tokens, args), want)


class _Spell9Moe(torch.nn.Module):
    """spell9's `moe_step` with layer 1's weights, on x [B, T, D] plus the residual; its dense
    kernels [out, in] (probe `linear`: stage kernel_layout, which re-lays the [in, out] ones at the
    first call, is not what this test is about)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        from tests.models import spell9_k3 as s9
        from tests.spellings import foreign

        spelled = s9.from_builtin(foreign.builtin(dtype)).set_probe("linear")
        self.s9, self.cfg, self.policy = s9, spelled.cfg, spelled.policy
        self.params = s9.ParamTree(s9.subtree(spelled.params.flat(), "layers.1.ffn"))

    def forward(self, x):
        self.s9._probes = frozenset({"linear"})
        return x + self.s9.moe_step(self.policy, self.cfg, self.params.flat(), x)


@pytest.mark.parametrize("T", [1, 3])
def test_spell9_vmapped_experts_fuse(T):
    model = _Spell9Moe()
    x = torch.randn(B, T, model.cfg.hidden_size, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        want = model(x)
    _assert_fused(*_fused(None, {"x": x}, model), want)


def _mix_tokens(x, sources, query):
    """AttnRes-like: softmax scores over S sources, their weighted sum on [B, T, ...] tokens
    (the finalize's shapes, sources that no expert computed)."""
    scores = torch.einsum("btsd,d->bts", sources, query).softmax(-1)
    return x + torch.einsum("bts,btsd->btd", scores, sources) @ torch.eye(D)


@pytest.mark.parametrize("T", [1, 3])
def test_a_mix_on_tokens_is_left_alone(T):
    g = torch.Generator().manual_seed(5)
    args = {"x": torch.randn(B, T, D, generator=g), "sources": torch.randn(B, T, 4, D, generator=g),
            "query": torch.randn(D, generator=g) * D**-0.5}
    c = canonicalize(_mix_tokens, args)
    assert c.counts["combine_rows"] == 0
    assert_same_values(c)
