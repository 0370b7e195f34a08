"""A ninth spelling of K3 (`tests/models/spell9_k3.py`, a JAX/Flax port written blind from the
spec) under backend="k3": values hold; almost nothing fuses (docs/spell9_spelling.md).

Values (these must pass): the spelling's eager step equals the built-in model's on the same state
dict (fp32, logits and every state, several steps, batch 2, one token and 3 verify rows);
compiled (executor aten, one static bucket) it equals its own eager copy in fp32 and in bf16.

Plan (recorded, not wanted). A functional port runs every layer in its one top module
(`nn_module_stack` holds no `layers.N`), so the contract reads each node's layer off the weights
it reads (`k3compile.layers.attribute`: the earliest layer whose inputs it or anything computed
from it reads; the params are `params.layers.N...`); the layers then read as the built-in
model's templates. `LOST` is, per layer, what the built-in model's plan (fp32) has that this
one lacks, EXACTLY, so that a rule closing a gap (or a change opening one) fails here.
`PROBED` names the idioms (`Spell9K3.set_probe`) that bring ops back when switched to another
spelling of the same math, and what is lost then: the causes. Whole-graph counts are in
docs/spell9_spelling.md.

* the Flax kernels [in, out] applied as `x @ kernel` (probe `linear`) -- closed by stage
  `kernel_layout` (session 25): each is re-laid once as the `.t()` of a contiguous [out, in]
  buffer and read as it; linear, linear_concat, situ_gate_up, mla_lowrank_norm fuse now, and
  with the other probes on the graph fuses as with probe `linear` (which `PROBED` no longer
  needs). bf16 kept two linear_concat and mla_lowrank_norm lost (the MLA norm in bf16) until
  session 26 (below).
* moe_experts: the FFN on [B, 1, D] (probe `ffn_flat`). Session 25 (helper experts): the
  `torch.vmap` over slots and tokens no longer blocks it (rule `expert_gemm` reads FC2 back
  through vmap's `squeeze.dims`; probe `einsum_experts` not needed), and rule `token_rows`
  takes the [B, 1, D] MoE although its experts run on rows the spelling flattened itself, which
  brings back moe_front, moe_route, norm_linear and the shared stream without `ffn_flat`.
  Session 26 (helper moe9): closed -- token_rows keeps the experts' view chains and bmm's as
  written where they read rows the spelling flattened itself (they had been composed into one
  view each, which the pattern does not match), and rule `combine_rows` (expert_combine after
  token_rows) takes the finalize token_rows put on rows; probe `ffn_flat` is no longer needed.
  bf16 (session 27, helper bf16kda9): the experts' output was cast to fp32 before the view
  dropping its size-1 dim (the pattern casts after it) -- closed by rule `cast_squeeze`.
* mla_q_absorb, mla_decode, mla_uv_gate: the functional cache (the requests' whole block
  gathered, the new rows `index_put` out of place, the block written back after the step) --
  closed by rule `cache_block` (probe `cache_inplace` no longer needed; the trio is still lost
  here for the `[in, out]` kernels: with probe `linear` alone it fuses).
* rms_norm, mla_lowrank_norm, norm_linear: `mean(x * x)` -- closed by rule `square` (probe
  `pow` no longer needed). moe_route: `take_along_dim` -- closed by rule `take_along` (probe
  `gather` no longer needed).
* attn_res_mix_norm: the AttnRes bank written by out-of-place `index_copy` at a literal index,
  which rule depth_mix did not read as a bank write -- closed in fp32 by rule `index_slice`
  (session 25); oproj_attn_res_mix_norm then fuses with probe `linear`. In bf16 the mixes became
  canonical but stayed unfused: the norm after each mix multiplies its scale in fp32 before the
  one cast. Closed in session 26 (helper bf16norm) by op variants that keep that rounding:
  attn_res_mix_norm / oproj_attn_res_mix_norm `norm_weight_fp32=True` and mla_lowrank_norm
  `weight_fp32=True` (linear_concat's MLA forms then take the flagged call). On GPU graphs those
  variants stay with Inductor until their builds pass GPU tests.
* fb_kda_decode: the short conv for one token inside the scanned KDA cell (`einsum("bkc,kc->bc",
  cat(window, x_t), taps)`, the taps a cat of the Flax conv kernels' slices) -- closed in fp32
  by rules `cell_conv` (the canonical time-major conv, its weight the kernels' [C, 1, taps]
  views) and `token_select` (the token selected after the feature math) (session 26, helper
  kda9); the vmapped delta rule needed nothing more. bf16: closed in session 27 (helper
  bf16kda9) by kda_decode's `norm_weight_fp32` (spell9's output norm: o kept fp32, the scale
  multiplied in fp32 before the one cast, the gate in bf16) and `conv_rounded` (the conv
  rounded to bf16 before its SiLU) flags, cell_conv taking the bf16 bmm as a bf16 conv. On GPU
  graphs that variant stays with Inductor until its build passes its GPU tests. The op gets the
  conv weights as `permute(kernel, [2, 1, 0])` of the Flax kernels, which stage conv_layout
  re-lays at the first call so that they reach it contiguous, as its CUDA kernel wants (session
  27, helper relay).
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from k3compile.tools import diff
from tests.conftest import TOL, rel_err
from tests.models.spell9_k3 import from_builtin, state_of
from tests.spellings import foreign
from tests.spellings.foreign import builtin as _builtin
from tests.spellings.foreign import compile_k3 as _compile
from tests.spellings.foreign import steps as _steps

CFG_K128 = dataclasses.replace(foreign.CFG, kda_head_dim=128)  # the KDA kernel's head dim
EAGER_TOL = 1e-5  # measured 3.1e-6 (logits, T = 1), 2.8e-6 (T = 3), states <= 1.9e-6 over 4 steps

# the built-in plan's ops per layer (layer 0 dense, 1 kda_moe, 2 mla_moe, 3 last; -1 the model's
# final mix + norm and lm_head)
_GEMMS = {"linear_concat": 1, "oproj_attn_res_mix_norm": 1, "situ_gate_up": 1, "linear": 1}
_MOE = {"moe_front": 1, "moe_route": 1, "moe_experts": 1, "norm_linear": 1, "stream_fork": 1,
        "stream_join": 1}
_MLA = {"mla_lowrank_norm": 1, "mla_q_absorb": 1, "mla_decode": 1, "mla_uv_gate": 1}
_MIX = {"attn_res_mix_norm": 1}
_EVERY = {0: {**_GEMMS, "fb_kda_decode": 1}, 1: {**_MIX, **_GEMMS, "fb_kda_decode": 1, **_MOE},
          2: {**_MIX, **_GEMMS, **_MLA, **_MOE}, 3: {**_MIX, **_GEMMS, **_MLA, **_MOE},
          -1: {**_MIX, "linear": 1}}
# layer -> the built-in plan's ops this spelling's plan lacks (session 25, all five helpers'
# changes merged; session 26: helper kda9's rules cell_conv and token_select fuse the KDA step in
# fp32, helper moe9's token_rows change and rule combine_rows the routed experts on [B, 1, D],
# helper bf16norm's norm_weight_fp32 / weight_fp32 variants the bf16 mixes, o_proj + mix and the
# MLA norms (the scale multiplied in fp32 before the cast), the MLA layers' linear_concat after
# them): fp32 loses nothing; session 27: nor does bf16 (its KDA step fuses with kda_decode's
# conv_rounded / norm_weight_fp32 variant, cell_conv taking the bf16 conv; its experts with
# moe_experts' fp32_out variant once rule cast_squeeze puts their upcast after the squeeze)
LOST = {
    torch.float32: {},
    torch.bfloat16: {},
}
TEMPLATES = {0: "dense", 1: "kda_moe", 2: "mla_moe", 3: "last", -1: "final"}

# the probes that bring most of the plan back, and what is lost then (fp32)
PROBED = (("ffn_flat",), {})


def diff_model():
    """`python -m k3compile.diff --model tests.e2e.test_spell9_spelling:diff_model`: the spelling
    loaded from the 4-layer tiny built-in model (fp32), one step of batch 2."""
    ids = torch.randint(0, foreign.CFG.vocab_size, (2,), generator=torch.Generator().manual_seed(0))
    return from_builtin(_builtin(torch.float32)), (ids, torch.tensor([0, 5]), torch.tensor([2, 0]))


foreign.define_common_tests(globals(), "spell9", from_builtin, state_of, lost_by_dtype=LOST,
                            eager_tol=EAGER_TOL)


@pytest.mark.parametrize("rows", [0, 3])
def test_probes_keep_the_math(rows):
    ref = _builtin(torch.float32)
    spelled = from_builtin(ref).set_probe(*PROBED[0], "cache_inplace", "einsum_kda", "gather",
                                          "pow")
    assert _steps(spelled, ref, n=2, rows=rows) <= EAGER_TOL


@pytest.mark.slow
@pytest.mark.parametrize("run", ["spell9_fp32", "spell9_bf16"])
def test_the_contract_reads_the_builtin_templates(run, request):
    """Every layer found by the weights it reads (the module paths name none)."""
    compiled = request.getfixturevalue(run)[2]
    (report,) = compiled.contracts.values()
    assert {lr.layer: lr.template for lr in report.layers} == TEMPLATES


@pytest.mark.slow
def test_probes_name_the_causes(reference_plan):
    probes, lost = PROBED
    builtin = _builtin(torch.float32)
    model = from_builtin(builtin).set_probe(*probes)
    eager = from_builtin(builtin).set_probe(*probes)
    assert _steps(_compile(model), eager, n=1) <= TOL["aten_cpu"]
    assert foreign.lost(reference_plan, foreign.per_layer(foreign.last_compiled())) == lost


@pytest.mark.slow
def test_the_diff_tool_shows_its_layers():
    """`k3compile diff --model ...:diff_model`: a row per layer, its fused ops the contract's."""
    report = diff.run(model=f"{__name__}:diff_model")
    (bucket,) = report.buckets
    (contract,) = foreign.last_compiled().contracts.values()
    rows = {**bucket.layers, -1: bucket.outside}
    assert set(bucket.layers) == {0, 1, 2, 3}
    for lr in contract.layers:
        assert +rows[lr.layer].fused == +lr.actual, lr.layer
        assert rows[lr.layer].contract_template == lr.template == TEMPLATES[lr.layer]


