"""`k3compile.adapt` on the class the release's config.json names, Moonshot's
`KimiK3ForConditionalGeneration`: its text model (a `KimiLinearForCausalLM`) under
`language_model.`, a vision tower and projector beside it that text decode does not use
(`moonshot.tiny_k3_config`: the tiny text config, a one-block vision tower).

1. eager: the adapted step's prefill + greedy decode equal the K3 class's own forward (fp32 to
   rounding), tokens identical; the adapter shares `language_model`'s parameters;
2. the release's checkpoint layout: tensors named `language_model.` / `vision_tower.` /
   `mm_projector.`, the `quantization_config` inside `text_config` with the release's ignore
   list, routed experts compressed-tensors MXFP4: `moonshot.from_pretrained` loads the K3 class
   with packed experts, and the adapted step equals the loaded model's forward (bf16, bit-equal);
   `AutoModelForCausalLM` with `trust_remote_code` (the release's auto_map) loads the same model
   under `moonshot.compatible()` and fails without it;
3. compiled (slow): one graph per decode step, logits equal Moonshot's eager K3 class (its
   experts compressed-tensors' fp32 decompression of the packed ones), tokens identical, and
   per layer the same kernels as the `KimiLinearForCausalLM` path on a checkpoint of the same
   weights.
"""

from __future__ import annotations

import json

import pytest
import torch

import k3compile.backend as k3be
from k3compile.adapt import adapt
from tests.adapt.test_moonshot import TOL, compile_step, moonshot_greedy, rel, step_greedy

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
from tests.adapt.test_mxfp4_load import (
    _kernels,
    assert_same_model,
    dense_twin,
    expert_linears,
    remote_code_folder,
    remote_load,
    write_checkpoint,
)

# the release's config.json ignore list, and the Linears it leaves targeted that the release
# cannot hold packed: Moonshot's `_apply_attn_res` reads `proj.weight` of the AttnRes
# projections, and the latent MoE projections run as plain Linears around the experts
RELEASE_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*",
                  r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                  "re:.*vision_tower.*", "re:.*mm_projector.*"]
DENSE_TOO = ["re:.*_res_proj$", "re:.*routed_expert_(down|up)_proj$"]


def k3_model(moonshot, dtype=torch.float32, layers=3):
    """Layer 0 dense KDA, MoE after, the last layer MLA."""
    config = moonshot.tiny_k3_config(num_hidden_layers=layers, mla_layers=(layers - 1,))
    return moonshot.build(config, dtype=dtype)


def test_eager_step_equals_the_k3_class(moonshot):
    """fp32 (bf16, bit-equal: the release-layout test below)."""
    model = k3_model(moonshot)
    assert type(model).__name__ == "KimiK3ForConditionalGeneration"
    step = adapt(model, max_batch=4, max_seq_len=32)
    assert {id(p) for p in step.parameters()} == \
        {id(p) for p in model.language_model.parameters()}
    want, got = moonshot_greedy(model, steps=2), step_greedy(step, steps=2)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and rel(g, w) <= TOL[torch.float32]
    assert [t.argmax(-1).tolist() for t in got] == [t.argmax(-1).tolist() for t in want]


@pytest.fixture(scope="module")
def k3_checkpoint(moonshot, tmp_path_factory):
    """dtype, layers -> (folder of a K3 checkpoint in the release's layout, Moonshot's model
    that wrote it)."""
    made = {}

    def make(dtype=torch.bfloat16, layers=2):
        if (dtype, layers) not in made:
            model = k3_model(moonshot, dtype, layers)
            path = write_checkpoint(tmp_path_factory.mktemp("k3"), model,
                                    ignore=RELEASE_IGNORE + DENSE_TOO)
            made[dtype, layers] = path, model
        return made[dtype, layers]

    return make


