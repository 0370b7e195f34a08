"""The release's checkpoint format through `k3compile.adapt`: routed experts as compressed-tensors
MXFP4 (`quantization_config` format `mxfp4-pack-quantized`, group 32, `weight_packed` uint8
[out, in/2] + `weight_scale` E8M0 uint8 [out, in/32], the release's ignore list).

The checkpoint is written here: Moonshot's tiny config, seeded weights, each routed expert
projection quantised and packed by compressed-tensors' own functions (`generate_mx_scales`,
`MXFP4PackedCompressor.compress`), saved as safetensors with the release's tensor names and a
config.json with the `quantization_config`. It is loaded as a user loads the release:
`from_pretrained` through transformers' compressed-tensors quantizer, with Moonshot's class from
K3_MOONSHOT_DIR (`k3compile.adapt.moonshot.from_pretrained`); `AutoModelForCausalLM` with
`trust_remote_code` and their files next to the checkpoint loads the same model (one test: it
needs `moonshot.loaded_weights_kept`, Moonshot's `_init_weights` fails under transformers 5).

1. compressed-tensors' packing is `k3.moe_experts`'s: nibble order and scale bias, bit for bit;
2. eager: the adapted step equals the loaded model's own forward (compressed-tensors decompresses
   its experts), prefill and greedy decode, bf16 bit-equal; the adapter holds the packed bytes;
3. compiled: the experts fuse into `k3.moe_experts` in every MoE layer, logits equal, tokens
   identical; per-layer kernels against the same checkpoint run dense;
4. refused: packed experts in another layout (NVFP4 group 16, MXFP4 with groups of 64).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import shutil

import pytest
import torch

import k3compile.backend as k3be
from k3compile import math
from k3compile.adapt import adapt, compressed, fla
from tests.adapt.test_moonshot import (
    TOL_COMPILED_BF16,
    compile_step,
    moonshot_greedy,
    rel,
    step_greedy,
)

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

# the release's ignore list (attention, shared experts, dense MLP, lm_head) and the model's other
# non-expert Linears (AttnRes and latent projections); vision has no module in a text model
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*\.mlp\..*",
          "re:.*_res_proj$", "re:.*routed_expert_(down|up)_proj$"]


def mxfp4(weight: torch.Tensor, scheme) -> dict:
    """compressed-tensors' MXFP4 of a weight: E8M0 scales from each group's absmax, then its
    compressor's quantise + pack."""
    group = scheme.weights.group_size
    amax = weight.float().abs().view(weight.shape[0], -1, group).amax(-1)
    scale = torch.exp2(generate_mx_scales(amax) - 127).to(weight.dtype)
    return MXFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)


def nvfp4(weight: torch.Tensor, scheme) -> dict:
    amax = weight.float().abs().view(weight.shape[0], -1, 16).amax(-1)
    return NVFP4PackedCompressor.compress(
        {"weight": weight, "weight_scale": (amax / 6).clamp_min(1e-4),
         "weight_global_scale": torch.ones(1)}, scheme)


SCHEMES = {
    "mxfp4": ({"format": "mxfp4-pack-quantized", **MXFP4A16}, mxfp4),
    "mxfp4_g64": ({"format": "mxfp4-pack-quantized",
                   "weights": MXFP4A16["weights"].model_copy(update={"group_size": 64})}, mxfp4),
    "nvfp4": ({"format": "nvfp4-pack-quantized", **NVFP4A16}, nvfp4),
}


def write_checkpoint(path, model, kind: str = "mxfp4", ignore=tuple(IGNORE)):
    """model's weights as safetensors, its routed experts packed as `kind`, and a config.json
    with the `quantization_config` compressed-tensors writes (where the release's config.json
    has it: in `text_config` for a `KimiK3Config`, which lifts it to the top when loaded)."""
    from safetensors.torch import save_file

    fields, pack = SCHEMES[kind]
    scheme = QuantizationScheme(targets=["Linear"], **fields)
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if ".experts." in name and isinstance(module, torch.nn.Linear):
            del state[f"{name}.weight"]
            for key, value in pack(module.weight.detach(), scheme).items():
                state[f"{name}.{key}"] = value
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(path)
    quant = QuantizationConfig(config_groups={"group_0": scheme}, format=fields["format"],
                               quantization_status="compressed", ignore=list(ignore))
    config = json.loads((path / "config.json").read_text())
    config.get("text_config", config)["quantization_config"] = {
        **quant.model_dump(mode="json"), "quant_method": "compressed-tensors"}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


