"""Routed experts loaded through transformers' compressed-tensors integration, as the release
ships them: `quantization_config` format `mxfp4-pack-quantized`, weights FP4 (E2M1) in groups of
32 with an E8M0 scale per group. Each expert projection is then an `nn.Linear` without `weight`,
holding `weight_packed` uint8 [out, in/2] and `weight_scale` uint8 [out, in/32].

compressed-tensors' layout (compressors/nvfp4/helpers.py `pack_fp4_to_uint8` /
`unpack_fp4_from_uint8`, compressors/mx_utils.py) is the one `k3.moe_experts` takes: input 2j
in the low nibble of byte j, 2j + 1 in the high nibble; a nibble is sign (bit 3) and the E2M1
magnitude index (bits 0-2); a scale byte s is 2^(s - 127). The adapter's expert loop dequantises
in compressed-tensors' own spelling (`dequant`: a magnitude table, a sign, the group scale);
stage `canonicalize` proves it equal to the canonical dequant bit for bit (rule
`mxfp4_dequant`), stacks the per-expert tensors as a view (rule `expert_stack`, stage `pack`),
and the experts fuse into `k3.moe_experts`. No dequantised copy is kept anywhere.

A projection quantised any other way (another group size, NVFP4's FP8 scales and global scale, a
zero point, scales not uint8, or a packed/scale shape that is not [out, in/2] / [out, in/32]) is
refused when adapting (`UnsupportedExperts`), never run through this layout. Experts that
compressed-tensors has already decompressed (the loaded model's first forward does that, in
place, and wraps every module for offloading) are refused (`check_not_wrapped`): adapt the
freshly loaded model. Experts quantised but dense (not compressed) run unfused, with a warning.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

FORMAT = "mxfp4-pack-quantized"
GROUP = 32
# compressed-tensors' E2M1 magnitudes by index (nvfp4/helpers.py kE2M1ToFloat)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class UnsupportedExperts(ValueError):
    """Quantised experts in a layout the adapter does not take."""


def is_quantized(linear: nn.Module) -> bool:
    """The projection carries a compressed-tensors scheme."""
    return getattr(linear, "quantization_scheme", None) is not None


def is_packed(linear: nn.Module) -> bool:
    """The projection holds compressed-tensors' packed tensors (not decompressed)."""
    return isinstance(getattr(linear, "weight_packed", None), torch.Tensor)


