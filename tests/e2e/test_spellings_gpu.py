"""Every foreign spelling on a GPU at one TP16 rank's shapes, as a user would compile it.

The spellings' own tests run the tiny config on the CPU, where every fused op runs its torch
reference, and the tiny widths are ones the kernels refuse (spell9's KDA step, session 29). Here
each spelling (tests/models/<name>_k3.py, loaded from the built-in model's state dict) runs at
the TP16 rank's per-layer widths (KDA 6 heads x 128, MLA 6 heads, experts 192 wide: the
narrower model of tests/e2e/test_hf_spelling.py, four layers covering every template) under
`torch.compile(backend="k3")` with the backend's default options (Inductor executor, CUDA
graphs), bucket 2, and three decode steps are compared with its eager twin on the same GPU:
logits and every state.

What each run fused, deferred (left to Inductor on this device, with the reason) and sent to a
torch reference at call time is written to `$SPELLINGS_GPU_OUT/<name>_<dtype>.json` when that
variable is set (the device call's record; not asserted yet: session 36 takes the first
record, docs/decisions.md "Session 36, lead")."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os

import pytest
import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err
from tests.diffsuite.spellings import condition_for_bf16
from tests.spellings import foreign

SPELLINGS = ("builtin", "spell5", "spell6", "spell7", "spell8", "spell9", "spell10", "spell11", "spell12",
             "spell13", "spell14",
             "redteam")

# One TP16 rank of K3 as a one-rank model (the spellings are written for one rank): K3's hidden
# and latent widths, KDA and MLA 96 / 16 = 6 heads, experts 3072 / 16 = 192 wide (the shared
# experts 2 x 192); fewer experts (64, top 8), a small vocabulary and dense MLP, and four layers
# as the spellings' tiny CFG: 0 dense KDA, 1 KDA + MoE, 2 MLA + MoE, 3 the last (MLA + MoE).
# The sizes stay apart as K3's do (rule expert_slots refuses a slot whose sizes collide: a
# latent of 512 has L / 32 = 16, the E2M1 table's length).
TP16 = dataclasses.replace(
    get_config("k3"), vocab_size=1024, intermediate_size=2048, num_experts=64,
    num_experts_per_token=8, moe_intermediate_size=3072 // 16, kda_num_heads=96 // 16,
    num_attention_heads=96 // 16, num_hidden_layers=4, full_attn_layers=(2, 3), name="tp16_rank")
# Spellings that cannot take `mark_batch` (the README's one Dynamo graph for every batch): each
# steps with its batch static instead (Dynamo then compiles the bucket's batch as it comes).
STATIC_BATCH = {
    # torch.vmap over the batch: functorch's matmul batching rule guards on the batched
    # strides, `Eq(Max(1, u0), 1)`, a data-dependent guard on the unbacked batch (torch 2.13)
    "spell9": "vmap over an unbacked batch fails Dynamo's trace",
    # its self-dot `einsum("...d,...d->...", x, x)` over [T, B, D]: torch's einsum asks
    # `are_strides_like_channels_last`, `Eq(u0, 1)` on the unbacked batch (torch 2.13, session 37)
    "spell13": "einsum over an unbacked batch fails Dynamo's trace",
}
# ... and on CUDA only: F.scaled_dot_product_attention with an attn_mask guards `Eq(u0, 1)` on the
# unbacked batch while Dynamo traces it (torch 2.11 on the H100, session 40; their CPU runs trace)
STATIC_BATCH_CUDA = {
    "spell6": "masked SDPA over an unbacked batch fails Dynamo's trace on CUDA",
    "spell11": "masked SDPA over an unbacked batch fails Dynamo's trace on CUDA",
    "spell14": "masked SDPA over an unbacked batch fails Dynamo's trace on CUDA",
}
TOLS = {torch.float32: TOL["aten_cpu"], torch.bfloat16: TOL["diffsuite_bf16"]}
# What a spelling's GPU run leaves to Inductor (`deferred`) and to torch at call time
# (`fallbacks`), where a run has shown it (bf16, H100: spell10 and the red-team spelling in
# session 39, which closed their moe_experts deferral and norm_linear[weight_fp32] fallback; the
# others in session 40). mla_q_absorb's CUDA kernel is opt-in. spell9 falls back at call time:
# an fp32 x reaching the rms_norm kernel (rms_norm; which site, not traced); in the first step
# only, before the first call re-lays its weights and the step compiles again, its KDA conv taps
# (kda_decode: Flax's [K, 1, C] kernels read as [C, 1, K], strides (1, C, C); contiguous from the
# second compile on, CPU, session 40); and its router and latent-down weights not in one buffer
# (gemv_split: two launches; 6 calls in 3 steps, not traced further). A spelling not listed is
# not checked yet.
GPU_GAPS = {(name, torch.bfloat16): ({"mla_q_absorb"}, set())
            for name in ("builtin", "spell5", "spell7", "spell8", "spell10", "spell12", "spell13",
                         "redteam")}
GPU_GAPS["spell9", torch.bfloat16] = ({"mla_q_absorb"}, {"gemv_split", "rms_norm", "kda_decode"})
# the static-batch three (session 41, H100): spell14 as the built-in; spell6 an fp32 x into the
# rms_norm kernel twice a step; spell11 in bf16 without K3_WEIGHT_CAST (fp32 master weights: its
# mix-norm weight fp32, so attn_res_mix_norm is deferred, and 16 fp32 x's into rms_norm a step)
GPU_GAPS["spell14", torch.bfloat16] = ({"mla_q_absorb"}, set())
GPU_GAPS["spell6", torch.bfloat16] = ({"mla_q_absorb"}, {"rms_norm"})
GPU_GAPS["spell11", torch.bfloat16] = ({"mla_q_absorb", "attn_res_mix_norm"}, {"rms_norm"})
STEPS = 3
META = torch.device("meta")


@torch.no_grad()
def pair(name: str, dtype: torch.dtype, device: str, cfg=TP16):
    """(model, eager twin) of spelling `name`, both loaded from one built-in model, on `device`."""
    def builtin():
        model = build_model(cfg, dtype=dtype, max_batch=4, max_seq_len=64, seed=0)
        model = condition_for_bf16(model, 0) if dtype == torch.bfloat16 else model
        return model.to(device)

    if name == "builtin":
        return [builtin() for _ in range(2)], foreign.builtin_states
    spelling = importlib.import_module(f"tests.models.{name}_k3")
    ref = builtin()
    where = next(ref.parameters()).device
    # Most spellings build themselves on the default device and load the built-in's state dict
    # (so their weights and state buffers land on the CPU), as a user's model is built before
    # `.to(device)`; moved here as a user would move it. spell12's layer modules are a weightless
    # skeleton on the meta device, which stays there (the first H100 run, session 38: seven
    # spellings stopped at an assertion that they had built on the source's device)
    models = [spelling.from_builtin(ref)._apply(lambda t: t if t.device == META else t.to(where))
              for _ in range(2)]
    return models, spelling.state_of


def run(name: str, dtype: torch.dtype, device: str, cfg=TP16) -> dict:
    """Compile spelling `name` with the backend's defaults (bucket 2), step it against its eager
    twin; the errors, the plan per layer, the deferred ops and the call-time fallbacks."""
    from k3compile.kernels.common.dsl import fallback_counts, reset_fallback_counts

    (model, eager), state_of = pair(name, dtype, device, cfg)
    torch._dynamo.reset()
    reset_fallback_counts()
    step = torch.compile(model, backend="k3", fullgraph=True, options={"buckets": (2,)})
    gen = torch.Generator().manual_seed(0)
    pos, slots, err = torch.tensor([0, 5]), torch.tensor([2, 0]), 0.0
    with torch.no_grad():
        for _ in range(STEPS):
            ids = torch.randint(0, cfg.vocab_size, (2,), generator=gen)
            args = [t.to(device) for t in (ids, pos, slots)]
            if name not in STATIC_BATCH and not (device == "cuda" and name in STATIC_BATCH_CUDA):
                k3be.mark_batch(*args)
            got, want = step(*args), eager(*args)
            assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
            err = max(err, rel_err(got.float().cpu(), want.float().cpu()))
            pos = pos + 1
    want, got = state_of(eager), state_of(model)
    compiled = k3be.last_compiled()
    (report,) = compiled.observer.reports.values()
    return {
        "spelling": name, "dtype": str(dtype).removeprefix("torch."), "device": device,
        "logits_err": err,
        "state_err": {n: rel_err(got[n].float().cpu(), want[n].float().cpu()) for n in want},
        "plan": {layer: dict(ops) for layer, ops in foreign.per_layer(compiled).items()},
        "deferred": dict(report.deferred),
        "fallbacks": {f"{op}: {why}": n for (op, why), n in fallback_counts().items()},
    }


def record(result: dict) -> None:
    out = os.environ.get("SPELLINGS_GPU_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"{result['spelling']}_{result['dtype']}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", SPELLINGS)
def test_spelling_at_tp16_shapes_equals_its_eager_on_a_gpu(name, dtype):
    result = run(name, dtype, "cuda")
    record(result)
    tol = TOLS[dtype]
    assert result["logits_err"] <= tol, result["logits_err"]
    assert all(e <= tol for e in result["state_err"].values()), result["state_err"]
    assert result["plan"], "nothing fused"
    if (name, dtype) in GPU_GAPS:
        deferred, fallbacks = GPU_GAPS[name, dtype]
        assert set(result["deferred"]) == deferred, result["deferred"]
        assert {f.split(":")[0] for f in result["fallbacks"]} == fallbacks, result["fallbacks"]


@pytest.mark.slow
def test_mark_batch_gives_one_symbol_where_two_batches_meet():
    """CPU, the tiny config: spell11's SDPA meets the queries' batch (from the ids) and the cache
    rows' (from `slots`); with a symbol per input, Dynamo's trace failed on `Eq(u2, u1)` under
    `mark_batch` (session 36). The step now traces as one graph and equals its eager twin."""
    result = run("spell11", torch.float32, "cpu", cfg=foreign.CFG)
    assert result["logits_err"] <= TOL["aten_cpu"], result["logits_err"]
    assert all(e <= TOL["aten_cpu"] for e in result["state_err"].values()), result["state_err"]