@pytest.fixture(scope="module")
def checkpoint(moonshot, tmp_path_factory):
    """kind, dtype, layers -> the folder of a tiny checkpoint (written once per module)."""
    made = {}

    def make(kind="mxfp4", dtype=torch.bfloat16, layers=2):
        key = (kind, dtype, layers)
        if key not in made:
            config = moonshot.tiny_config(num_hidden_layers=layers, mla_layers=(layers - 1,))
            model = moonshot.build(config, dtype=dtype)
            made[key] = write_checkpoint(tmp_path_factory.mktemp(kind), model, kind)
        return made[key]

    return make


def dense_twin(moonshot, loaded):
    """Moonshot's model of the loaded one's config and weights, its experts dense `nn.Linear`s
    holding compressed-tensors' decompression of the loaded packed experts."""
    dtype = loaded.get_output_embeddings().weight.dtype
    twin = moonshot.build(loaded.config, dtype=dtype)
    twin.load_state_dict({n: t for n, t in loaded.state_dict().items() if ".experts." not in n},
                         strict=False)
    fields = SCHEMES["mxfp4"][0]
    scheme = QuantizationScheme(targets=["Linear"], **fields)
    mine = dict(twin.named_modules())
    for name, linear in loaded.named_modules():
        if ".experts." in name and hasattr(linear, "weight_packed"):
            packed = {"weight_packed": linear.weight_packed, "weight_scale": linear.weight_scale}
            weight = MXFP4PackedCompressor.decompress(packed, scheme)["weight"]
            mine[name].weight.data.copy_(weight)
    return twin


def expert_linears(model):
    return [m for n, m in model.named_modules() if ".experts." in n and hasattr(m, "in_features")]


# ---- 1. the packing ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compressed_tensors_mxfp4_is_the_layout_moe_experts_takes(dtype):
    """Every code and scale: compressed-tensors' own decompression equals our dequant (the
    canonical form and the adapter's spelling) bit for bit; a nibble-swapped or scale-biased
    reading does not, so this test sees either mismatch."""
    scheme = QuantizationScheme(targets=["Linear"], **SCHEMES["mxfp4"][0])
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 256, generator=gen) * torch.logspace(-3, 1, 64).unsqueeze(1))
    packed = mxfp4(weight.to(dtype), scheme)
    packed["weight_packed"][:16] = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(1, 8)
    decompressed = MXFP4PackedCompressor.decompress(dict(packed), scheme)["weight"]
    p, s = packed["weight_packed"], packed["weight_scale"]
    assert p.dtype == s.dtype == torch.uint8 and p.shape == (64, 128) and s.shape == (64, 8)
    want = decompressed.to(dtype)  # compressed-tensors decompresses to bf16: exact values
    ours = math.mxfp4_dequant(p, s, math.e2m1_table(dtype=dtype))
    assert torch.equal(ours, want) and torch.equal(compressed.dequant(p, s, dtype), want)
    swapped = (p << 4) | (p >> 4)
    assert not torch.equal(math.mxfp4_dequant(swapped, s, math.e2m1_table(dtype=dtype)), want)
    assert not torch.equal(math.mxfp4_dequant(p, s + 1, math.e2m1_table(dtype=dtype)), want)


def test_dequant_traces_without_a_tensor_constant():
    """A tensor constant becomes a `get_attr` of the traced graph, which the stage cache cannot
    key: Moonshot's compiled step then stored no stage output and a warm process ran every
    stage again (session 19). The adapter's table is computed from its codes instead."""
    from torch.fx.experimental.proxy_tensor import make_fx

    p = torch.arange(256, dtype=torch.uint8).view(4, 64)
    s = torch.full((4, 4), 127, dtype=torch.uint8)
    gm = make_fx(lambda a, b: compressed.dequant(a, b, torch.bfloat16))(p, s)
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert torch.equal(gm(p, s), compressed.dequant(p, s, torch.bfloat16))


