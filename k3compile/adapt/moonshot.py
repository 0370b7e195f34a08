"""Moonshot's released modeling code, imported from where the user keeps it.

Moonshot's `modeling_kimi_linear.py` / `modeling_kimi_k3.py` (Kimi K3 License) are never part of
this repository: `K3_MOONSHOT_DIR` names a folder holding them and `configuration_kimi_k3.py`
(from the Hugging Face repo `moonshotai/Kimi-K3`). `load()` imports that folder as a package, so
the files' relative imports work, against k3compile's torch stand-ins for fla
(`k3compile.adapt.fla`, which run anywhere) or against fla's own package (its Triton kernels run
CUDA tensors only): `build` and `from_pretrained` pick fla's own only for a model on a CUDA
device where fla imports (`fla_runs_on`), so a model on the CPU never reaches fla's kernels, fla
installed or not. Both imports can live in one process (two packages, one config module).

`tiny_config` and `randomize` build the CPU test model: K3's structure at the built-in `tiny`
config's widths, seeded weights that keep activations finite (Moonshot's own init leaves
`dt_bias` and the router bias uninitialised); `tiny_k3_config` wraps it in the release's class,
`KimiK3ForConditionalGeneration` (its text model under `language_model.`, a vision tower beside).

Under transformers 5 Moonshot's code needs two shims, both in `compatible()`: its `_init_weights`
re-draws loaded weights (`loaded_weights_kept`), and `KimiK3ForConditionalGeneration.tie_weights`
takes no arguments where transformers now passes some (`tie_weights_takes_arguments`). Their
files import transformers 5.1.0's names; where a later transformers moved or changed one
(`OutputRecorder`, `check_model_inputs`, `create_causal_mask`: `stand_ins`),
`released_names()` provides it with 5.1.0's meaning while their files are imported (`load()`,
`compatible()`), and changes nothing under 5.1.0.
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

PACKAGE = "k3compile_moonshot"  # Moonshot's files against k3compile's fla stand-ins
FLA_PACKAGE = "k3compile_moonshot_fla"  # the same files against fla's own package
CONFIG = "configuration_kimi_k3"  # imports no fla: one module, shared by both packages
NEEDED = ("modeling_kimi_linear.py", f"{CONFIG}.py")


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


def fla_runs_on(device: str | torch.device) -> bool:
    """fla's kernels can run a model on `device`: a CUDA device, and fla imports (its Triton
    kernels take no CPU tensors: "Pointer argument cannot be accessed from Triton")."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("fla") is not None


def load(name: str = "modeling_kimi_linear", directory: str | Path | None = None,
         standins: bool = True) -> types.ModuleType:
    """Moonshot's module `name` (modeling_kimi_linear, modeling_kimi_k3, configuration_kimi_k3),
    imported once per process for each `standins`: against k3compile's fla stand-ins (they run
    on any device), or (False) against fla's own package."""
    current = sys.modules.get(PACKAGE)
    path = moonshot_dir(directory) if directory or current is None else Path(current.__path__[0])
    _package(PACKAGE, path)
    if standins or name == CONFIG:
        full = f"{PACKAGE}.{name}"
    else:
        _package(FLA_PACKAGE, path)
        sys.modules.setdefault(f"{FLA_PACKAGE}.{CONFIG}", load(CONFIG))
        full = f"{FLA_PACKAGE}.{name}"
    if full in sys.modules:
        return sys.modules[full]
    with released_names(), (fla.installed() if standins else contextlib.nullcontext()):
        return importlib.import_module(full)


def _package(name: str, path: Path) -> None:
    """The package `name` importing Moonshot's files from `path` (a new one, and its modules
    forgotten, where it imported another folder)."""
    package = sys.modules.get(name)
    if package is None or package.__path__ != [str(path)]:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        package = types.ModuleType(name, "Moonshot's modeling files (K3_MOONSHOT_DIR)")
        package.__path__ = [str(path)]
        sys.modules[name] = package


