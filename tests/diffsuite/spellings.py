"""The test spellings of K3 the differential suite runs, each built with identical weights twice.

A spelling is a function `build(config, dtype, group, max_batch, max_seq_len, seed) -> model`
whose model has the decode step's interface, `model(input_ids, positions, slots) -> logits`,
and keeps its decode state in module buffers indexed by slot (the last slot is the scratch slot
that padding rows use). Building twice with one seed gives two models with equal weights and
separately owned state: one is compiled, the other is the eager reference.

bf16 cells build well-conditioned weights (`condition_for_bf16`, on the built-in model before a
spelling converts it, as BENCHMARKS.md's bf16 correctness check does): the router bias alone
decides the top-k (a margin of 2 between experts, above any score difference), and the depth
mix's pseudo-queries are scaled by D^-1/2. Otherwise bf16 rounding noise flips near-tie top-k
choices and swings the near one-hot depth mix, after which a token's logits legitimately differ
by O(1) (measured: the hf spelling, T = 8, logits 1.1 and the MLA cache 0.58 relative after 30
steps), and no bound separates noise from a bug. fp32 cells keep the seeded weights as drawn.

Where a spelling cannot run a cell, `skip(world)` says why; the suite lists the cell as skipped
with that reason instead of leaving it out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from k3compile.models import build_model
from tests.models.hf_k3 import from_reference
from tests.models.k3_variant import SPELLINGS as VARIANT_SPELLINGS
from tests.models.k3_variant import to_variant


@dataclasses.dataclass(frozen=True)
class Spelling:
    name: str
    build: Callable | None
    no_tp: str | None = None  # why there is no tensor-parallel path (None: there is one)
    never: str | None = None  # why no cell of it runs at all

    def skip(self, world: int) -> str | None:
        if self.never:
            return self.never
        if world > 1 and self.no_tp:
            return self.no_tp
        return None


@torch.no_grad()
def condition_for_bf16(model, seed: int):
    """Routing fixed by the router bias with margins; depth-mix queries scaled by D^-1/2."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.copy_(2.0 * torch.randperm(p.numel(), generator=gen).to(p.dtype))
        elif "res_proj" in name:
            p.mul_(p.shape[-1] ** -0.5)
    return model


def _builtin(cfg, dtype, group, max_batch, max_seq_len, seed):
    model = build_model(cfg, dtype=dtype, group=group, max_batch=max_batch,
                        max_seq_len=max_seq_len, seed=seed)
    return condition_for_bf16(model, seed) if dtype == torch.bfloat16 else model


def _variant(cfg, dtype, group, max_batch, max_seq_len, seed):
    return to_variant(_builtin(cfg, dtype, group, max_batch, max_seq_len, seed), VARIANT_SPELLINGS)


def _hf(cfg, dtype, group, max_batch, max_seq_len, seed):
    return from_reference(_builtin(cfg, dtype, None, max_batch, max_seq_len, seed))


SPELLINGS: dict[str, Spelling] = {s.name: s for s in (
    Spelling("builtin", _builtin),
    Spelling("variant", _variant),  # tests/models/k3_variant.py, every spelling on
    Spelling("hf", _hf, no_tp="tests/models/hf_k3.py is written for TP = 1 (its KimiK3ForCausalLM "
                              "refuses tp_size != 1: no collectives, no sharded layers)"),
    Spelling("naive", None, never="tests/models/naive_k3.py is a float64 per-token oracle over a "
                                  "state dict (Python loops, int() reads, no module state): not a "
                                  "torch.compile target; tests/models/test_faithfulness.py checks "
                                  "the built-in model against it"),
)}


def state_buffers(model, slots: int) -> dict[str, torch.Tensor]:
    """The decode state: buffers with one row per slot (scratch included) and at least 3 dims."""
    return {n: b for n, b in model.named_buffers() if b.dim() >= 3 and b.shape[0] == slots}


@torch.no_grad()
def reset_slot(model, slots: int, slot: int) -> None:
    """What a server does before a new request takes a slot: its state rows to zero."""
    for buf in state_buffers(model, slots).values():
        buf[slot].zero_()