def test_release_layout_loads_as_the_k3_class(moonshot, k3_checkpoint):
    from safetensors import safe_open

    path, saved = k3_checkpoint()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and "quantization_config" not in config
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed" in names
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "mm_projector"}

    model = moonshot.from_pretrained(path)
    assert type(model).__name__ == "KimiK3ForConditionalGeneration"
    loaded, want = model.state_dict(), saved.state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in want.items() if ".experts." not in n)
    linears = expert_linears(model)
    assert linears and all(not hasattr(m, "weight") and m.weight_packed.dtype == torch.uint8
                           for m in linears)

    step = adapt(model, max_batch=4, max_seq_len=32)
    got = step_greedy(step, steps=2)  # adapted first: the experts still packed
    want = moonshot_greedy(model, steps=2)
    assert all(rel(g, w) == 0.0 for g, w in zip(got, want, strict=True))  # measured bit-equal
    assert [t.argmax(-1).tolist() for t in got] == [t.argmax(-1).tolist() for t in want]


def _compiled_decode(model):
    """The prompt by the eager adapter, greedy decode compiled; logits, graphs compiled, and
    the kernels per layer."""
    step = adapt(model, max_batch=4, max_seq_len=32)
    compiled = compile_step(step)
    n0 = len(k3be._compiled)
    got = step_greedy(step, decode=compiled)
    (report,) = k3be.last_compiled().contracts.values()
    return got, len(k3be._compiled) - n0, _kernels(report), report


@pytest.mark.slow
def test_compiled_k3_class_equals_eager_with_the_kimi_linear_kernels(moonshot, k3_checkpoint,
                                                                     tmp_path, capsys):
    """fp32, 3 layers (dense KDA, KDA + MoE, MLA + MoE), MXFP4 experts."""
    path, saved = k3_checkpoint(torch.float32, layers=3)
    model = moonshot.from_pretrained(path, dtype=torch.float32)
    got, graphs, kernels, report = _compiled_decode(model)
    # the loaded model's own fp32 forward fails (compressed-tensors decompresses its experts to
    # bf16): Moonshot's K3 class with those experts decompressed in fp32 is the reference
    want = moonshot_greedy(dense_twin(moonshot, model))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and rel(g, w) <= 1e-5
    assert [t.argmax(-1).tolist() for t in got] == [t.argmax(-1).tolist() for t in want]
    assert graphs == 1  # one graph for every decode step
    assert report.met and [lr.actual["moe_experts"] for lr in report.layers] == [0, 1, 1, 0]

    text = moonshot.build(saved.config.text_config, dtype=torch.float32)
    text.load_state_dict(saved.language_model.state_dict())
    linear = moonshot.from_pretrained(write_checkpoint(tmp_path, text), dtype=torch.float32)
    assert type(linear).__name__ == "KimiLinearForCausalLM"
    got_linear, _, kernels_linear, _ = _compiled_decode(linear)
    with capsys.disabled():
        err = max(rel(g, w) for g, w in zip(got, want, strict=True))
        print(f"\nkernels per layer (fp32, bucket 2): K3 class {kernels}, KimiLinear "
              f"{kernels_linear}; max rel err vs Moonshot's eager {err:.1e}")
    assert kernels == kernels_linear, (kernels, kernels_linear)
    assert all(torch.equal(g, w) for g, w in zip(got, got_linear, strict=True))


def test_remote_code_load_of_the_k3_class(moonshot, k3_checkpoint, tmp_path, monkeypatch):
    """`AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` with the release's
    auto_map and Moonshot's files next to the checkpoint fails under transformers 5 (Moonshot's
    `tie_weights`), and under `moonshot.compatible()` loads the model `moonshot.from_pretrained`
    loads."""
    folder = remote_code_folder(
        moonshot, k3_checkpoint()[0], tmp_path, monkeypatch,
        {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
         "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        files=["modeling_kimi_k3.py"])
    remote = remote_load(folder, moonshot.compatible, fails=(TypeError, "recompute_mapping"))
    assert type(remote).__name__ == "KimiK3ForConditionalGeneration"
    assert_same_model(moonshot, remote, folder)
