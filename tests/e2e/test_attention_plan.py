"""The attention half of the fusion plan on the tiny K3 end to end (backend="k3", executor aten):
decode (T = 1) and verify rows (T = 8) for several steps equal eager in the logits and in every
state (KDA recurrent and conv state, MLA latent cache); every layer holds exactly its template's
attention ops, and nothing of the attention is left to Inductor but the GEMMs the plan keeps
(MLA: g_proj; KDA's f_b and every o_proj are GEMM prologues of fused ops)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from k3compile.rewrite import module_path
from k3compile.stages.contract import PLANS
from tests.conftest import TOL, rel_err
from tests.fusions.attention_checks import one_thread  # noqa: F401

# two 4-layer compiles; the default run has test_backend's contract, diffsuite's bf16 T=8 cell
pytestmark = pytest.mark.slow

ATTENTION_OPS = ("rms_norm", "linear_concat", "kda_decode", "fb_kda_decode", "mla_lowrank_norm",
                 "mla_q_absorb", "mla_decode", "mla_uv_gate")
# relative error (max|a - b| / max|b|): bf16 within one ulp (it is exact today), fp32 as the
# backend tests allow
TOLERANCE = {torch.bfloat16: 2.0**-8, torch.float32: TOL["aten_cpu"]}
BATCH, STEPS = 2, 3
# The tiny model cut to 4 layers with MLA at 2 and 3: every template (dense, kda_moe, mla_moe,
# last) and two AttnRes blocks, at two thirds of the compile time
CFG = dataclasses.replace(get_config("tiny"), num_hidden_layers=4, full_attn_layers=(2, 3))


def _states(model):
    return {n: b for n, b in model.named_buffers() if b.dim() >= 3 and b.dtype != torch.uint8}


def _decode(dtype, schedule):
    """Eager and compiled copies of the tiny model stepped through `schedule` (tokens per step);
    returns the worst relative error of the logits, of each state, and the compiled graphs."""
    torch._dynamo.reset()
    cfg = CFG
    eager = build_model(cfg, dtype=dtype, max_batch=4, max_seq_len=64)
    model = build_model(cfg, dtype=dtype, max_batch=4, max_seq_len=64)
    compiled = torch.compile(model, backend="k3", fullgraph=True,
                             options={"executor": "aten", "keep_graphs": False})
    gen = torch.Generator().manual_seed(0)
    pos, logits_err, graphs = torch.zeros(BATCH, dtype=torch.long), 0.0, []
    slots = torch.tensor([2, 0])  # not 0..B-1: every op must follow `slots`
    for tokens in schedule:
        shape = (BATCH,) if tokens == 1 else (BATCH, tokens)
        ids = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        for t in (ids, pos, slots):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        logits_err = max(logits_err, rel_err(compiled(ids, pos, slots), eager(ids, pos, slots)))
        pos = pos + tokens
        graphs.append(k3be.last_compiled())
    want, got = _states(eager), _states(model)
    state_err = {name: rel_err(got[name], want[name]) for name in want}
    return logits_err, state_err, {id(c): c for c in graphs}.values()


@pytest.fixture(scope="module")
def bf16_run():
    return _decode(torch.bfloat16, [1] * STEPS + [8] * STEPS + [1])


def test_bf16_decode_and_verify_equal_eager(bf16_run):
    logits_err, state_err, _ = bf16_run
    assert logits_err <= TOLERANCE[torch.bfloat16], logits_err
    kinds = collections.Counter(name.rsplit(".", 1)[-1] for name in state_err)
    assert kinds == {"conv_state": 2, "recurrent_state": 2, "kv_cache": 2}
    for name, err in state_err.items():
        assert err <= TOLERANCE[torch.bfloat16], (name, err)


@pytest.mark.slow
def test_fp32_decode_equals_eager():
    logits_err, state_err, _ = _decode(torch.float32, [1, 1])
    assert logits_err <= TOLERANCE[torch.float32], logits_err
    for name, err in state_err.items():
        assert err <= TOLERANCE[torch.float32], (name, err)


def test_every_layer_holds_its_attention_plan(bf16_run):
    *_, compiled = bf16_run
    assert len(compiled) == 2  # one graph for T = 1, one for T = 8
    for c in compiled:
        for batch, report in c.contracts.items():
            assert {lr.template for lr in report.layers} == {"dense", "kda_moe", "mla_moe", "last", "final"}
            for lr in report.layers:
                want = {op: n for op, n in PLANS[lr.template].items() if op in ATTENTION_OPS}
                got = {op: n for op, n in lr.actual.items() if op in ATTENTION_OPS}
                assert got == want, (batch, lr.layer, lr.template, got)


def test_only_the_planned_gemms_are_left_of_the_attention(bf16_run):
    *_, compiled = bf16_run
    views = {"view", "permute", "split_with_sizes", "getitem", "unsqueeze", "reshape", "expand"}
    for c in compiled:
        for graph in c.observer.graphs.values():
            left = collections.defaultdict(collections.Counter)
            for node in graph.nodes:
                path = module_path(node)
                if node.op != "call_function" or ".self_attn" not in path:
                    continue
                name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
                if not str(node.target).startswith("k3.") and name not in views:
                    left[int(path.split("layers.")[1].split(".")[0])][name] += 1
            # KDA: f_b and o_proj are in the fused ops' prologues; MLA: g_proj joined q_a|kv_a
            assert not left, dict(left)
