"""The release's KDA `A_log`, stored zero-padded to a multiple of 128 entries (k3_arch.md: per head
[96], stored [128]), loaded into Moonshot's `KimiDeltaAttention`, whose `A_log` is [num_heads]:
transformers refuses the padded tensor ("size mismatch"), and `ignore_mismatched_sizes` would leave
A_log at its random initialisation, a silent wrong answer.

`padded_a_log(path, classes)` reads the checkpoint's A_log shapes from the safetensors headers; when
they are padded, each KDA module is built with an A_log of the stored length for the load, and
afterwards keeps its first num_heads entries, once the rest is checked to be zero (another
padding is refused: its layout would be a guess).

Constraints:
* every A_log of the checkpoint has one padded length (the release's); mixed lengths are refused;
* the padding must be exact zeros (checked after the load, on the loaded values).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from torch import nn

SUFFIX = ".A_log"


def stored_lengths(path: str | Path) -> set[int]:
    """The lengths of the checkpoint's `*.A_log` tensors (safetensors headers only)."""
    from k3compile.models.loader import _read_weight_map, _Shards

    weight_map = _read_weight_map(Path(path))
    with _Shards(Path(path), weight_map) as shards:
        shapes = [shards.shape(name) for name in weight_map if name.endswith(SUFFIX)]
    return {shape[0] if len(shape) == 1 else -1 for shape in shapes}


@contextlib.contextmanager
def padded_a_log(path: str | Path, kda: type | None):
    """Within the block, `kda` modules are built with an A_log of the checkpoint's padded length
    (if it has one); yields a function that, given the loaded model, cuts each back to num_heads
    entries (refusing a nonzero padding). Nothing changes for a checkpoint stored per head."""
    lengths = stored_lengths(path) if kda is not None else set()
    if len(lengths) > 1:
        raise ValueError(f"checkpoint {path}: A_log tensors of several lengths {sorted(lengths)}")
    init = kda.__init__ if kda is not None else None

    def padded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        (length,) = lengths
        if length != self.A_log.numel():
            self.A_log = nn.Parameter(self.A_log.new_zeros(length))

    def cut(model: nn.Module) -> None:
        for name, module in model.named_modules():
            if isinstance(module, kda) and module.A_log.numel() != module.num_heads:
                stored = module.A_log.detach()
                tail = stored[module.num_heads:]
                if tail.numel() and bool((tail != 0).any()):
                    raise ValueError(
                        f"{name}{SUFFIX}: stored as {stored.numel()} entries for {module.num_heads} "
                        "heads with a nonzero padding (the release pads with zeros); not loaded")
                module.A_log = nn.Parameter(stored[: module.num_heads].clone(),
                                            requires_grad=module.A_log.requires_grad)

    if init is None or not lengths:
        yield lambda model: None
        return
    kda.__init__ = padded_init
    try:
        yield cut
    finally:
        kda.__init__ = init
