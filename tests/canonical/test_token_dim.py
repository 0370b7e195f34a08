"""Rule `token_dim`: attention written on [B, X] rows (no token dim, the red-team spelling's
`tests/models/redteam_k3.py` GatedMLA and KDA) is lifted to the [B, 1, X] form the attention
patterns are traced on. The lift alone is exact (the graph with only `token_dim` and
`state_write` computes the unrewritten graph's values bit for bit); with every rule the MLA and
KDA ops fuse as they do on the same code written with a T dim (probe `tokens`). Look-alikes (the
canonical [B, 1] write, a 1-D-indexed write whose cache is not read back, a state update with no
contraction) are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import k3compile.backend as k3be
from k3compile.canonical import ORDER
from k3compile.models import get_config
from tests.models.redteam_k3 import KDA, GatedMLA

from .compiled import assert_same_values, canonicalize

aten = torch.ops.aten
CFG = get_config("tiny")
ONLY_LIFT = {"disabled_rules": [r for r in ORDER if r not in ("token_dim", "state_write")]}
# the KDA idioms other than the rank that kda_decode needs the built-in model's spelling of
# (docs/redteam_spelling.md B.1-B.6, closed by other rules)
KDA_PROBES = ("q_scale", "sigmoid", "taps_cat", "o_view", "silu_first", "a_view")


def _module(cls, probes=(), seed=0):
    torch.manual_seed(seed)
    m = cls(CFG)
    m.setup_cache(5, 16, "cpu", torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for b in m.buffers():
            b.copy_(torch.randn_like(b))
    m.probe = frozenset(probes)
    return m.eval().requires_grad_(False)


def _args(batch):
    gen = torch.Generator().manual_seed(1)
    return {"x": torch.randn(batch, CFG.hidden_size, generator=gen),
            "slots": torch.tensor([3, 0, 2][:batch]), "positions": torch.tensor([4, 9, 0][:batch])}


def _fused(module, batch) -> dict[str, int]:
    canonicalize(None, _args(batch), module=module, disabled_stages=[])
    (report,) = k3be.last_compiled().observer.reports.values()
    return {op.split("[")[0]: n for op, n in report.counts.items()}


def _latent_write(gm):
    return next(n for n in gm.graph.nodes if n.target is aten.index_put.default
                and len(n.args[1]) == 2)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_mla_latent_write_gets_the_token_dim_exactly(batch):
    c = canonicalize(None, _args(batch), module=_module(GatedMLA), **ONLY_LIFT)
    assert c.counts["token_dim"] == 1
    slots, pos = _latent_write(c.after).args[1]
    assert [list(n.meta["val"].shape) for n in (slots, pos)] == [[batch, 1]] * 2
    rows = _latent_write(c.after).args[2].meta["val"]
    assert list(rows.shape) == ([batch, 1] if batch > 1 else []) + [CFG.kv_lora_rank
                                                                    + CFG.qk_rope_head_dim]
    assert_same_values(c, rel=0)


@pytest.mark.parametrize("batch", [1, 2])
def test_mla_fuses_without_a_token_dim(batch):
    c = canonicalize(None, _args(batch), module=_module(GatedMLA))
    assert c.counts["token_dim"] == 1 and c.counts["mla_absorbed"] == 1
    assert_same_values(c, rel=1e-5)  # mla_absorbed scales the scores in fp32 (its own rounding)
    fused = _fused(_module(GatedMLA), batch)
    assert {op: fused.get(op) for op in ("mla_q_absorb", "mla_decode", "mla_uv_gate")} == \
        dict.fromkeys(("mla_q_absorb", "mla_decode", "mla_uv_gate"), 1)


@pytest.mark.parametrize("batch", [1, 2])
def test_kda_recurrence_gets_the_token_dim_exactly(batch):
    c = canonicalize(None, _args(batch), module=_module(KDA, KDA_PROBES), **ONLY_LIFT)
    assert c.counts["token_dim"] >= 1
    selects = [n for n in c.after.graph.nodes if n.target is aten.select.int
               and n.args[1:] == (1, 0)]
    assert len(selects) >= 5  # q, k, v, decay, beta: one token of [B, 1, ...]
    assert_same_values(c, rel=0)


def test_kda_fuses_without_a_token_dim():
    fused = _fused(_module(KDA, KDA_PROBES), 2)
    assert fused.get("kda_decode") == 1 and fused.get("fb_kda_decode") == 1, fused  # f_b in it


@pytest.mark.parametrize("cls, probes", [(GatedMLA, ("tokens", "mla_idx")),
                                         (KDA, ("tokens", *KDA_PROBES))])
def test_the_token_form_is_left_alone(cls, probes):
    c = canonicalize(None, _args(2), module=_module(cls, probes), **ONLY_LIFT)
    assert c.counts["token_dim"] == 0


class Unread(nn.Module):
    """A [B]-indexed write of [B, W] rows into a [S, L, W] buffer that the step never reads back
    (a log, not a cache)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(5, 16, 8))

    def forward(self, x, slots, positions):
        self.buf.index_put_((slots, positions), x[:, :8])
        return x * 2


class Decayed(nn.Module):
    """A [S, H, K, V] state read at [slots], decayed, written back: no contraction, no output."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.ones(5, 2, 4, 4))

    def forward(self, x, slots, positions):
        new = self.state[slots] * torch.sigmoid(x[:, :8]).view(-1, 2, 4, 1)
        self.state.index_put_((slots,), new)
        return x + new.sum()


@pytest.mark.parametrize("cls", [Unread, Decayed])
def test_look_alikes_are_left_alone(cls):
    c = canonicalize(None, _args(2), module=cls(), **ONLY_LIFT)
    assert c.counts["token_dim"] == 0
    assert_same_values(c, rel=0)
