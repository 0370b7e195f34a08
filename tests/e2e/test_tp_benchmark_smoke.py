"""benchmarks/tp_decode.py: its smoke mode as it runs on the GPU host, through torchrun, with 2
gloo processes on CPU (tiny config, k3 on the "aten" executor; B=2 with the check's references
called a row at a time, as a GPU does where a whole call would not fit), checked against the
ranks' equality, the decode_layer correctness check and the byte model worked out by hand from the
tiny config; and its row chunking and rank merging in process."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from k3compile.models import get_config
from tests.conftest import ROOT, load_benchmark

SCRIPT = ROOT / "benchmarks" / "tp_decode.py"
WORLD = 2


bench = load_benchmark("tp_decode")


def _descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc: each thread's children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            found += kids
            todo += kids
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL the launcher, its process group and every process below it. torchrun's ranks run
    in sessions of their own, so the group kill alone missed them, and a rank left stuck in a
    collective held the pipes open: `communicate()` then waited forever and hung the slow run
    (session 29, with other pytests on the two cores)."""
    victims = _descendants(pid)  # before the kill: orphans are reparented out of reach
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for p in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_decode")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", str(SCRIPT), "--smoke", "--device", "cpu",
           "--k3-executor", "aten", "--batches", "2", "--reference-rows", "1", "--out", str(out),
           "--timeout-s", "120"]  # a rank failing alone: an error in the JSON, not a hang
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # its own process group: a timeout kills the ranks too, not just the launcher (a rank left
    # stuck in a collective outlived the test once, 2026-12-05, beside later gloo tests)
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:  # a rank stuck in a collective: show where
            _kill_tree(proc.pid)
            stdout, stderr = proc.communicate()
            pytest.fail(f"tp_decode smoke timed out:\n{stdout}\n{stderr}"[-6000:])
    assert proc.returncode == 0, (stdout + stderr)[-6000:]
    return json.loads((out / "tp_decode.json").read_text()), stdout


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow  # torchrun, 2 processes compiling (the default run: test_benchmark_smoke)
def test_smoke_runs_every_variant_equal_on_every_rank(smoke):
    data, stdout = smoke
    meta = data["meta"]
    assert (meta["config"], meta["world"], meta["backend"]) == ("tiny_tp2", WORLD, "gloo")
    assert meta["env"] == bench.COLLECTIVE_ENV
    # the cross-rank comparison sees a difference where there is one: each rank's own slice
    weights = meta["rank_max_abs_diff_weights"]
    assert weights["o_proj (split)"] > 0 and weights["router (replicated)"] == 0
    assert [b["name"] for b in data["buckets"]] == ["B2"] and not data["skipped"]
    tiny = get_config("tiny")
    (b,) = data["buckets"]
    assert b["reference_rows"] == {"bf16": 1, "fp32": 1}  # two calls each, regrouped
    assert b["check_routing_distinct_experts"] == [tiny.num_experts_per_token] * 4
    for name in bench.VARIANTS:
        v = b["variants"][name]
        assert v["status"] == "ok", (name, v)
        assert v["rank_max_abs_diff"] == 0.0 and v["ranks_equal"], (name, v)
        assert v["check_passed_ranks"] == [True] * WORLD
        c = v["check"]
        assert c["passed"] and c["max_err"] <= c["tol_max_err"]
        assert {p.split(".")[-1] for p in c["parts"]} == {
            "prefix", "delta", "conv_state", "recurrent_state", "kv_cache"}
        for key in ("us_per_layer", "kernels_per_layer", "bytes_per_layer", "floor_us_per_layer"):
            assert _finite_positive(v[key]), (name, key, v.get(key))
        # the time reported is the slowest rank's
        assert len(v["us_per_layer_ranks"]) == WORLD
        assert v["us_per_layer"] == max(v["us_per_layer_ranks"])
        assert v["floor_us_per_layer"] == pytest.approx(v["bytes_per_layer"]
                                                        / (meta["copy_gbps"] * 1e3))
        assert name in stdout
    assert _finite_positive(b["ratios"]["k3_over_k3_noshard"])


