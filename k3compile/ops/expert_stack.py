"""`w = k3.expert_stack(parts)`: the per-expert tensors of a routed-expert layer ([O, W] each,
e.g. `experts.{e}.gate_proj.weight_packed` of an `nn.ModuleList`) as one stacked [E, O, W]
tensor, the form our model's experts have and `k3.moe_experts` reads (no math).

Where the parts lie back to back in one buffer (stage `pack` stores them so) the result is a view
of it: no copy, no launch. Otherwise it is `torch.stack(parts)`, a copy of every expert per call:
slow, but it reads the parts as they are now, so it is never stale. The check is made on every
call (E pointer comparisons), so a part rebound after packing (`param.data = ...`) makes the next
call copy, not read the old buffer; under a CUDA graph, whose replays skip Python, the backend
captures the step again when a weight input moved since capture.

A `torch.library` custom op may not return a view of its inputs, so the op is declared with an
alias annotation (`Tensor(a)[] -> Tensor(a)`), as `k3.stream_join` is; stage `canonicalize`
inserts it into the functional graph, after functionalisation.
"""

from __future__ import annotations

import torch

_lib = torch.library.Library("k3", "FRAGMENT")
_lib.define("expert_stack(Tensor(a)[] parts) -> Tensor(a)")


def back_to_back(parts: list[torch.Tensor]) -> bool:
    """Whether the parts lie one after the other, contiguous, in one storage."""
    first = parts[0]
    if not first.is_contiguous():
        return False
    storage, ptr, nbytes = first.untyped_storage().data_ptr(), first.data_ptr(), first.nbytes
    for i, p in enumerate(parts):
        if (p.shape != first.shape or p.dtype != first.dtype or p.device != first.device
                or not p.is_contiguous() or p.untyped_storage().data_ptr() != storage
                or p.data_ptr() != ptr + i * nbytes):
            return False
    return True


def expert_stack(parts: list[torch.Tensor]) -> torch.Tensor:
    if back_to_back(parts):
        first = parts[0].detach()
        return first.as_strided((len(parts), *first.shape), (first.numel(), *first.stride()))
    return torch.stack(parts)


def _fake(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts)


_lib.impl("expert_stack", expert_stack, "CompositeExplicitAutograd")
_lib.impl("expert_stack", _fake, "Meta")
