"""Rule verify_rows: absorbed MLA on a serving engine's flat tokens with T > 1 verify rows (each
token's slot from a slot mapping, its own flat position, the cache read per token) is viewed back
to [B, T]; compiled with the rules it equals its eager self (cache bit for bit) and, with the MLA
patterns on, gets our model's MLA ops. Look-alikes (tokens in time-major order, each token
reading another request's block, one row per request) are left alone by this rule. Under the
backend spell7 at T = 3 gets the trio (tests/e2e/test_spell7_spelling.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from k3compile.patterns import ORDER as PATTERNS

from k3compile.models.k3 import GatedMLA

from ..conftest import TOL, rel_err
from ..fusions.attention_checks import CFG, Attention, attention, one_thread  # noqa: F401
from .test_mla_absorb import MLA_OPS, REWRITE_TOL, eager, run


def _mapping(slots, positions, T, order):
    B = slots.shape[0]
    steps = torch.arange(T)
    if order == "tokens_major":  # vLLM's: request b's T tokens one after the other
        return (slots.unsqueeze(1).expand(B, T).reshape(-1),
                (positions.unsqueeze(1) + steps).reshape(-1))
    if order == "flatten":  # the same order, spelled with flatten
        return slots[:, None].expand(B, T).flatten(), (positions[:, None] + steps).flatten()
    # look-alike: time-major tokens (token t of every request, then t + 1)
    return slots.repeat(T), (positions.unsqueeze(0) + steps.unsqueeze(1)).reshape(-1)


class FlatMLA(GatedMLA):
    """GatedMLA's weights and cache, absorbed attention on N = B·T flat tokens (spell7's
    spelling): the cache written at (slot mapping, flat positions), read per token."""

    def __init__(self, config, layer_idx, order="tokens_major", read_flipped=False):
        super().__init__(config, layer_idx)
        self.order, self.read_flipped = order, read_flipped

    def forward(self, x, slots, positions, group=None):
        B, T, _ = x.shape
        H, N, R, V, C = self.num_heads, self.nope, self.rope, self.v_dim, self.kv_lora_rank
        tokens = x.transpose(0, 1) if self.order == "time_major" else x
        xf = tokens.reshape(B * T, -1)
        mapping, pos = _mapping(slots, positions, T, self.order)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(xf))).view(B * T, H, N + R)
        c_kv, k_pe = self.kv_a_proj_with_mqa(xf).split([C, R], -1)
        self.kv_cache[mapping, pos] = torch.cat([self.kv_a_layernorm(c_kv), k_pe], -1)
        rows = self.kv_cache[mapping.flip(0) if self.read_flipped else mapping]  # [N, L, C + R]
        w_uk, w_uv = self.kv_b_proj.weight.view(H, N + V, C).split([N, V], 1)
        q_lat = torch.einsum("nhd,hdc->nhc", q[..., :N], w_uk)
        scores = torch.einsum("nhw,nlw->nhl", torch.cat([q_lat, q[..., N:]], -1), rows)
        scores = scores.float() * self.softmax_scale
        future = torch.arange(rows.shape[1]).unsqueeze(0) > pos.unsqueeze(1)
        p = scores.masked_fill(future.unsqueeze(1), float("-inf")).softmax(-1).to(x.dtype)
        o = torch.einsum("nhl,nlc->nhc", p, rows[..., :C])
        o = torch.einsum("nhc,hvc->nhv", o, w_uv).reshape(B * T, H * V)
        out = self.o_proj(o * torch.sigmoid(self.g_proj(xf))).view(tokens.shape)
        return out.transpose(0, 1) if self.order == "time_major" else out


def flat(dtype, **kw) -> Attention:
    reference = attention("mla", dtype).attn
    m = FlatMLA(CFG, reference.layer_idx, **kw)
    m.load_state_dict(reference.state_dict())
    m = m.to(dtype).requires_grad_(False)
    m.register_buffer("kv_cache", reference.kv_cache.clone(), persistent=False)
    return Attention(m)


def _compiled_equals_eager(module, dtype, batch, tokens, **options):
    want, want_cache = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, cache, _, counts, report = run(module, dtype, batch, tokens, **options)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert rel_err(g, w) <= REWRITE_TOL[dtype]
    torch.testing.assert_close(cache["attn.kv_cache"], want_cache["attn.kv_cache"], rtol=0, atol=0)
    return counts, report


@pytest.mark.parametrize("dtype,batch", [(torch.float32, 2), (torch.float32, 1),
                                         (torch.bfloat16, 2)])
@pytest.mark.parametrize("order", ["tokens_major", "flatten"])
def test_flat_verify_rows_are_viewed_back_to_requests(order, dtype, batch):
    module = flat(dtype, order=order)
    counts, _ = _compiled_equals_eager(module, dtype, batch, 3, disabled_stages=["fuse"])
    assert counts["mla_absorbed"] == 1 and counts["verify_rows"] == 1


@pytest.mark.parametrize("kw,tokens", [({"order": "time_major"}, 3), ({"read_flipped": True}, 3),
                                       ({}, 1)])
def test_look_alike_is_left_alone(kw, tokens):
    dtype = torch.float32
    counts, _ = _compiled_equals_eager(flat(dtype, **kw), dtype, 2, tokens,
                                       disabled_stages=["fuse"])
    assert counts.get("verify_rows", 0) == 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_verify_rows_get_our_mla_ops(dtype):
    batch, tokens = 2, 3
    only_mla = {"disabled_patterns": [p for p in PATTERNS if not p.startswith("mla_")]}
    module = flat(dtype)
    want, want_cache = eager(copy.deepcopy(module), dtype, batch, tokens)
    got, cache, _, _, report = run(module, dtype, batch, tokens, **only_mla)
    _, _, _, _, canonical = run(attention("mla", dtype), dtype, batch, tokens, **only_mla)
    fused = sorted(h.op for h in report.hits)
    assert fused == sorted(h.op for h in canonical.hits)
    assert {f"k3.{op}" for op in MLA_OPS} <= set(fused)
    tol = TOL["aten_cpu"] if dtype == torch.float32 else TOL["bfloat16"]
    for g, w in zip(got, want):
        assert rel_err(g, w) <= tol
    torch.testing.assert_close(cache["attn.kv_cache"], want_cache["attn.kv_cache"], rtol=0, atol=0)