def tiny_config(num_hidden_layers: int = 4, mla_layers: tuple[int, ...] = (2, 3), **overrides):
    """A `KimiLinearConfig` with K3's structure at the built-in `tiny` widths: layer 0 dense, MoE
    after; MLA at `mla_layers` (0-based), KDA elsewhere; AttnRes blocks of 3 layers."""
    config_cls = load(CONFIG).KimiLinearConfig
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
    configs = load(CONFIG)
    text_config = tiny_config(**text)
    vision = configs.KimiK3VisionConfig(
        init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=2,
        vt_num_attention_heads=2, vt_num_hidden_layers=1, vt_hidden_size=64,
        vt_intermediate_size=128, qkv_hidden_size=64, text_hidden_size=text_config.hidden_size,
        _attn_implementation="eager")
    return configs.KimiK3Config(text_config=text_config, vision_config=vision,
                                pad_token_id=text_config.pad_token_id)


def model_class(model_type: str, device: str | torch.device = "cpu"):
    """Moonshot's class for a config's `model_type`: `kimi_k3` (the release's config.json) is
    `KimiK3ForConditionalGeneration`, anything else `KimiLinearForCausalLM`; imported against
    fla's own package where its kernels run on `device` (`fla_runs_on`), else the stand-ins."""
    standins = not fla_runs_on(device)
    if model_type == "kimi_k3":
        return load("modeling_kimi_k3", standins=standins).KimiK3ForConditionalGeneration
    return load(standins=standins).KimiLinearForCausalLM


def build(config, dtype: torch.dtype = torch.float32, seed: int = 0,
          device: str | torch.device = "cpu"):
    """Moonshot's model of `config` (`KimiLinearForCausalLM`, or `KimiK3ForConditionalGeneration`
    for a `KimiK3Config`) on `device` (with fla's kernels where they run there: `model_class`),
    seeded random weights (the same on every device), eval mode, eager attention."""
    with compatible():
        model = model_class(config.model_type, device)(config)
    randomize(model, seed)
    return _eager(model.to(device, dtype))


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.bfloat16, group=None,
                    device: str | torch.device = "cpu", **kwargs):
    """Moonshot's `from_pretrained(path)` (`KimiLinearForCausalLM`, or the release's
    `KimiK3ForConditionalGeneration` when config.json says `kimi_k3`) with their classes from
    K3_MOONSHOT_DIR: what `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`
    runs, without copying their files next to the checkpoint, under `compatible()`; eval mode,
    eager attention. A `quantization_config` in config.json goes through transformers' quantizer
    as usual (compressed-tensors MXFP4 experts stay packed until the first forward). KDA's
    A_log stored zero-padded, as the release stores it, is loaded per head (`padded`).

    `group` (a process group of W > 1 ranks): this rank keeps its 1/W of every routed expert's
    intermediate rows (`compressed.shard_experts`); `adapt(model, group=group)` then sums the
    ranks' expert outputs. The rest of the model is replicated.

    `device`: where the model goes (fla's kernels where they run there: `model_class`)."""
    from k3compile.adapt.padded import padded_a_log

    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    kda = load(standins=not fla_runs_on(device)).KimiDeltaAttention
    with compatible(), padded_a_log(path, kda) as cut:
        model = model_class(model_type, device).from_pretrained(path, dtype=dtype, **kwargs)
        cut(model)
    if group is not None:
        import torch.distributed as dist

        from k3compile.adapt import compressed

        compressed.shard_experts(model, dist.get_rank(group), dist.get_world_size(group))
    return _eager(model.to(device))


def _eager(model):
    """Eager attention (Moonshot's constructor selects flash-attention 2, which a CPU lacks)."""
    model.config._attn_implementation = "eager"
    text = getattr(model.config, "text_config", None)
    if text is not None:
        text._attn_implementation = "eager"
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def compatible():
    """Moonshot's code under transformers 5: `released_names` (their import),
    `loaded_weights_kept` and `tie_weights_takes_arguments`. Wrap
    `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` in it too (it imports
    their files)."""
    with released_names(), loaded_weights_kept(), tie_weights_takes_arguments():
        yield