def refusal(linear: nn.Module) -> str | None:
    """Why a packed projection is not compressed-tensors MXFP4 as `k3.moe_experts` takes it."""
    scheme = linear.quantization_scheme
    args = scheme.weights
    fmt = getattr(scheme.format, "value", scheme.format)
    if fmt != FORMAT:
        return f"format {fmt!r}, not {FORMAT!r}"
    if args is None or args.num_bits != 4 or args.type != "float":
        return f"weights {args!r} are not 4-bit float"
    if args.group_size != GROUP or getattr(args.strategy, "value", args.strategy) != "group":
        return f"group size {args.group_size} ({args.strategy}), not groups of {GROUP}"
    if not args.symmetric or hasattr(linear, "weight_zero_point"):
        return "asymmetric (a zero point)"
    if hasattr(linear, "weight_global_scale"):
        return "a global scale (NVFP4), not E8M0 scales alone"
    if scheme.input_activations is not None:
        return "quantised activations (the op is W4A16)"
    packed, scale = linear.weight_packed, getattr(linear, "weight_scale", None)
    out, features = linear.out_features, linear.in_features
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (out, features // 2):
        return f"weight_packed {packed.dtype} {tuple(packed.shape)}, not uint8 [{out}, " \
               f"{features // 2}]"
    if scale is None or scale.dtype != torch.uint8 or \
            tuple(scale.shape) != (out, features // GROUP):
        got = None if scale is None else (scale.dtype, tuple(scale.shape))
        return f"weight_scale {got}, not uint8 [{out}, {features // GROUP}] (E8M0)"
    return None


def check_not_wrapped(model: nn.Module) -> None:
    """Refuse a model compressed-tensors has wrapped for offloading: its first forward
    decompresses the experts and swaps every module's parameters for an offload cache with a
    forward that moves tensors (`compressed_tensors.offload`), which Dynamo cannot trace."""
    wrapped = [name for name, m in model.named_modules()
               if any(c.__name__ == "OffloadCache" for c in type(m._parameters).__mro__)]
    if wrapped:
        raise UnsupportedExperts(
            f"{wrapped[0] or 'the model'} (and {len(wrapped) - 1} more modules) is wrapped by "
            "compressed-tensors' offloading, which its first forward installs while it "
            "decompresses the experts: adapt the freshly loaded model, before any forward")


def check_experts(name: str, experts: nn.ModuleList) -> bool:
    """Whether the block's experts are compressed-tensors MXFP4 (True) or dense (False); raises
    `UnsupportedExperts` for packed experts in another layout."""
    projections = [(f"{name}.{i}.{p}", getattr(e, p)) for i, e in enumerate(experts)
                   for p in ("w1", "w3", "w2")]
    packed = [(n, lin) for n, lin in projections if is_packed(lin)]
    if not packed:
        if any(is_quantized(lin) for _, lin in projections):
            warnings.warn(f"{name}: compressed-tensors experts that are not packed (decompressed) "
                          "run dense and unfused; adapt the model as loaded to keep them MXFP4",
                          stacklevel=3)
        return False
    if len(packed) != len(projections):
        raise UnsupportedExperts(f"{name}: some expert projections are packed, some are not")
    for n, lin in packed:
        if (why := refusal(lin)) is not None:
            raise UnsupportedExperts(
                f"{n}: compressed-tensors experts with {why}; k3compile.adapt takes "
                f"{FORMAT} (E2M1, E8M0 scale per {GROUP}, symmetric, weight-only)")
    return True


def dequant(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., out, in/2] uint8 + [..., out, in/32] uint8 -> [..., out, in] in dtype, as
    compressed-tensors decompresses: the low nibble first, magnitude table times sign, times
    2^(scale - 127) per group (both exact in bf16 and fp32). The magnitude table (E2M1_MAGNITUDES)
    is computed from its 3-bit codes, not held as a tensor constant: a constant becomes a
    `get_attr` of the traced graph, which the stage cache cannot key (k3compile/stage_cache.py),
    so a warm process would run every stage again."""
    codes = torch.arange(8, device=packed.device)
    exponent, half = codes >> 1, (codes & 1).to(torch.float32) * 0.5
    magnitudes = torch.where(exponent == 0, half, (1.0 + half) * torch.exp2(
        (exponent - 1).to(torch.float32)))
    nibbles = torch.stack((packed & 0x0F, (packed & 0xF0) >> 4), dim=-1).flatten(-2)
    signs = (nibbles & 0x08).to(torch.bool)
    values = (magnitudes[(nibbles & 0x07).long()] * torch.where(signs, -1.0, 1.0)).to(dtype)
    *lead, out, features = values.shape
    factor = (2.0 ** (scale.to(torch.int32) - 127).to(dtype)).unsqueeze(-1)
    return (values.view(*lead, out, features // GROUP, GROUP) * factor).view(*lead, out, features)


# w1 (gate) and w3 (up) split their output rows, w2 (down) its input columns: each rank holds
# 1/W of every expert's intermediate, and the ranks' expert outputs sum to the whole
_SPLIT = {"w1": 0, "w3": 0, "w2": 1}


@torch.no_grad()
def shard_experts(model: nn.Module, rank: int, world: int) -> nn.Module:
    """Keep this rank's 1/W of every routed expert's intermediate, in place: packed MXFP4
    (`weight_packed` [out, in/2], `weight_scale` [out, in/32]) or dense (`weight`). Packed w2
    columns come two per byte and one scale per 32, so there intermediate / W must be a
    multiple of 32: no byte or scale group straddles two ranks. Each MoE block records
    `expert_shard = (rank, world)`, which `adapt` checks against its group."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    for block in [m for m in model.modules() if type(m).__name__ == "KimiSparseMoeBlock"]:
        for expert in block.experts:
            for projection, dim in _SPLIT.items():
                _keep_part(getattr(expert, projection), dim, rank, world)
        block.expert_shard = (rank, world)
    return model


def _keep_part(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    full, packed = (linear.out_features, linear.in_features)[dim], is_packed(linear)
    part = full // world
    if full % world or (packed and part % GROUP):
        raise ValueError(f"an expert intermediate of {full} does not split over {world} ranks"
                         + (f" in whole groups of {GROUP}" if packed else ""))
    names = ("weight_packed", "weight_scale") if packed else ("weight",)
    for name in names:
        t = getattr(linear, name)
        width = t.shape[dim] // world  # packed and scale columns: in/2 and in/32 per rank
        setattr(linear, name, nn.Parameter(t.narrow(dim, rank * width, width).clone(),
                                           requires_grad=False))
    if dim == 0:
        linear.out_features = part
    else:
        linear.in_features = part
