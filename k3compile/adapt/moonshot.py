"""Moonshot's released modeling code, imported from where the user keeps it.

Moonshot's `modeling_kimi_linear.py` / `modeling_kimi_k3.py` (Kimi K3 License) are never part of
this repository: `K3_MOONSHOT_DIR` names a folder holding them and `configuration_kimi_k3.py`
(from the Hugging Face repo `moonshotai/Kimi-K3`). `load()` imports that folder as a package, so
the files' relative imports work, and where fla is not importable (any CPU machine) it imports
them against k3compile's torch stand-ins for fla (`k3compile.adapt.fla`).

`tiny_config` and `randomize` build the CPU test model: K3's structure at the built-in `tiny`
config's widths, seeded weights that keep activations finite (Moonshot's own init leaves
`dt_bias` and the router bias uninitialised); `tiny_k3_config` wraps it in the release's class,
`KimiK3ForConditionalGeneration` (its text model under `language_model.`, a vision tower beside).

Under transformers 5 Moonshot's code needs two shims, both in `compatible()`: its `_init_weights`
re-draws loaded weights (`loaded_weights_kept`), and `KimiK3ForConditionalGeneration.tie_weights`
takes no arguments where transformers now passes some (`tie_weights_takes_arguments`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path

import torch

from k3compile import settings
from k3compile.adapt import fla

PACKAGE = "k3compile_moonshot"
NEEDED = ("modeling_kimi_linear.py", "configuration_kimi_k3.py")


def moonshot_dir(directory: str | Path | None = None) -> Path:
    """The folder with Moonshot's files: `directory`, else K3_MOONSHOT_DIR."""
    where = directory or settings.env("K3_MOONSHOT_DIR")
    if not where:
        raise RuntimeError("K3_MOONSHOT_DIR is not set: point it at a folder holding Moonshot's "
                           f"{' and '.join(NEEDED)} (Hugging Face repo moonshotai/Kimi-K3)")
    path = Path(where).expanduser().resolve()
    missing = [name for name in NEEDED if not (path / name).exists()]
    if missing:
        raise FileNotFoundError(f"{path} lacks {missing} (K3_MOONSHOT_DIR)")
    return path


def fla_available() -> bool:
    """fla's kernels are usable: the package imports and a CUDA device exists."""
    return importlib.util.find_spec("fla") is not None and torch.cuda.is_available()


def load(name: str = "modeling_kimi_linear", directory: str | Path | None = None,
         standins: bool | None = None) -> types.ModuleType:
    """Moonshot's module `name` (modeling_kimi_linear, modeling_kimi_k3, configuration_kimi_k3),
    imported once per process. `standins`: import against k3compile's fla stand-ins (default:
    where fla's kernels are not usable)."""
    package = sys.modules.get(PACKAGE)
    path = moonshot_dir(directory) if directory or package is None else Path(package.__path__[0])
    if package is None or package.__path__ != [str(path)]:
        for key in [k for k in sys.modules if k == PACKAGE or k.startswith(PACKAGE + ".")]:
            del sys.modules[key]
        package = types.ModuleType(PACKAGE, "Moonshot's modeling files (K3_MOONSHOT_DIR)")
        package.__path__ = [str(path)]
        sys.modules[PACKAGE] = package
    full = f"{PACKAGE}.{name}"
    if full in sys.modules:
        return sys.modules[full]
    if standins is None:
        standins = not fla_available()
    if standins:
        with fla.installed():
            return importlib.import_module(full)
    return importlib.import_module(full)


