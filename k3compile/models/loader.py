"""Kimi K3 checkpoints in the released Hugging Face layout, and one tensor-parallel rank's slice.

The model's parameter names already are the checkpoint's (`language_model.model.layers.3....`)
except for an MoE layer's module name and two tensors the model keeps in a more convenient shape:

* an MoE layer's `mlp.` is `block_sparse_moe.` in the checkpoint (`released_name`): the attribute
  Moonshot's `KimiDecoderLayer` loads it into, router (`gate.`), shared experts and latent
  projections included; the dense layer 0 keeps `mlp.`, as theirs does;
* routed experts: the model stacks them (`mlp.experts.w1_packed` [E, I, L/2], `w1_scale`, `w3_*`,
  `w2_*`); the checkpoint stores them per expert as compressed-tensors MXFP4
  (`block_sparse_moe.experts.{e}.w1.weight_packed`, `....weight_scale`; w1 = gate, w3 = up,
  w2 = down);
* KDA `A_log`: the model holds one entry per head; the release zero-pads it to a multiple of 128
  (`save_checkpoint(pad_a_log=False)` writes it per head, the shape Moonshot's `KimiDeltaAttention`
  declares). Loading takes either; so does `k3compile.adapt.moonshot.from_pretrained`
  (`adapt/padded.py`), where transformers alone refuses the padded one.

Tensor-parallel slicing follows `../shared/k3_arch.md` §4.2 (vLLM's layout): heads and expert
intermediates are split, the low-rank latents, router and latent MoE projections replicated. One
rule table (`_split_dim`) serves both the in-memory `shard_state_dict` and `load_checkpoint`, which
reads only this rank's rows or columns of each tensor from disk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from k3compile.models.config import K3Config

INDEX_FILE = "model.safetensors.index.json"
A_LOG_PAD = 128
MOE_MODULE = "block_sparse_moe"  # an MoE layer's `mlp` in the checkpoint (Moonshot's name)
_EXPERT_PROJ = ("w1", "w3", "w2")  # gate, up, down
_EXPERT_PARTS = {"packed": "weight_packed", "scale": "weight_scale"}

_STACKED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>w[123])_(?P<part>packed|scale)$")
_LAYER = re.compile(r"^language_model\.model\.layers\.(?P<i>\d+)\.(?P<rest>.+)$")

# Dim split across ranks, by the name inside a layer; absent = replicated. Column-parallel
# projections split their output rows (0), row-parallel ones their input columns (-1). Negative
# dims so the same rule reads a stacked expert tensor and one expert's slice of it.
_KDA_SPLIT = {
    "q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "g_proj.weight": 0,
    "f_b_proj.weight": 0, "b_proj.weight": 0, "q_conv1d.weight": 0, "k_conv1d.weight": 0,
    "v_conv1d.weight": 0, "dt_bias": 0, "A_log": 0, "o_proj.weight": -1,
}  # f_a_proj (the decay's low-rank input) and o_norm (per head dim) are replicated
_MLA_SPLIT = {"q_b_proj.weight": 0, "kv_b_proj.weight": 0, "g_proj.weight": 0, "o_proj.weight": -1}
_MLP_SPLIT = {
    "shared_experts.gate_proj.weight": 0, "shared_experts.up_proj.weight": 0,
    "shared_experts.down_proj.weight": -1,
    "gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": -1,  # dense layer 0
    "experts.w1_packed": -2, "experts.w1_scale": -2, "experts.w3_packed": -2,
    "experts.w3_scale": -2, "experts.w2_packed": -1, "experts.w2_scale": -1,
}  # router, latent down/up and routed_expert_norm are replicated, as in vLLM


def _split_dim(name: str, config: K3Config) -> int | None:
    """The dim of model tensor `name` that tensor parallelism splits, None if replicated."""
    if name == "language_model.lm_head.weight":
        return 0
    m = _LAYER.match(name)
    if m is None:
        return None  # embedding, final norm, output AttnRes
    rest = m["rest"]
    if rest.startswith("self_attn."):
        table = _MLA_SPLIT if config.is_mla(int(m["i"])) else _KDA_SPLIT
        return table.get(rest.removeprefix("self_attn."))
    if rest.startswith("mlp."):
        return _MLP_SPLIT.get(rest.removeprefix("mlp."))
    return None


def _rank_range(full: int, tp_size: int, rank: int, name: str) -> tuple[int, int]:
    if full % tp_size:
        raise ValueError(f"{name}: dim of size {full} does not split over tp_size={tp_size}")
    part = full // tp_size
    return rank * part, (rank + 1) * part


def _check_rank(rank: int, tp_size: int):
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside tp_size {tp_size}")


def shard_state_dict(full_state_dict: dict[str, torch.Tensor], config: K3Config,
                     rank: int) -> dict[str, torch.Tensor]:
    """This rank's part of a full (TP=1) state dict in model names, for `config.tp_size` ranks.

    MXFP4 tensors split consistently: w2's input columns are packed two per byte and scaled one
    per 32, so a rank's packed columns are in/2/tp wide and its scale columns in/32/tp (the config
    guarantees in/tp is a multiple of 32, so no byte or scale group straddles two ranks).
    """
    tp = config.tp_size
    _check_rank(rank, tp)
    out = {}
    for name, t in full_state_dict.items():
        dim = _split_dim(name, config)
        if dim is None or tp == 1:
            out[name] = t
            continue
        lo, hi = _rank_range(t.shape[dim], tp, rank, name)
        out[name] = t.narrow(dim, lo, hi - lo).contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# checkpoint names


def released_name(name: str, config: K3Config) -> str:
    """Model tensor `name` under the checkpoint's module names: an MoE layer's `mlp.` is
    `block_sparse_moe.` (the one renaming; the expert split is `checkpoint_names`)."""
    m = _LAYER.match(name)
    if m is None or not m["rest"].startswith("mlp.") or not config.is_moe(int(m["i"])):
        return name
    return f"language_model.model.layers.{m['i']}.{MOE_MODULE}.{m['rest'].removeprefix('mlp.')}"


def _to_checkpoint(name: str, t: torch.Tensor, config: K3Config,
                   pad_a_log: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs for one model tensor."""
    if _STACKED.match(name):
        for ck, e in zip(checkpoint_names(name, t.shape[0], config), range(t.shape[0]),
                         strict=True):
            yield ck, t[e].clone()  # clone: safetensors refuses tensors that share storage
    elif name.endswith(".A_log") and pad_a_log:
        padded = t.new_zeros(-(-t.numel() // A_LOG_PAD) * A_LOG_PAD)
        padded[: t.numel()] = t.reshape(-1)
        yield name, padded
    else:
        yield released_name(name, config), t


def checkpoint_names(model_name: str, num_experts: int, config: K3Config) -> list[str]:
    """The checkpoint tensors a model tensor is read from (one, or one per expert)."""
    name = released_name(model_name, config)
    m = _STACKED.match(model_name)
    if m is None:
        return [name]
    part = _EXPERT_PARTS[m["part"]]
    prefix = name.rsplit(".", 1)[0]  # ...block_sparse_moe.experts
    return [f"{prefix}.{e}.{m['proj']}.{part}" for e in range(num_experts)]


def save_checkpoint(model: nn.Module, directory: str | Path, shard_bytes: int = 5 * 2**30,
                    pad_a_log: bool = True) -> Path:
    """Write the model as HF-style safetensors shards plus `model.safetensors.index.json`.

    Shards are filled in parameter order and closed when the next tensor would pass `shard_bytes`
    (a tensor larger than that gets a shard of its own). Tensors are saved in the model's dtypes.
    `pad_a_log=False`: KDA's A_log per head (what Moonshot's code loads), not padded as released.
    Returns the index path.
    """
    from safetensors.torch import save_file

    tp = getattr(getattr(model, "config", None), "tp_size", 1)
    if tp != 1:
        raise ValueError(f"save_checkpoint writes full tensors; this model is one of {tp} TP ranks")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, p in model.named_parameters():
        for ck_name, t in _to_checkpoint(name, p.detach(), model.config, pad_a_log):
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][ck_name] = t.contiguous().cpu()
            size += nbytes
            total += nbytes
    weight_map = {}
    n = len(shards)
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    path = directory / INDEX_FILE
    path.write_text(json.dumps(index, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# loading


def _read_weight_map(directory: Path) -> dict[str, str]:
    index = directory / INDEX_FILE
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no {INDEX_FILE} or model.safetensors in {directory}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single.name)


class _Shards:
    """Open safetensors files on demand; read whole tensors or one dim's range of them."""

    def __init__(self, directory: Path, weight_map: dict[str, str]):
        self.directory, self.weight_map = directory, weight_map
        self._open: dict[str, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()

    def _file(self, name: str):
        from safetensors import safe_open

        try:
            fname = self.weight_map[name]
        except KeyError:
            raise KeyError(f"checkpoint in {self.directory} has no tensor {name!r}") from None
        if fname not in self._open:
            self._open[fname] = safe_open(str(self.directory / fname), framework="pt").__enter__()
        return self._open[fname]

    def shape(self, name: str) -> list[int]:
        return list(self._file(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, lo: int = 0, hi: int = 0) -> torch.Tensor:
        sl = self._file(name).get_slice(name)
        if dim is None:
            return sl[:]
        nd = len(sl.get_shape())
        index = [slice(None)] * nd
        index[dim % nd] = slice(lo, hi)
        return sl[tuple(index)]


def _expected_full_shape(local: torch.Size, dim: int | None, tp: int) -> list[int]:
    shape = list(local)
    if dim is not None:
        shape[dim] *= tp
    return shape


def _load_one(shards: _Shards, name: str, local: torch.Tensor, config: K3Config,
              rank: int) -> torch.Tensor:
    """Read model tensor `name` for this rank from the checkpoint, checking shapes."""
    tp = config.tp_size
    dim = _split_dim(name, config) if tp > 1 else None
    full = _expected_full_shape(local.shape, dim, tp)

    if _STACKED.match(name):
        per_expert = full[1:]  # the split dim is negative, so it indexes one expert's tensor too
        parts = []
        for ck in checkpoint_names(name, local.shape[0], config):
            _check_shape(ck, shards.shape(ck), per_expert)
            if dim is None:
                parts.append(shards.read(ck))
            else:
                lo, hi = _rank_range(per_expert[dim], tp, rank, ck)
                parts.append(shards.read(ck, dim, lo, hi))
        return torch.stack(parts)

    if name.endswith(".A_log"):
        heads = full[0]
        if shards.shape(name) != [heads]:  # as released: padded
            _check_shape(name, shards.shape(name), [-(-heads // A_LOG_PAD) * A_LOG_PAD])
        lo, hi = _rank_range(heads, tp, rank, name) if dim is not None else (0, heads)
        return shards.read(name, 0, lo, hi)

    ck = released_name(name, config)
    _check_shape(ck, shards.shape(ck), full)
    if dim is None:
        return shards.read(ck)
    lo, hi = _rank_range(full[dim], tp, rank, ck)
    return shards.read(ck, dim, lo, hi)


def _check_shape(name: str, got: list[int], want: list[int]):
    if list(got) != list(want):
        raise ValueError(f"checkpoint tensor {name!r} has shape {list(got)}, expected {want}")


@torch.no_grad()
def load_checkpoint(model: nn.Module, directory: str | Path, rank: int = 0,
                    tp_size: int | None = None) -> nn.Module:
    """Fill `model` (a `K3ForCausalLM` of any `config.tp_size`) with its rank's part of a full
    checkpoint written by `save_checkpoint` (or the released HF layout).

    Reads only the tensors the model has, and of split tensors only this rank's range. Raises
    KeyError on a missing tensor, ValueError on a shape mismatch or a `tp_size` that disagrees
    with the model's config.
    """
    config: K3Config = model.config
    if tp_size is not None and tp_size != config.tp_size:
        raise ValueError(f"tp_size={tp_size} but the model was built for tp_size={config.tp_size}")
    _check_rank(rank, config.tp_size)
    directory = Path(directory)
    with _Shards(directory, _read_weight_map(directory)) as shards:
        for name, p in model.named_parameters():
            t = _load_one(shards, name, p, config, rank)
            if t.shape != p.shape:  # only reachable through a rule/config inconsistency
                raise ValueError(f"{name}: loaded shape {list(t.shape)} != model {list(p.shape)}")
            if t.dtype.is_floating_point != p.dtype.is_floating_point:
                raise ValueError(f"{name}: checkpoint dtype {t.dtype} cannot load into {p.dtype}")
            p.copy_(t)
    return model


__all__ = ["checkpoint_names", "load_checkpoint", "released_name", "save_checkpoint",
           "shard_state_dict"]