def test_moe_experts_op_on_compressed_tensors_experts_equals_their_dense_weights():
    """`k3.moe_experts` on compressed-tensors' stacked packed experts equals the experts'
    GEMMs on compressed-tensors' decompressed weights (fp32: exact dequant, then fp32 math)."""
    scheme = QuantizationScheme(targets=["Linear"], **SCHEMES["mxfp4"][0])
    gen = torch.Generator().manual_seed(1)
    E, L, inter, N, k = 4, 64, 96, 3, 2
    packs = {w: [mxfp4(torch.randn(*shape, generator=gen) * 0.05, scheme) for _ in range(E)]
             for w, shape in (("w1", (inter, L)), ("w3", (inter, L)), ("w2", (L, inter)))}
    args = []
    for w in ("w1", "w3", "w2"):
        args += [torch.stack([p["weight_packed"] for p in packs[w]]),
                 torch.stack([p["weight_scale"] for p in packs[w]])]
    dense = {w: torch.stack([MXFP4PackedCompressor.decompress(dict(p), scheme)["weight"].float()
                             for p in packs[w]]) for w in packs}
    z = torch.randn(N, L, generator=gen)
    ids = torch.tensor([[0, 3], [2, 1], [3, 3]])
    weights = torch.rand(N, k, generator=gen)
    got = torch.ops.k3.moe_experts(z, ids, weights, *args, 4.0, 25.0)
    gate = torch.einsum("nl,nkil->nki", z, dense["w1"][ids])
    up = torch.einsum("nl,nkil->nki", z, dense["w3"][ids])
    y = torch.einsum("nki,nkli->nkl", math.situ(gate, up, 4.0, 25.0), dense["w2"][ids])
    torch.testing.assert_close(got, (weights.unsqueeze(-1) * y).sum(1), rtol=1e-6, atol=1e-6)


# ---- 2. load + eager -------------------------------------------------------------------------


def test_loaded_checkpoint_keeps_packed_experts_and_its_other_weights(moonshot, checkpoint):
    path = checkpoint()
    model = moonshot.from_pretrained(path)
    saved = moonshot.build(moonshot.tiny_config(num_hidden_layers=2, mla_layers=(1,)),
                           dtype=torch.bfloat16).state_dict()
    loaded = model.state_dict()
    for name, value in saved.items():
        if ".experts." not in name:  # Moonshot's _init_weights would have re-drawn these
            assert torch.equal(loaded[name], value), name
    linears = expert_linears(model)
    assert linears and all(not hasattr(m, "weight") and m.weight_packed.dtype == torch.uint8
                           and m.weight_scale.dtype == torch.uint8 for m in linears)


def remote_code_folder(moonshot, checkpoint_dir, tmp_path, monkeypatch, auto_map: dict,
                       files=()):
    """A copy of the checkpoint with Moonshot's files (NEEDED and `files`) beside it, as in the
    Hugging Face repo (a copy in the test's tmp folder only), config.json's `auto_map` set; transformers' module
    cache in the session's temp folder."""
    import transformers.dynamic_module_utils as dynamic

    folder = tmp_path / "remote"
    shutil.copytree(checkpoint_dir, folder)
    for name in (*moonshot.NEEDED, *files):
        shutil.copy(moonshot.moonshot_dir() / name, folder / name)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = auto_map
    (folder / "config.json").write_text(json.dumps(config))
    # one module cache per pytest session (its base temp folder): transformers puts each cache on
    # sys.path, and 5.17 imports the files' relative imports through the `transformers_modules`
    # package an earlier test's cache defined
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path.parent / "hf_modules"))
    return folder


def remote_load(folder, shim, fails: tuple[type, str] | None):
    """`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` (fla's stand-ins
    where fla cannot run): raises `fails` (exception type, message; None: loads) without
    `shim()`, and within it loads the model in bf16. The load without `shim()` imports
    Moonshot's files under `moonshot.released_names()` (what their import needs from this
    transformers), so `fails` is what `shim` itself fixes."""
    from transformers import AutoModelForCausalLM

    from k3compile.adapt.moonshot import released_names

    with fla.installed():
        raises = contextlib.nullcontext() if fails is None else pytest.raises(fails[0],
                                                                              match=fails[1])
        with raises, released_names():
            AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        with shim():
            return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                        dtype=torch.bfloat16)


def assert_same_model(moonshot, remote, folder):
    """`remote` (loaded with trust_remote_code) is the model `moonshot.from_pretrained` loads:
    the same tensors, the same adapted step."""
    local = moonshot.from_pretrained(folder)
    assert type(remote).__module__ != type(local).__module__  # Moonshot's code, loaded twice
    want = local.state_dict()
    assert {n: t.dtype for n, t in remote.state_dict().items()} == \
        {n: t.dtype for n, t in want.items()}
    assert all(torch.equal(t, want[n]) for n, t in remote.state_dict().items())
    ids, pos = torch.tensor([3, 4]), torch.zeros(2, dtype=torch.long)
    got = adapt(remote.eval(), max_batch=2, max_seq_len=8)(ids, pos)
    assert torch.equal(got, adapt(local, max_batch=2, max_seq_len=8)(ids, pos))


