"""T-less non-absorbed MLA (tests/canonical/mla_spellings.py `TokenlessMLA`: vLLM's flattened
[num_tokens, D] decode, x [B, D], the latent cache written at 1-D (slots, positions), K/V
up-projected from every cached latent, scores [B, H, L]; at B = 1 `cache[slots, pos] = rows`
writes rows viewed to [W]): rule token_dim lifts the write to
[B, 1, ...], rule mla_absorb then takes the site (its T-less output [B, H·V] read as the
canonical [B, 1, H·V] viewed back) and the MLA trio fuses. The lift alone is exact; the whole
rewrite equals the unrewritten graph to mla_absorb's rounding (fp32 1e-6, bf16 TOL["bfloat16"]),
and the spelling's eager values are our GatedMLA's at T = 1. Look-alikes (a sliding window, a
mask one key ahead, the scale on the nope term only, v from the cache read at other slots) are
lifted (exactly) but not absorbed."""

from __future__ import annotations

import pytest
import torch

import k3compile.backend as k3be
from k3compile.canonical import ORDER

from ..conftest import TOL, rel_err
from ..fusions.attention_checks import CFG, attention
from .compiled import assert_same_values, canonicalize
from .mla_spellings import TOKENLESS_LOOKALIKES, TOKENLESS_SPELLINGS, tokenless

ONLY_LIFT = {"disabled_rules": [r for r in ORDER if r not in ("token_dim", "state_write")]}
REWRITE_TOL = {torch.float32: 1e-6, torch.bfloat16: TOL["bfloat16"]}
MLA_OPS = ("mla_q_absorb", "mla_decode", "mla_uv_gate")


def _module(spelling, dtype):
    return tokenless(attention("mla", dtype).attn, CFG, spelling)


def _args(batch, dtype):
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(batch, CFG.hidden_size, generator=gen).to(dtype),
            "slots": torch.tensor([3, 0, 2][:batch]), "positions": torch.tensor([4, 9, 0][:batch])}


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", sorted(TOKENLESS_SPELLINGS))
def test_the_lift_alone_is_exact(name, batch):
    c = canonicalize(None, _args(batch, torch.float32),
                     module=_module(TOKENLESS_SPELLINGS[name], torch.float32), **ONLY_LIFT)
    assert c.counts["token_dim"] == 1
    assert_same_values(c, rel=0.0)


@pytest.mark.parametrize("dtype,batch", [(torch.float32, 2), (torch.bfloat16, 2),
                                         (torch.float32, 1)])
@pytest.mark.parametrize("name", sorted(TOKENLESS_SPELLINGS))
def test_tokenless_site_is_absorbed(name, dtype, batch):
    args = _args(batch, dtype)
    module = _module(TOKENLESS_SPELLINGS[name], dtype)
    ours = attention("mla", dtype)
    with torch.no_grad():  # the spelling is faithful: our model's values at T = 1
        want = ours(args["x"].unsqueeze(1), args["positions"], args["slots"]).squeeze(1)
    c = canonicalize(None, args, module=module)
    assert c.counts["token_dim"] == 1 and c.counts["mla_absorb"] == 1
    assert c.counts.get("mla_absorbed", 0) == 0
    assert_same_values(c, rel=REWRITE_TOL[dtype])
    assert c.output.dtype == want.dtype and c.output.shape == want.shape
    assert rel_err(c.output, want) <= REWRITE_TOL[dtype]


@pytest.mark.parametrize("name", sorted(TOKENLESS_LOOKALIKES))
def test_tokenless_lookalike_is_not_absorbed(name):
    c = canonicalize(None, _args(2, torch.float32),
                     module=_module(TOKENLESS_LOOKALIKES[name], torch.float32))
    assert c.counts["token_dim"] == 1  # the site was there to be taken
    assert c.counts.get("mla_absorb", 0) == 0 and c.counts.get("mla_absorbed", 0) == 0
    assert_same_values(c, rel=REWRITE_TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokenless_site_fuses_the_mla_trio(dtype):
    args = _args(2, dtype)
    module = _module(TOKENLESS_SPELLINGS["einsum"], dtype)
    with torch.no_grad():
        want = _module(TOKENLESS_SPELLINGS["einsum"], dtype)(*args.values())
    c = canonicalize(None, args, module=module, disabled_stages=[])
    (report,) = k3be.last_compiled().observer.reports.values()
    fused = {op.split("[")[0]: n for op, n in report.counts.items()}
    assert {op: fused.get(op) for op in MLA_OPS} == dict.fromkeys(MLA_OPS, 1)
    tol = TOL["aten_cpu"] if dtype == torch.float32 else TOL["bfloat16"]
    assert rel_err(c.output, want) <= tol
