"""mla_decode: Gated MLA's latent-cache write and decode attention over the cache (T >= 1 rows per
request, causal inside them) as one op that writes the cache in place."""

from __future__ import annotations

import pytest
import torch
from k3compile.patterns import mla_decode

from k3compile.rewrite import apply_patterns

from .attention_checks import escape, family, one_thread, step_pair  # noqa: F401
from .pattern_checks import assert_near_miss, graph


@pytest.mark.parametrize("dtype,batch,tokens", [(torch.bfloat16, 2, 8), (torch.bfloat16, 1, 1),
                                                (torch.float32, 1, 8), (torch.float32, 3, 1)])
def test_model_block_rewrites_and_equals_eager(dtype, batch, tokens):
    want, got, s_want, s_got, report = step_pair("mla", dtype, batch, tokens, 3, "mla_decode")
    assert [h.op for h in report.hits] == ["k3.mla_decode"], report.hits
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(s_got["attn.kv_cache"], s_want["attn.kv_cache"], rtol=0, atol=0)


def _site(dtype=torch.bfloat16):
    variant = next(p for p in family("mla_decode") if p.name == "mla_decode[B=n,T=n,bfloat16]")
    args = variant.example_inputs()
    return [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]


def test_escaping_probabilities_is_a_near_miss():
    gm = graph(mla_decode.search, *_site(), joint=True)
    escape(gm, lambda n: n.target is torch.ops.aten.amax.default)  # the softmax max escapes
    report = apply_patterns(gm.graph, family("mla_decode"))
    assert_near_miss(report, "mla_decode", "users")


def test_check_refuses_float64():
    gm = graph(mla_decode.search, *_site(torch.float64), joint=True)
    report = apply_patterns(gm.graph, family("mla_decode"))
    assert_near_miss(report, "mla_decode", "check refused", "float64")
