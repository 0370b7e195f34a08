"""A twelfth spelling of K3 (`tests/models/spell12_k3.py`, written blind as a stateless
functional model: a weightless meta-device skeleton run by `torch.func.functional_call` over a
flat dict of weights, the states passed in and handed back, built out of place by `Tensor.put`
and copied into a cache object) under backend="k3": values hold; the plan loses nothing in
fp32 or bf16 (docs/spell12_spelling.md).

Values (these must pass): the spelling's eager step equals the built-in model's on the same state
dict (fp32, logits and every state, 4 steps, batch 2, one token and 3 verify rows); compiled
(executor aten, one static bucket) it equals its own eager copy in fp32 and in bf16.

Plan (recorded, not wanted): per layer, the k3 ops the built-in model's plan has that this
spelling's plan lacks are asserted EXACTLY (`LOST`, the same in fp32 and bf16). At first contact
no layer was found at all (Dynamo names a module under functional_call `getattr(net.layers,
'0')`: `rewrite.stack_path` reads it now); then rms_norm (0), norm_linear and moe_route (1-3)
were lost too: the RMSNorm through `vector_norm` (rule `norm_rms`) and the router's
`sort(descending)[:, :k]` (rule `sort_topk`) closed them (session 32); attn_res_mix_norm and
oproj_attn_res_mix_norm (every mix: each source scored by its own `vecdot`, the mix a running
Python sum) were lost in both dtypes until rule `depth_mix` read sources scored apart (session
33; probe `mix`, the sources stacked, now loses the same); mla_decode (2, 3), lost to the
attention's `baddbmm` of an additive 0 / -inf bias and the cache written by `Tensor.put`,
came back with rules `baddbmm_mask` and `put_rows` (session 33, both needed:
`test_mla_decode_needs_both_rules`). No probe restores anything now, so the probe test went
with session 33's closures.

linear_concat (0-3) and mla_lowrank_norm (2, 3) were lost to the merged projections
(`MergedLinear`: KDA q|k|v|g|f_a|b, MLA q_a|kv_a|g, gate|up) cut after one GEMM: rule
`proj_groups` makes them one GEMM per piece (probe `split_proj`'s form), MLA's kv_a
[latent | rope] kept one (session 33).
moe_experts (1-3) was lost too, to two idioms at once: the E2M1 values looked up by
`F.embedding` into a [16, 1] table (rule `table_lookup` makes it a gather, which rule
`mxfp4_dequant` then takes) and each token's experts picked from every dequantised expert by a
one-hot einsum (rule `expert_pick`: the dequant of the picked bytes; session 33).
fb_kda_decode (0, 1) was lost to five idioms at once; closed in fp32 (session 33) by rules
window_stack (the stacked conv windows), put_rows (`Tensor.put` row writes), norm_keepdim
(the vecdot l2 norm), token_unsqueeze (β unsqueezed before its token select) and
delta_chunk (the chunk-1 recurrence). bf16 (the conv window contracted in bf16, each product
rounded): closed in session 34 by kda_decode's `conv_products_rounded` (rule window_stack takes
bf16 windows, short_conv writes the canonical product sum).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.spell12_k3 import from_builtin, state_of
from tests.spellings import foreign

EAGER_TOL = 1e-5  # measured 1.2e-6 (T = 1), 1.1e-6 (T = 3), states <= 1.0e-6 over 4 steps

# layer -> the built-in plan's ops this spelling's plan lacks (a layer not named: none)
_LOST: dict[int, dict[str, int]] = {}
# bf16 KDA (the conv window contracted in bf16, each product rounded): kda_decode's
# conv_products_rounded (session 34; docs/spell12_spelling.md, cause 6)
LOST = {torch.float32: _LOST, torch.bfloat16: _LOST}
# (pattern, dtype) whose loss must come with a near miss in that layer naming a node: none left
DIAGNOSED = ()


foreign.define_common_tests(globals(), "spell12", from_builtin, state_of, lost_by_dtype=LOST,
                            eager_tol=EAGER_TOL, diagnosed=DIAGNOSED)


@pytest.mark.slow
@pytest.mark.parametrize("probe", ["rms", "topk", "mix", "experts", "split_proj", "window",
                                   "writes", "l2", "beta", "delta"])
def test_the_closed_gaps_stay_closed_with_their_idiom_probed_away(probe, reference_plan):
    """The idioms rules norm_rms (rms_norm, norm_linear), sort_topk (moe_route), depth_mix's
    sources scored apart (attn_res_mix_norm, oproj_attn_res_mix_norm), expert_pick
    (moe_experts: probe `experts` gathers after the dequant, the rule's other site),
    proj_groups (linear_concat, mla_lowrank_norm) and window_stack, put_rows,
    norm_keepdim, token_unsqueeze and delta_chunk (fb_kda_decode) take, switched to another
    spelling, lose exactly what the spelling as written loses (fp32): the rules leave no
    difference behind."""
    ref = foreign.builtin(torch.float32)
    model = from_builtin(ref).set_probe(probe)
    foreign.steps(foreign.compile_k3(from_builtin(ref).set_probe(probe)), model, n=1)
    got = foreign.lost(reference_plan, foreign.per_layer(foreign.last_compiled()))
    assert got == _LOST, (probe, got)


@pytest.mark.slow
@pytest.mark.parametrize("rules", [(), ("baddbmm_mask",), ("put_rows",)])
def test_mla_decode_needs_both_rules(rules):
    """spell12's MLA attention: mla_decode fuses in layers 2 and 3 with rules baddbmm_mask (the
    scores' baddbmm of a where(valid, 0, -inf) bias, alpha the scale) and put_rows (the cache
    written by `Tensor.put` at flat indices), and with either one off it is lost (fp32).
    put_rows also writes KDA's states (layers 0 and 1): off, fb_kda_decode is lost there too."""
    got = foreign.plan_with_rules_off(from_builtin, rules)
    for layer in (2, 3):
        assert got[layer]["mla_decode"] == (0 if rules else 1), (rules, layer, dict(got[layer]))
    for layer in (0, 1):
        want = 0 if "put_rows" in rules else 1
        assert got[layer]["fb_kda_decode"] == want, (rules, layer, dict(got[layer]))
