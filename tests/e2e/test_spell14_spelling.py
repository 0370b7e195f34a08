"""A fourteenth spelling of K3 (`tests/models/spell14_k3.py`, written blind in the style of
pytorch-labs' gpt-fast: static caches as module buffers written by `index_copy_`, a bool
`causal_mask` buffer gathered at the positions, absorbed MLA through
`F.scaled_dot_product_attention`, the MoE as gpt-fast's `ConditionalFeedForward` gathering the
experts' packed bytes by index and contracting with `einsum`, MXFP4 scales by `torch.exp2`)
under backend="k3" (docs/spell14_spelling.md).

Values (these must pass): the spelling's eager step equals the built-in model's on the same state
dict (fp32, logits and every state, 4 steps, batch 2, one token and 3 verify rows).

First contact: the compiled step **crashes** at its first call, fp32 and bf16
(`test_heads_first_uv_einsum_compiles`; closed in session 37 by mla_uv_gate's check): pattern `mla_uv_gate` matches W_UV's
`einsum("bhtc,hdc->bthd", o_lat, w_uv)` on SDPA's heads-first output [B, H, 1, C] (the
matcher's `_same_permutation` lets a permute that moves only the size-1 T dim stand for the
pattern's), and binds o_lat to the [B, H, 1, C] tensor, which the op reads as [B, T, H, C]:
its CPU reference returns [B, H, H·V], and the post-attention mix's `stack` raises. So the
compiled-vs-eager values and the plan below are measured with probe `uv` on (o_lat transposed to
[B, T, H, C] before the einsum; the same math): fp32 and bf16 equal their eager twin.

Plan (recorded, not wanted): per layer, the built-in plan's k3 ops this spelling's plan lacks,
EXACTLY (`LOST`, probe `uv` on). fp32: mla_decode (2, 3) only; bf16 also fb_kda_decode (0, 1).
mla_decode's causes: the `causal_mask` buffer (probe `mask`) and one `input_pos` read by every
layer, which rule `layer_positions` (session 37) copies per layer: with probes `uv` + `mask` the
whole built-in plan fuses.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TOL
from tests.models.spell14_k3 import from_builtin, state_of
from tests.spellings import foreign

EAGER_TOL = 1e-5  # measured 1.1e-6 (T = 1), 1.0e-6 (T = 3), states <= 8.2e-7 over 4 steps


def from_builtin_uv(ref):
    """The spelling with probe `uv` (W_UV's einsum on [B, T, H, C]): what compiles today."""
    return from_builtin(ref).set_probe("uv")


_MLA = {"mla_decode": 1}
_LOST_FP32: dict[int, dict[str, int]] = {2: _MLA, 3: _MLA}
_LOST_BF16: dict[int, dict[str, int]] = {0: {"fb_kda_decode": 1}, 1: {"fb_kda_decode": 1},
                                         2: _MLA, 3: _MLA}
LOST = {torch.float32: _LOST_FP32, torch.bfloat16: _LOST_BF16}
# (pattern, dtype) whose loss comes with a near miss naming a node in every layer that lost it
DIAGNOSED = (("mla_decode", torch.float32), ("mla_decode", torch.bfloat16),
             ("kda_decode", torch.bfloat16))


foreign.define_common_tests(globals(), "spell14", from_builtin_uv, state_of, lost_by_dtype=LOST,
                            eager_tol=EAGER_TOL, diagnosed=DIAGNOSED)


def test_spelled_as_is_loads_and_equals_it_eagerly():
    """Without the probe too (the spelling as written): the eager step is the built-in one."""
    foreign.assert_eager_equals_builtin(from_builtin, state_of, EAGER_TOL)


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_heads_first_uv_einsum_compiles(dtype, reference_plan):
    """The spelling as written compiles and equals its eager twin. It crashed at first contact
    (a mis-fusion of mla_uv_gate, docs/spell14_spelling.md); since session 37 mla_uv_gate's
    check refuses the heads-first o_lat, so W_UV's einsum stays unfused in layers 2 and 3."""
    err, state_err, compiled = foreign.run(dtype, from_builtin, state_of)
    tol = TOL["aten_cpu"] if dtype == torch.float32 else TOL["diffsuite_bf16"]
    assert err <= tol and max(state_err.values()) <= tol
    lost = foreign.lost(reference_plan, foreign.per_layer(compiled))
    for layer in (2, 3):
        assert lost[layer] == {**LOST[dtype][layer], "mla_uv_gate": 1}, lost


@pytest.mark.slow
@pytest.mark.parametrize("off", [(), ("layer_positions",)], ids=["rules", "no_layer_positions"])
def test_mask_probe_and_layer_positions_restore_mla_decode(off, reference_plan):
    """With probes `uv` and `mask` (the causal mask as `arange(L) <= input_pos`, not gathered from
    the `causal_mask` buffer) the whole built-in plan fuses, and rule `layer_positions` (one copy
    of the shared `input_pos` per MLA layer) is what takes mla_decode's last escape (fp32)."""
    got = foreign.lost(reference_plan, foreign.plan_with_rules_off(from_builtin, off, ("uv", "mask")))
    assert got == ({} if not off else {2: _MLA, 3: _MLA}), got