@pytest.mark.slow
def test_smoke_k3_shards_the_replicated_projections(smoke):
    data, _ = smoke
    (b,) = data["buckets"]
    v = b["variants"]
    moe_layers = 4  # layers 1-4 are all MoE
    assert (v["k3"]["shard"]["fronts"], v["k3"]["shard"]["ups"]) == (moe_layers, moe_layers)
    assert not v["k3"]["shard"]["skipped"]
    assert (v["k3_noshard"]["shard"]["fronts"], v["k3_noshard"]["shard"]["ups"]) == (0, 0)
    # tiny, bf16: router [16, 256], latent down [128, 256], latent up [256, 128]; k3 reads half
    tiny = get_config("tiny")
    D, E, L = tiny.hidden_size, tiny.num_experts, tiny.routed_expert_hidden_size
    replicated = 2 * (E * D + L * D + D * L)
    assert data["meta"]["replicated_moe_bytes_per_layer"] == {"front": 2 * (E + L) * D,
                                                             "up": 2 * D * L}
    whole = v["k3_noshard"]["bytes_per_layer"]
    assert v["eager"]["bytes_per_layer"] == v["inductor"]["bytes_per_layer"] == whole
    assert whole == b["bytes"]["per_layer_mean"]
    assert whole - v["k3"]["bytes_per_layer"] == replicated * (1 - 1 / WORLD)


def test_rows_in_chunks_equal_one_call():
    """The premise of the chunked references: rows are independent requests."""
    import decode_layer as dl

    with torch.no_grad():
        _, model, stack = dl.build("tiny", torch.device("cpu"), max_batch=3, context=16, seed=0)
        bufs = dl.state_buffers(stack)
        bucket = dl.Bucket(3)
        inputs = dl.make_inputs(model, bucket, 16, torch.Generator().manual_seed(0))
        s0 = dl.snapshot(bufs)
        whole = dl.step_result(stack(*inputs), bufs, bucket, 16)
        dl.restore(bufs, s0)
        with dl.TopkRecorder() as rec:
            chunked = dl.step_result(bench.in_rows(stack, inputs, 2), bufs, bucket, 16)
    assert len(rec.indices) == 2 * 4  # two calls of 4 layers, regrouped by layer
    assert [t.shape[0] for t in bench.routing_by_layer(rec.indices, 4)] == [3] * 4
    for name, t in whole.items():
        torch.testing.assert_close(chunked[name], t, rtol=2e-2, atol=2e-2, msg=name)


def test_merge_takes_the_slowest_rank_and_the_worst_status():
    check = {"passed": True}
    ranks = [
        {"status": "ok", "us_per_layer": 10.0, "kernels_per_layer": 5.0, "compile_s": 1.0,
         "rank_max_abs_diff": 0.0, "check": check},
        {"status": "check failed", "us_per_layer": 12.5, "kernels_per_layer": 5.0,
         "compile_s": 3.0, "rank_max_abs_diff": 0.0, "check": {"passed": False}},
    ]
    out = bench.merge(ranks)
    assert out["status"] == "check failed" and out["check_passed_ranks"] == [True, False]
    assert (out["us_per_layer"], out["compile_s"]) == (12.5, 3.0)
    assert out["ranks_equal"]
    failed = bench.merge([ranks[0], {"status": "error", "reason": "OOM"}])
    assert failed["status"] == "error" and failed["reason"] == "rank 1: OOM"
    assert "us_per_layer_ranks" not in failed


def test_k3_bytes_count_the_shard_report():
    moe = {"front": 1000.0, "up": 400.0}
    full = {"fronts": 4, "ups": 4}
    assert bench.variant_bytes(5000.0, "k3", full, moe, world=2, layers=4) == 5000.0 - 700.0
    assert bench.variant_bytes(5000.0, "k3", {"fronts": 4, "ups": 0}, moe, 4, 4) == 5000 - 750
    assert bench.variant_bytes(5000.0, "k3_noshard", full, moe, 2, 4) == 5000.0
    assert bench.variant_bytes(5000.0, "k3", None, moe, 2, 4) == 5000.0
