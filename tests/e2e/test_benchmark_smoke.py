"""benchmarks/decode_layer.py: its smoke mode in process (tiny config, CPU), also of the second
spelling (`--model hf`: its stack against the built-in one on the same inputs, then the smoke run
with backend="k3"), its correctness check on a negative case, and its byte model against the K3
TP16 numbers of k3_arch.md §6."""

from __future__ import annotations

import json
import math

import pytest
import torch

from k3compile.models import build_model, get_config
from k3compile.models.k3 import K3DecoderLayer
from tests.conftest import TOL, load_benchmark, rel_err

bench = load_benchmark("decode_layer")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode_layer")
    try:
        bench.main(["--config", "tiny", "--smoke", "--device", "cpu",
                    "--variants", "eager,inductor", "--out", str(out)])
    finally:
        torch._dynamo.reset()
    return json.loads((out / "decode_layer.json").read_text())


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_smoke_writes_every_bucket_and_number(smoke):
    assert smoke["meta"]["config"] == "tiny" and _finite_positive(smoke["meta"]["copy_gbps"])
    assert {b["name"] for b in smoke["buckets"]} == {"B2", "B1xT2"}
    assert not smoke["skipped"]
    for b in smoke["buckets"]:
        assert _finite_positive(b["floor_us_per_layer"])
        assert _finite_positive(b["bytes"]["per_layer_mean"])
        assert len(b["bytes"]["distinct_experts"]) == len(bench.STACK_LAYERS)
        assert _finite_positive(b["ratios"]["inductor_over_floor"])
        assert b["ratios"]["k3_over_inductor"] is None
        for name in ("eager", "inductor"):
            v = b["variants"][name]
            assert v["status"] == "ok", v
            for key in ("us_per_layer", "kernels_per_layer", "gbps", "over_floor"):
                assert _finite_positive(v[key]), (b["name"], name, key, v.get(key))
        assert b["variants"]["k3"]["status"] == "n/a" and b["variants"]["k3"]["reason"]


def test_smoke_check_compares_outputs_and_state(smoke):
    tiny = get_config("tiny")
    for b in smoke["buckets"]:
        # the check ran under a routing the bias alone decides: k experts for every token
        assert b["check_routing_distinct_experts"] == [tiny.num_experts_per_token] * 4
        c = b["variants"]["inductor"]["check"]
        assert c["passed"]
        assert math.isfinite(c["max_err_vs_eager"]) and c["max_err"] <= c["tol_max_err"]
        kinds = {name.rsplit(".", 1)[-1] for name in c["parts"]}
        assert kinds == {"prefix", "delta", "conv_state", "recurrent_state", "kv_cache"}
        for part in c["parts"].values():
            assert part["passed"] and part["eager_vs_fp32"]["rel_l2"] > 0  # bf16 really differs


def test_hf_stack_computes_the_builtin_stack():
    """The second spelling's layers 1-4 (weights shared, state copied) on the yardstick's inputs:
    the built-in stack's running sum (prefix + delta) and state writes, fp32."""
    cfg = get_config("tiny").with_layers(max(bench.STACK_LAYERS) + 1)
    model = build_model(cfg, dtype=torch.float32, max_batch=2, max_seq_len=64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for buf in bench.state_buffers(model).values():
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)
        hf, ours = bench.hf_stack(model), bench.builtin_stack(model)
        assert hf.layers[0].self_attn.o_proj.weight.data_ptr() == \
            ours.layers[0].self_attn.o_proj.weight.data_ptr()  # shared, not copied
        for bucket in (bench.Bucket(2), bench.Bucket(1, 2)):
            inputs = bench.make_inputs(model, bucket, 64, gen)
            (got,) = hf(*inputs)
            prefix, delta = ours(*inputs)
            assert rel_err(got, prefix + delta) <= TOL["float32"], bucket
    theirs = {n.replace("kv_cache", "latent_cache"): b
              for n, b in bench.state_buffers(ours).items()}
    mine = bench.state_buffers(hf)
    assert mine.keys() == theirs.keys() and len(mine) == 7  # conv + recurrent x 3 KDA, 1 cache
    assert all(rel_err(mine[n], theirs[n]) <= TOL["float32"] for n in mine)