def stand_ins(generic, capturing, masking) -> dict[str, tuple[types.ModuleType, str, object]]:
    """The transformers names Moonshot's modeling_kimi_linear.py imports (as of transformers
    5.1.0, the version it was released against) that the installed transformers no longer has
    with the meaning their code uses: {name: (module, attribute, stand-in)}, empty under 5.1.0.
    `generic`, `capturing`, `masking`: `transformers.utils.generic`,
    `transformers.utils.output_capturing` (None before 5.2.0), `transformers.masking_utils`.

    * `generic.OutputRecorder` (removed in 5.2.0, moved to `output_capturing`): their
      `_can_record_outputs` names the router logits with it, and transformers' hooks test
      `isinstance(spec, OutputRecorder)` against the moved class: the stand-in *is* that class.
    * `generic.check_model_inputs` (5.2.0 split it into `merge_with_config_defaults` and
      `capture_outputs`; the name later came back as a deprecated alias of the first alone, as in
      5.17): it decorates `KimiLinearModel.forward` for config defaults (`use_cache`), output
      capture (`_can_record_outputs`: `output_hidden_states`, `output_attentions`,
      `output_router_logits`) and `return_dict`; the stand-in applies both halves, in the order
      transformers' own models stack them.
    * `masking.create_causal_mask` (5.2.0 renamed `input_embeds` to `inputs_embeds`, deprecated;
      by 5.17 `cache_position` is gone and the mask asks the cache `get_query_offset(layer)` and
      `get_mask_sizes(query_length, layer)`, where their `KimiDynamicCache` has
      `get_mask_sizes(cache_position, layer)` and no query offset): `causal_mask` below."""
    names = {}
    if not hasattr(generic, "OutputRecorder") and capturing is not None:
        names["OutputRecorder"] = (generic, "OutputRecorder", capturing.OutputRecorder)
    if capturing is not None and hasattr(capturing, "capture_outputs"):
        merge, capture = generic.merge_with_config_defaults, capturing.capture_outputs
        names["check_model_inputs"] = (generic, "check_model_inputs",
                                       lambda forward: merge(capture(forward)))
    original = masking.create_causal_mask
    if "cache_position" not in inspect.signature(original).parameters:
        names["create_causal_mask"] = (masking, "create_causal_mask", causal_mask(original))
    return names


def causal_mask(create):
    """transformers' `create_causal_mask` (`create`, >= 5.17's signature) called as Moonshot's
    code calls it (5.1.0's: `input_embeds`, `cache_position`): their cache is asked through
    `_CachePositions`, so the query rows are `cache_position` and the key length is what their
    `get_mask_sizes(cache_position, layer)` says, as under 5.1.0. A call without those
    keywords (transformers' own models, imported while the stand-in is installed) passes through."""

    def create_causal_mask(*args, input_embeds=None, cache_position=None, **kwargs):
        if input_embeds is not None:
            kwargs["inputs_embeds"] = input_embeds
        cache = kwargs.get("past_key_values")
        if cache_position is not None and cache is not None:
            kwargs["past_key_values"] = _CachePositions(cache, cache_position)
        return create(*args, **kwargs)

    return create_causal_mask


class _CachePositions:
    """A cache seen by transformers >= 5.17's mask functions, with the query positions
    `cache_position` (5.1.0's mask took them as an argument): everything else is the cache's."""

    def __init__(self, cache, cache_position: torch.Tensor):
        self._cache, self._positions = cache, cache_position

    def get_query_offset(self, layer_idx: int = 0):
        return self._positions[0]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._cache.get_mask_sizes(self._positions, layer_idx)

    def __getattr__(self, name):
        return getattr(self._cache, name)


def transformers_modules():
    """The installed transformers' modules `stand_ins` reads: `utils.generic`,
    `utils.output_capturing` (None before 5.2.0), `masking_utils`."""
    from transformers import masking_utils
    from transformers.utils import generic

    try:
        from transformers.utils import output_capturing
    except ImportError:  # transformers < 5.2.0
        output_capturing = None
    return generic, output_capturing, masking_utils


@contextlib.contextmanager
def released_names():
    """Within the block, the transformers names Moonshot's code imports mean what they meant in
    transformers 5.1.0 (`stand_ins`); nothing changes where transformers still has them. Their
    module binds the stand-ins at import; transformers' modules are restored after."""
    missing = object()
    saved = []
    try:
        for module, attribute, stand_in in stand_ins(*transformers_modules()).values():
            saved.append((module, attribute, getattr(module, attribute, missing)))
            setattr(module, attribute, stand_in)
        yield
    finally:
        for module, attribute, value in reversed(saved):
            if value is missing:
                delattr(module, attribute)
            else:
                setattr(module, attribute, value)


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

    def initialize(self, sub, *args, **kwargs):  # 5.17 adds `is_custom_code`
        own = list(sub.parameters(recurse=False))
        if own and all(getattr(p, "_is_hf_initialized", False) for p in own):
            return
        original(self, sub, *args, **kwargs)

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
