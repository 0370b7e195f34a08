"""The test spellings of K3 the differential suite runs, each built with identical weights twice.

A spelling is a function `build(config, dtype, group, max_batch, max_seq_len, seed) -> model`
whose model has the decode step's interface, `model(input_ids, positions, slots) -> logits`,
and keeps its decode state in module buffers indexed by slot (the last slot is the scratch slot
that padding rows use). Building twice with one seed gives two models with equal weights and
separately owned state: one is compiled, the other is the eager reference.

bf16 cells fix the routing (`condition_for_bf16`, on the built-in model before a spelling
converts it, as BENCHMARKS.md's bf16 correctness check does): the router bias alone decides the
top-k (a margin of 2 between experts, above any score difference). Otherwise bf16 rounding noise
flips near-tie top-k choices, after which a token's logits legitimately differ by O(1), and no
bound separates noise from a bug. fp32 cells keep the seeded weights as drawn.

The seeded depth-mix pseudo-queries have std D^-1/2 (like every linear; Moonshot's init draws
0.02 at D = 7168), so the mix's scores are O(1). Drawn with std 1 (before 2026-12-02) the scores
had std ~D^1/2 and the near-tie mixes amplified rounding: a 2^-24 relative change of the
embedding moved the logits by 9.4e-5 after 48 steps (fp32 eager itself was 9.6e-5 from the
float64 oracle `tests/models/naive_k3.py` there), which the fp32 cells read as compiled-vs-eager
spikes over 1e-4; with D^-1/2 no layer's 2^-24 moves them by more than 6.4e-7 (tests/conftest.py
TOL["aten_cpu"] has the error model).

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
    """Routing fixed by the router bias with margins."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.copy_(2.0 * torch.randperm(p.numel(), generator=gen).to(p.dtype))
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