def test_remote_code_load_is_the_same_model(moonshot, checkpoint, tmp_path, monkeypatch):
    """`AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` with Moonshot's files
    next to the checkpoint (as in the Hugging Face repo; fla's stand-ins where fla cannot run)
    loads the model `moonshot.from_pretrained` loads, once `loaded_weights_kept` stops Moonshot's
    `_init_weights` (which, under transformers 5.1, fails on the MXFP4 experts; 5.17 skips
    remote code's init of loaded modules itself: `_initialize_weights(..., is_custom_code)`)."""
    from transformers import PreTrainedModel

    folder = remote_code_folder(
        moonshot, checkpoint(), tmp_path, monkeypatch,
        {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
         "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"})
    guarded = "is_custom_code" in inspect.signature(PreTrainedModel._initialize_weights).parameters
    remote = remote_load(folder, moonshot.loaded_weights_kept,
                         fails=None if guarded else (AttributeError, "has no attribute 'weight'"))
    assert_same_model(moonshot, remote, folder)


def test_eager_step_equals_the_loaded_models_forward_and_holds_the_packed_bytes(moonshot,
                                                                               checkpoint):
    """bf16: the adapter's prefill + greedy decode equal the loaded model's own (compressed-
    tensors decompresses the experts on its first forward, in place in the user's model; the
    adapter keeps the packed Parameters it was given)."""
    model = moonshot.from_pretrained(checkpoint())
    packed = {id(m.weight_packed) for m in expert_linears(model)}
    step = adapt(model, max_batch=4, max_seq_len=32)
    got = step_greedy(step)
    want = moonshot_greedy(model)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.bfloat16 and g.shape == w.shape
        assert rel(g, w) == 0.0  # measured bit-equal
    assert [t.argmax(-1).tolist() for t in got] == [t.argmax(-1).tolist() for t in want]
    assert all(not hasattr(m, "weight_packed") for m in expert_linears(model))  # decompressed
    adapted = expert_linears(step)
    assert {id(m.weight_packed) for m in adapted} == packed
    assert not any(hasattr(m, "weight") for m in adapted)  # no dequantised copy
    step.reset_cache()
    assert all(torch.equal(g, w) for g, w in zip(step_greedy(step), got, strict=True))
    with pytest.raises(compressed.UnsupportedExperts, match="before any forward"):
        adapt(model)  # compressed-tensors' first forward wrapped it: refused, clearly


# ---- 3. compiled ------------------------------------------------------------------------------


def _kernels(report) -> dict[int, int]:
    """Per layer: fused ops + plain GEMMs + ATen ops left to Inductor."""
    return {lr.layer: lr.fused_ops + lr.gemm_ops + sum(lr.other_ops.values())
            for lr in report.layers}


def _decode(compiled, eager, steps=3):
    """Greedy decode by eager from empty slots; compiled steps the same inputs (its slots empty
    too: a fresh adapter)."""
    eager.reset_cache()
    ids, pos, slots = torch.tensor([3, 5]), torch.tensor([0, 0]), torch.tensor([0, 1])
    out = []
    for i in range(steps):
        got, want = compiled(ids, pos + i, slots), eager(ids, pos + i, slots)
        out.append((got, want))
        ids = want.argmax(-1)
    return out


@pytest.mark.slow
def test_compiled_fp32_experts_fuse_and_equal_eager(moonshot, checkpoint, capsys):
    """fp32, 3 layers (dense KDA, KDA + MoE, MLA + MoE): the whole plan is met, `moe_experts` in
    both MoE layers; logits equal the eager adapter; per-layer kernels against the same
    weights with dense experts (what ran before: `nn.Linear` experts do not fuse)."""
    path = checkpoint(dtype=torch.float32, layers=3)
    model = moonshot.from_pretrained(path, dtype=torch.float32)
    eager = adapt(model, max_batch=4, max_seq_len=32)
    compiled = compile_step(adapt(model, max_batch=4, max_seq_len=32))
    first = _decode(compiled, eager)
    for got, want in first:
        assert got.dtype == want.dtype and got.shape == want.shape and rel(got, want) <= 1e-5
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    (after,) = k3be.last_compiled().contracts.values()
    assert after.met, k3be.last_compiled().summary()
    assert [lr.actual["moe_experts"] for lr in after.layers] == [0, 1, 1, 0]

    # a later weight load into the model (in place, as load_state_dict does) is seen
    state = {n: t.clone() for n, t in model.state_dict().items() if ".experts." in n}
    model.load_state_dict({n.replace(".experts.0.", ".experts.1."): state[n] for n in state
                           if ".experts.0." in n}, strict=False)
    compiled.reset_cache()
    second = _decode(compiled, eager)
    assert not torch.equal(second[-1][1], first[-1][1])  # expert 1 is routed: the load matters
    assert all(rel(got, want) <= 1e-5 for got, want in second)
    model.load_state_dict(state, strict=False)

    dense_step = adapt(dense_twin(moonshot, model), max_batch=4, max_seq_len=32)
    for got, want in _decode(compile_step(dense_step), eager):
        assert rel(got, want) <= 1e-5  # the same weights, dense: compressed-tensors' values
    (before,) = k3be.last_compiled().contracts.values()
    kernels = {"before": _kernels(before), "after": _kernels(after)}
    with capsys.disabled():
        print(f"\nkernels per layer (fp32, bucket 2), dense experts -> MXFP4: {kernels}")
    assert all(kernels["after"][i] < kernels["before"][i] for i in (1, 2))