@pytest.fixture(scope="module")
def hf_smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode_layer_hf")
    env = pytest.MonkeyPatch()
    env.setenv("K3_EXECUTOR", "aten")  # Inductor's C++ build would take minutes on 2 cores
    try:
        # one bucket (the verify rows' graph would double a minute of compiling)
        bench.main(["--config", "tiny", "--smoke", "--device", "cpu", "--model", "hf",
                    "--verify", "0", "--variants", "eager,k3", "--out", str(out)])
    finally:
        env.undo()
        torch._dynamo.reset()
    return json.loads((out / "decode_layer_hf.json").read_text())


@pytest.mark.slow
def test_hf_smoke_times_and_checks_the_second_spelling_under_k3(hf_smoke):
    tiny = get_config("tiny")
    assert hf_smoke["meta"]["model"] == "hf" and not hf_smoke["skipped"]
    assert [b["name"] for b in hf_smoke["buckets"]] == ["B2"]
    for b in hf_smoke["buckets"]:
        assert b["model"] == "hf"
        assert b["check_routing_distinct_experts"] == [tiny.num_experts_per_token] * 4
        assert _finite_positive(b["bytes"]["per_layer_mean"])
        for name in ("eager", "k3"):
            v = b["variants"][name]
            assert v["status"] == "ok", v
            for key in ("us_per_layer", "kernels_per_layer", "gbps", "over_floor"):
                assert _finite_positive(v[key]), (b["name"], name, key, v.get(key))
        c = b["variants"]["k3"]["check"]
        assert c["passed"] and c["max_err"] <= c["tol_max_err"]
        kinds = {name.rsplit(".", 1)[-1] for name in c["parts"]}
        assert kinds == {"hidden", "conv_state", "recurrent_state", "latent_cache"}
        for part in c["parts"].values():
            assert part["passed"] and part["eager_vs_fp32"]["rel_l2"] > 0  # bf16 really differs


def test_kernel_variants_compile_their_own_step(monkeypatch):
    """An A/B variant that differs from k3 only in `settings.KERNELS` compiles a step of its own
    with its setting on (k3-grouped here; session 22's k3-checkkernel replayed k3's step from
    Dynamo's cache); k3-inductorcheck refuses a CPU run, which has no device-side check."""
    from k3compile import settings

    seen = []

    def backend(gm, example_inputs, options=None):
        seen.append((options, settings.KERNELS.moe_grouped))
        return gm.forward

    monkeypatch.setattr(bench, "resolve_k3", lambda: (backend, "k3"))
    args = bench.parse_args(["--config", "tiny", "--device", "cpu",
                             "--variants", "eager,k3,k3-grouped,k3-inductorcheck"])
    variants = bench.compiled_variants(args, torch.device("cpu"))
    assert "K3_CHECK_KERNEL" in variants["k3-inductorcheck"]["na"]
    stack, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    try:
        outs = {}
        for name in ("k3", "k3-grouped", "k3"):
            spec = variants[name]
            with bench.kernel_settings(spec.get("kernels", {})):
                runner = bench.Runner(name, stack, [x], torch.device("cpu"), spec["backend"],
                                      spec["options"], spec["graphs"])
            outs[name] = runner.run()
    finally:
        torch._dynamo.reset()
    options = variants["k3"]["options"]
    assert seen == [(options, False), (options, True)]  # k3's second Runner: its cached step
    assert torch.equal(outs["k3"], stack(x)) and torch.equal(outs["k3-grouped"], stack(x))