KDA_OPS = ("kda_decode", "fb_kda_decode")


def conv_weights(compiled) -> list:
    """The conv weight arguments the compiled graph hands its KDA ops, one list per op."""
    (graph,) = compiled.observer.graphs.values()
    found = []
    for op in KDA_OPS:
        for node in graph.find_nodes(op="call_function", target=getattr(torch.ops.k3, op).default):
            names = [a.name for a in node.target._schema.arguments]
            found.append([node.args[names.index(f"{x}_conv_weight")] for x in "qkv"])
    return found


def assert_conv_weights_contiguous(compiled) -> None:
    """Each KDA layer's op gets its three conv weights as `permute(kernel, [2, 1, 0])` of the Flax
    kernels [taps, 1, C], contiguous: stage conv_layout re-laid the kernels at the first call
    and the step was compiled again on them (the kda_decode kernel wants contiguous [C, 1, taps];
    kda9's GPU finding, session 26)."""
    ops = conv_weights(compiled)
    assert len(ops) == 2, "one KDA op per KDA layer"
    for weights in ops:
        for w in weights:
            kernel = w.args[0]
            assert w.target is torch.ops.aten.permute.default and list(w.args[1]) == [2, 1, 0]
            assert kernel.op == "placeholder" and kernel.meta["val"].shape[1] == 1
            assert w.meta["val"].is_contiguous(), (w.name, w.meta["val"].stride())