@pytest.mark.slow
def test_compiled_bf16_decode_equals_the_loaded_models_forward(moonshot, checkpoint):
    """bf16 (the release's dtype): compiled greedy decode against the loaded model's own eager
    decode (compressed-tensors' dequantised experts, Moonshot's cache): tokens identical, logits
    within TOL_COMPILED_BF16; `moe_experts` fused in the MoE layer."""
    model = moonshot.from_pretrained(checkpoint())
    step = adapt(model, max_batch=4, max_seq_len=32)
    want = moonshot_greedy(model)
    got = step_greedy(step, decode=compile_step(step))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.bfloat16 and rel(g, w) <= TOL_COMPILED_BF16
    assert [t.argmax(-1).tolist() for t in got] == [t.argmax(-1).tolist() for t in want]
    (report,) = k3be.last_compiled().contracts.values()
    assert [lr.actual["moe_experts"] for lr in report.layers] == [0, 1, 0]


# ---- 4. refused -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, why", [("nvfp4", "nvfp4-pack-quantized"),
                                       ("mxfp4_g64", "group size 64")])
def test_other_packings_are_refused(moonshot, checkpoint, kind, why):
    model = moonshot.from_pretrained(checkpoint(kind))
    assert all(hasattr(m, "weight_packed") for m in expert_linears(model))
    with pytest.raises(compressed.UnsupportedExperts, match=why):
        adapt(model, max_batch=2, max_seq_len=16)


def _tampered(linear, what):
    bad = copy.deepcopy(linear)
    scheme = bad.quantization_scheme
    if what == "asymmetric":
        scheme.weights = scheme.weights.model_copy(update={"symmetric": False})
    elif what == "activations":
        scheme.input_activations = scheme.weights
    elif what == "scale dtype":
        bad.weight_scale = torch.nn.Parameter(bad.weight_scale.float(), requires_grad=False)
    elif what == "packed shape":
        bad.weight_packed = torch.nn.Parameter(bad.weight_packed[:, :-1], requires_grad=False)
    return bad


@pytest.mark.parametrize("what, why", [("asymmetric", "asymmetric"),
                                       ("activations", "quantised activations"),
                                       ("scale dtype", "weight_scale"),
                                       ("packed shape", "weight_packed")])
def test_look_alike_projections_are_refused_with_the_reason(moonshot, checkpoint, what, why):
    model = moonshot.from_pretrained(checkpoint())
    block = model.model.layers[1].block_sparse_moe
    assert compressed.check_experts("moe", block.experts)
    block.experts[3].w2 = _tampered(block.experts[3].w2, what)
    with pytest.raises(compressed.UnsupportedExperts, match=f"moe.3.w2: .*{why}"):
        compressed.check_experts("moe", block.experts)


def test_decompressed_experts_run_dense_with_a_warning(moonshot, checkpoint):
    """Experts compressed-tensors decompressed in place without wrapping the model (its
    per-module decompression) are dense bf16 Linears: the adapter warns and runs them dense,
    equal to the packed experts (the dequantisation is exact)."""
    packed = moonshot.from_pretrained(checkpoint())
    dense = moonshot.from_pretrained(checkpoint())
    for linear in expert_linears(dense):
        MXFP4PackedCompressor.decompress_module(linear)
    assert all(m.weight.dtype == torch.bfloat16 for m in expert_linears(dense))
    with pytest.warns(UserWarning, match="not packed"):
        dense_step = adapt(dense, max_batch=2, max_seq_len=16)
    assert not dense_step.lm.model.layers[1].block_sparse_moe.mxfp4_experts
    got = step_greedy(dense_step, steps=2)
    want = step_greedy(adapt(packed, max_batch=2, max_seq_len=16), steps=2)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