def test_own_compile_refuses_a_borrowed_step():
    spec = {"label": "k3 K3_CHECK_KERNEL", "kernels": {"check_kernel": True}}
    with pytest.raises(RuntimeError, match="Dynamo compiled no graph"):
        bench.own_compile(spec, {"dynamo": {"graphs": 0}}, {"kernel": 1})
    with pytest.raises(RuntimeError, match="never asked: no device-side check"):
        bench.own_compile(spec, {"dynamo": {"graphs": 1}}, {})
    with pytest.raises(RuntimeError, match="'refused': 2"):
        bench.own_compile(spec, {"dynamo": {"graphs": 1}}, {"refused": 2})
    bench.own_compile(spec, {"dynamo": {"graphs": 1}}, {"kernel": 1})
    off = {"label": "k3 K3_CHECK_KERNEL=0", "kernels": {"check_kernel": False}}
    with pytest.raises(RuntimeError, match="with K3_CHECK_KERNEL off"):
        bench.own_compile(off, {"dynamo": {"graphs": 1}}, {"kernel": 1})
    bench.own_compile(off, {"dynamo": {"graphs": 1}}, {"inductor": 1})
    bench.own_compile({"label": "k3"}, {"dynamo": {"graphs": 0}}, {})  # k3 may reuse its own


def test_check_fails_on_a_wrong_state_update():
    gen = torch.Generator().manual_seed(0)
    ref = {n: torch.randn(64, 32, generator=gen) for n in ("prefix", "delta", "state:s")}

    def noisy(t):
        return t + 1e-3 * torch.randn(t.shape, generator=gen)

    eager = {n: noisy(t) for n, t in ref.items()}
    good = {n: noisy(t) for n, t in ref.items()}
    assert bench.check(good, eager, ref)["passed"]
    stale = dict(good, **{"state:s": good["state:s"].clone()})
    stale["state:s"][:8] = 0  # rows a step failed to write
    result = bench.check(stale, eager, ref)
    assert not result["passed"] and result["worst"] == "state:s"
    assert not result["parts"]["state:s"]["passed"] and result["parts"]["prefix"]["passed"]


def _meta_layer(index: int) -> K3DecoderLayer:
    """One K3 TP16 decoder layer on the meta device, dtypes as build_model leaves them."""
    cfg = get_config("k3_tp16")
    with torch.device("meta"):
        layer = K3DecoderLayer(cfg, index)
    layer.to(torch.bfloat16)
    for mod in layer.modules():
        for name in ("e_score_correction_bias", "dt_bias", "A_log"):
            if isinstance(getattr(mod, name, None), torch.nn.Parameter):
                getattr(mod, name).data = getattr(mod, name).data.float()
    if layer.is_mla:
        layer.self_attn.setup_cache(65, 4096, "meta", torch.bfloat16)
    else:
        layer.self_attn.setup_cache(65, "meta", torch.bfloat16)
    return layer


@pytest.mark.parametrize("index", [1, 3])
def test_bytes_match_the_k3_tp16_budget(index):
    """k3_arch.md §6, stock TP16 at B=1: attention 57.2 (KDA) / 57.4 (MLA) MB, MoE non-expert
    132.1 MB, an expert's TP16 slice 1.097 MB, KDA state 0.39 MB each way, MLA 576 x 2 B a token."""
    layer = _meta_layer(index)
    b = bench.layer_bytes(layer, bench.Bucket(1), context=4096, experts_routed=16)
    attn = 57.4 if layer.is_mla else 57.2
    assert b["weights"] / 1e6 == pytest.approx(attn + 132.1, abs=0.3)
    assert b["expert_slice"] == 3 * 192 * 3584 * (1 / 2 + 1 / 32)
    assert b["experts"] == 16 * b["expert_slice"]
    if layer.is_mla:
        assert (b["state"], b["kv_cache"]) == (0, 4097 * 576 * 2)
    else:
        assert (b["state"], b["kv_cache"]) == (2 * (6 * 128 * 128 * 4 + 3 * 768 * 3 * 2), 0)