@pytest.mark.slow
def test_the_kda_op_gets_the_flax_conv_kernels_contiguous(spell9_fp32):
    """Values: `test_compiled_equals_its_eager` (the same compile)."""
    assert_conv_weights_contiguous(spell9_fp32[2])


@pytest.mark.gpu
def test_cuda_graph_plans_as_the_cpu_one(reference_plan):
    """As spell6's (session 26): on CUDA, fp32, the plan loses the CPU's LOST and beyond it only
    ops deferred for want of a CUDA kernel; values as eager; the KDA ops get contiguous conv
    weights there too."""
    foreign.assert_cuda_plans_as_the_cpu_one(from_builtin, LOST[torch.float32], reference_plan)
    assert_conv_weights_contiguous(foreign.last_compiled())


@pytest.mark.gpu
def test_cuda_kda_kernel_takes_the_conv_weights():
    """bf16 on CUDA: where the plan has the KDA step, its kernel runs: no reference fallback for
    the KDA ops (kda9's finding: it refused the Flax kernels' strided views, session 26). At
    K3's KDA head dim 128 (`CFG_K128`): the tiny config's 64 is one the kernel refuses, as the
    first GPU run of this test found (session 29)."""
    from k3compile.kernels.common.dsl import fallback_counts, reset_fallback_counts

    reset_fallback_counts()
    err, compiled = foreign.run_on_cuda(torch.bfloat16, from_builtin, CFG_K128)
    assert err <= TOL["diffsuite_bf16"], err
    assert conv_weights(compiled), "spell9 bf16 lost its KDA step on CUDA"
    assert_conv_weights_contiguous(compiled)
    refused = {k: n for k, n in fallback_counts().items() if k[0] in KDA_OPS}
    # the first call runs the graph compiled before stage conv_layout re-laid the Flax kernels,
    # on their old (strided) layout (session 28's fix), which the kernel refuses: one reference
    # call per KDA layer (H100, session 29), then the kernel on every later step
    layers = len(conv_weights(compiled))
    first = {k: n for k, n in refused.items() if "conv_weight" in k[1] and n <= layers}
    assert refused == first, refused