def tiny_config(num_hidden_layers: int = 4, mla_layers: tuple[int, ...] = (2, 3), **overrides):
    """A `KimiLinearConfig` with K3's structure at the built-in `tiny` widths: layer 0 dense, MoE
    after; MLA at `mla_layers` (0-based), KDA elsewhere; AttnRes blocks of 3 layers."""
    config_cls = load("configuration_kimi_k3").KimiLinearConfig
    layers = range(1, num_hidden_layers + 1)
    fields = dict(
        vocab_size=512, hidden_size=256, num_hidden_layers=num_hidden_layers,
        intermediate_size=512, hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0, rms_norm_eps=1e-5, first_k_dense_replace=1,
        num_experts=16, num_experts_per_token=4, num_shared_experts=2, moe_intermediate_size=128,
        routed_expert_hidden_size=128, latent_moe_use_norm=True, moe_renormalize=True,
        moe_router_activation_func="sigmoid", routed_scaling_factor=1.0, num_expert_group=1,
        topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        mla_use_nope=True, mla_use_output_gate=True, attn_res_block_size=3,
        linear_attn_config={
            "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
            "kda_layers": [i for i in layers if i - 1 not in mla_layers],
            "full_attn_layers": [i for i in layers if i - 1 in mla_layers]},
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    fields.update(overrides)
    return config_cls(**fields)


def tiny_k3_config(**text):
    """A `KimiK3Config` (the release's `KimiK3ForConditionalGeneration`): `tiny_config(**text)` as
    its text config, a one-block vision tower (not part of decode: there so that a checkpoint
    holds the release's `vision_tower.` / `mm_projector.` tensors beside `language_model.`)."""
    configs = load("configuration_kimi_k3")
    text_config = tiny_config(**text)
    vision = configs.KimiK3VisionConfig(
        init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=2,
        vt_num_attention_heads=2, vt_num_hidden_layers=1, vt_hidden_size=64,
        vt_intermediate_size=128, qkv_hidden_size=64, text_hidden_size=text_config.hidden_size,
        _attn_implementation="eager")
    return configs.KimiK3Config(text_config=text_config, vision_config=vision,
                                pad_token_id=text_config.pad_token_id)


def model_class(model_type: str):
    """Moonshot's class for a config's `model_type`: `kimi_k3` (the release's config.json) is
    `KimiK3ForConditionalGeneration`, anything else `KimiLinearForCausalLM`."""
    if model_type == "kimi_k3":
        return load("modeling_kimi_k3").KimiK3ForConditionalGeneration
    return load().KimiLinearForCausalLM


def build(config, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Moonshot's model of `config` (`KimiLinearForCausalLM`, or `KimiK3ForConditionalGeneration`
    for a `KimiK3Config`), seeded random weights, eval mode, eager attention."""
    with compatible():
        model = model_class(config.model_type)(config)
    randomize(model, seed)
    return _eager(model.to(dtype))


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.bfloat16, group=None,
                    **kwargs):
    """Moonshot's `from_pretrained(path)` (`KimiLinearForCausalLM`, or the release's
    `KimiK3ForConditionalGeneration` when config.json says `kimi_k3`) with their classes from
    K3_MOONSHOT_DIR: what `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`
    runs, without copying their files next to the checkpoint, under `compatible()`; eval mode,
    eager attention. A `quantization_config` in config.json goes through transformers' quantizer
    as usual (compressed-tensors MXFP4 experts stay packed until the first forward).

    `group` (a process group of W > 1 ranks): this rank keeps its 1/W of every routed expert's
    intermediate rows (`compressed.shard_experts`); `adapt(model, group=group)` then sums the
    ranks' expert outputs. The rest of the model is replicated."""
    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    with compatible():
        model = model_class(model_type).from_pretrained(path, dtype=dtype, **kwargs)
    if group is not None:
        import torch.distributed as dist

        from k3compile.adapt import compressed

        compressed.shard_experts(model, dist.get_rank(group), dist.get_world_size(group))
    return _eager(model)


def _eager(model):
    """Eager attention (Moonshot's constructor selects flash-attention 2, which a CPU lacks)."""
    model.config._attn_implementation = "eager"
    text = getattr(model.config, "text_config", None)
    if text is not None:
        text._attn_implementation = "eager"
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def compatible():
    """Moonshot's code under transformers 5: `loaded_weights_kept` and
    `tie_weights_takes_arguments`. Wrap `AutoModelForCausalLM.from_pretrained(...,
    trust_remote_code=True)` in it too."""
    with loaded_weights_kept(), tie_weights_takes_arguments():
        yield


@contextlib.contextmanager
def tie_weights_takes_arguments():
    """Within the block, a model whose class overrides `tie_weights()` without transformers 5's
    arguments (`missing_keys`, `recompute_mapping`) gets them accepted and dropped: Moonshot's
    `KimiK3ForConditionalGeneration.tie_weights()` (it ties its language model's weights, which
    takes no arguments either) otherwise fails in `post_init` with a TypeError."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.post_init

    def post_init(self):
        tie = type(self).tie_weights
        if "recompute_mapping" not in inspect.signature(tie).parameters:
            self.tie_weights = lambda missing_keys=None, recompute_mapping=True: tie(self)
        original(self)

    PreTrainedModel.post_init = post_init
    try:
        yield
    finally:
        PreTrainedModel.post_init = original


@contextlib.contextmanager
def loaded_weights_kept():
    """Within the block, transformers' post-load init skips modules whose parameters were all
    loaded. Needed for Moonshot's code under transformers 5: its `_init_weights` writes
    `weight.data.normal_` (not transformers' guarded init functions), so after loading it
    re-draws every loaded Linear and Embedding weight, and fails on an MXFP4 expert (an
    `nn.Linear` without `weight`)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel._initialize_weights

    def initialize(self, sub):
        own = list(sub.parameters(recurse=False))
        if own and all(getattr(p, "_is_hf_initialized", False) for p in own):
            return
        original(self, sub)

    PreTrainedModel._initialize_weights = initialize
    try:
        yield
    finally:
        PreTrainedModel._initialize_weights = original


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Seeded weights by parameter name, at the scales the built-in model's init uses."""
    from k3compile.models.k3 import _init_param, _name_seed

    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(_name_seed(seed, name))
        _init_param(name, p, gen, None)
    return model
