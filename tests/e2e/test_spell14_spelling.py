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
its CPU reference returns [B, H, H·V], and the post-attention mix's `stack` raises. Until
session 39 the values and the plan below were measured with probe `uv` on (o_lat transposed to
[B, T, H, C] before the einsum; the same math). Since rule `causal_mask` (session 39) mla_decode
takes SDPA's site, W_UV's einsum reads the op's [B, T, H, C] output, and the spelling **as
written** fuses mla_uv_gate too: the common tests run it as written (fp32 and bf16 equal their
eager twin).

Plan (recorded, not wanted): per layer, the built-in plan's k3 ops this spelling's plan lacks,
EXACTLY (`LOST`, as written). fp32: none; bf16: none (since session 42). mla_decode had two
causes: one `input_pos` read by every layer, which rule `layer_positions` (session 37) copies per
layer, and the mask gathered from the `causal_mask` buffer, which rule `causal_mask` (session 39)
computes from the positions as k3compile/math.py does (probe `mask` writes that by hand).
fb_kda_decode (bf16, layers 0 and 1) had two: the conv output's one upcast before the cut
(`.transpose(1, 2).float().view(B, T, 3, H, K).unbind(2)`), which rule `cast_pieces` moves to
each piece, and the output gate's sigmoid on an upcast rounded back, which rule `sigmoid_round`
writes as the bf16 sigmoid (session 42); its bf16 conv + SiLU is kda_decode's `conv_rounded`.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TOL
from tests.models.spell14_k3 import from_builtin, state_of
from tests.spellings import foreign

EAGER_TOL = 1e-5  # measured 1.1e-6 (T = 1), 1.0e-6 (T = 3), states <= 8.2e-7 over 4 steps


_MLA = {"mla_decode": 1}
_LOST_FP32: dict[int, dict[str, int]] = {}
_LOST_BF16: dict[int, dict[str, int]] = {}
LOST = {torch.float32: _LOST_FP32, torch.bfloat16: _LOST_BF16}
# (pattern, dtype) whose loss comes with a near miss naming a node in every layer that lost it
DIAGNOSED = ()
_KDA = {"fb_kda_decode": 1}


foreign.define_common_tests(globals(), "spell14", from_builtin, state_of, lost_by_dtype=LOST,
                            eager_tol=EAGER_TOL, diagnosed=DIAGNOSED)


def test_spelled_as_is_loads_and_equals_it_eagerly():
    """Without the probe too (the spelling as written): the eager step is the built-in one."""
    foreign.assert_eager_equals_builtin(from_builtin, state_of, EAGER_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_heads_first_uv_einsum_compiles(dtype, reference_plan):
    """The spelling as written compiles and equals its eager twin. It crashed at first contact
    (a mis-fusion of mla_uv_gate, docs/spell14_spelling.md); from session 37 mla_uv_gate's check
    refused the heads-first o_lat, so W_UV's einsum stayed unfused; since session 39 mla_decode
    takes SDPA's site (rule `causal_mask`) and the einsum reads its [B, T, H, C] output: layers 2
    and 3 lose nothing."""
    err, state_err, compiled = foreign.run(dtype, from_builtin, state_of)
    tol = TOL["aten_cpu"] if dtype == torch.float32 else TOL["diffsuite_bf16"]
    assert err <= tol and max(state_err.values()) <= tol
    lost = foreign.lost(reference_plan, foreign.per_layer(compiled))
    for layer in (2, 3):
        assert layer not in lost, lost
    with_uv = foreign.lost(reference_plan, foreign.plan_with_rules_off(from_builtin, (), ("uv",)))
    assert with_uv == LOST[torch.float32], with_uv  # probe `uv` (the transposed o_lat): the same


@pytest.mark.slow
def test_causal_mask_rule_restores_mla_decode(reference_plan):
    """Rule `causal_mask` is what takes mla_decode's last escape: without it both MLA layers lose
    mla_decode to the mask gathered from the buffer (fp32, probe `uv` on; as written they then
    lose mla_uv_gate too, `test_heads_first_uv_einsum_compiles`' session-37 state)."""
    got = foreign.lost(reference_plan, foreign.plan_with_rules_off(from_builtin, ("causal_mask",),
                                                                   ("uv",)))
    assert got == {2: _MLA, 3: _MLA}, got


@pytest.mark.slow
@pytest.mark.parametrize("off", [(), ("layer_positions",)], ids=["rules", "no_layer_positions"])
def test_mask_probe_and_layer_positions_restore_mla_decode(off, reference_plan):
    """With probes `uv` and `mask` (the causal mask as `arange(L) <= input_pos`, not gathered from
    the `causal_mask` buffer) the whole built-in plan fuses, and rule `layer_positions` (one copy
    of the shared `input_pos` per MLA layer) is what takes mla_decode's last escape (fp32)."""
    got = foreign.lost(reference_plan, foreign.plan_with_rules_off(from_builtin, off, ("uv", "mask")))
    assert got == ({} if not off else {2: _MLA, 3: _MLA}), got


@pytest.mark.slow
@pytest.mark.parametrize("off,probes", [((), ()), (("cast_pieces",), ()), (("sigmoid_round",), ()),
                                        ((), ("cast",))],
                         ids=["rules", "no_cast_pieces", "no_sigmoid_round", "probe_cast"])
def test_cast_rules_restore_fb_kda_decode(off, probes, reference_plan):
    """bf16: rules `cast_pieces` (the conv output's upcast, before or after its transpose, moved
    to each piece of the q|k|v cut) and `sigmoid_round` (the output gate's sigmoid of an upcast,
    rounded back: the bf16 sigmoid) are what take fb_kda_decode's escapes in layers 0 and 1;
    with either off both layers lose it; probe `cast` (the upcast before the transpose) fuses
    too. The step equals its eager twin either way."""
    ref = foreign.builtin(torch.bfloat16)
    model, eager = (from_builtin(ref).set_probe(*probes) for _ in range(2))
    step = foreign.compile_k3(model, disabled_rules=off)
    assert foreign.steps(step, eager, n=1) <= TOL["diffsuite_bf16"]
    got = foreign.lost(reference_plan, foreign.per_layer(foreign.last_compiled()))
    assert got == ({} if not off else {0: _KDA, 1: _KDA}), got