MLA_OPS = {"mla_q_absorb": 2, "mla_decode": 2, "mla_uv_gate": 2}


@pytest.mark.slow
@pytest.mark.parametrize("rows", [0, 3])
def test_the_functional_cache_gets_the_mla_ops(rows):
    """Rule `cache_block`: the functional cache block (no probe `cache_inplace`) gets the MLA
    trio in both MLA layers, at one token and 3 verify rows, and the step and the caches equal
    the eager step. Probe `linear` is on: the `[in, out]` kernels block every GEMM fusion,
    mla_q_absorb's q_b GEMM and mla_absorbed's kv_b weight included (helper kernelio's gap)."""
    builtin = _builtin(torch.float32)
    model = from_builtin(builtin).set_probe("linear")
    eager = from_builtin(builtin).set_probe("linear")
    assert _steps(_compile(model), eager, n=2, rows=rows) <= TOL["aten_cpu"]
    got = sum(foreign.per_layer(foreign.last_compiled()).values(), collections.Counter())
    assert {op: got.get(op, 0) for op in MLA_OPS} == MLA_OPS
    want, have = state_of(eager), state_of(model)
    for name in want:
        assert rel_err(have[name], want[name]) <= TOL["aten_cpu"], name


class _MixNorm(torch.nn.Module):
    """spell9's own `mix_norm` (its bank, mix and Flax-style norm: the scale multiplied in fp32
    before the one cast) over a bank of two blocks, bf16."""

    def __init__(self, d=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.scale = torch.nn.Parameter((1 + 0.1 * torch.randn(d, generator=g)).bfloat16())
        self.res = torch.nn.ParameterDict({
            "norm_scale": (1 + 0.1 * torch.randn(d, generator=g)).bfloat16(),
            "query_kernel": (torch.randn(d, 1, generator=g) / d**0.5).bfloat16()})

    def forward(self, prefix, b0, b1):
        from tests.models.spell9_k3 import Policy, bank_set, mix_norm

        bank = prefix.new_zeros((*prefix.shape[:-1], 8, prefix.shape[-1]))
        bank = bank_set(bank_set(bank, 0, b0), 1, b1)  # the model's out-of-place bank writes
        p = {"norm.scale": self.res["norm_scale"], "query.kernel": self.res["query_kernel"]}
        return mix_norm(Policy(torch.bfloat16), p, prefix, bank, 2, self.scale, 1e-5)


@pytest.mark.slow
def test_bf16_mix_norm_fuses_with_its_rounding(monkeypatch):
    """spell9's mix + norm in bf16 fuses as attn_res_mix_norm with norm_weight_fp32 (the scale
    multiplied in fp32 before the cast, as the spelling rounds), close to its eager step; the op
    with the built-in rounding would differ from eager in many elements."""
    from tests.fusions.attention_checks import compile_with
    from tests.models import spell9_k3

    # no probe (the model's forward sets them for its step; an earlier test's may be left)
    monkeypatch.setattr(spell9_k3, "_probes", frozenset())
    torch._dynamo.reset()
    model = _MixNorm().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    acts = [torch.randn(3, 1, 64, generator=g).bfloat16() for _ in range(3)]
    got = compile_with(model, "attn_res_mix_norm")(*acts)
    (report,) = foreign.last_compiled().observer.reports.values()
    assert [h.pattern for h in report.hits] == [
        "attn_res_mix_norm[blocks=2,no_delta,scores_fp32,norm_weight_fp32]"]
    want = model(*acts)
    assert got.dtype == want.dtype == torch.bfloat16
    prefix, b0, b1 = acts
    wmn, wmp = model.res["norm_scale"], model.res["query_kernel"].t()
    flagged, plain = (torch.ops.k3.attn_res_mix_norm(prefix, None, [b0, b1], wmn, wmp, model.scale,
                                                     1e-5, 1e-5, True, fp32_weight)[1]
                      for fp32_weight in (True, False))
    assert torch.equal(got, flagged)
    off, off_plain = ((x != want).float().mean().item() for x in (got, plain))
    assert off <= 0.01 and off_plain >= 0.1, (off, off_plain)
