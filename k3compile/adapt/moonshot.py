"""Moonshot's released modeling code, imported from where the user keeps it.

Moonshot's `modeling_kimi_linear.py` / `modeling_kimi_k3.py` (Kimi K3 License) are never part of
this repository: `K3_MOONSHOT_DIR` names a folder holding them and `configuration_kimi_k3.py`
(from the Hugging Face repo `moonshotai/Kimi-K3`). `load()` imports that folder as a package, so
the files' relative imports work, and where fla is not importable (any CPU machine) it imports
them against k3compile's torch stand-ins for fla (`k3compile.adapt.fla`).

`tiny_config` and `randomize` build the CPU test model: K3's structure at the built-in `tiny`
config's widths, seeded weights that keep activations finite (Moonshot's own init leaves
`dt_bias` and the router bias uninitialised).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
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


def build(config, dtype: torch.dtype = torch.float32, seed: int = 0,
          module: types.ModuleType | None = None):
    """Moonshot's `KimiLinearForCausalLM` of `config`, seeded random weights, eval mode, eager
    attention (Moonshot's constructor selects flash-attention 2, which a CPU lacks)."""
    module = module or load()
    model = module.KimiLinearForCausalLM(config)
    model.config._attn_implementation = "eager"
    randomize(model, seed)
    return model.to(dtype).eval().requires_grad_(False)


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.bfloat16,
                    module: types.ModuleType | None = None, **kwargs):
    """`KimiLinearForCausalLM.from_pretrained(path)` with Moonshot's class from K3_MOONSHOT_DIR
    (what `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` runs, without
    copying their files next to the checkpoint), under `loaded_weights_kept`; eval mode, eager
    attention. A `quantization_config` in the checkpoint's config.json goes through transformers'
    quantizer as usual (compressed-tensors MXFP4 experts stay packed until the first forward)."""
    module = module or load()
    with loaded_weights_kept():
        model = module.KimiLinearForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.config._attn_implementation = "eager"
    return model.eval().requires_grad_(False)


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
