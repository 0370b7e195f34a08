"""`y = k3.linear_concat(x, weights)`: one GEMM for several linears that read the same input
(spec §3.1 step 1, §3.2 step 1).

    y = x · [W_0; W_1; ...; W_{n-1}]ᵀ   [..., Σ N_i]; the caller splits it

No derived copy of a weight outlives its source (issue 20): nothing is cached. Weights that lie
back to back in one buffer (the backend's `pack` stage stores every fused group so) are one view
of it (`concatenated`): the CUDA kernel runs one GEMM over that view, which reads the parameters'
own storage, so every update of a parameter (`copy_`, `.data.copy_`, `load_state_dict`) is seen.
Where they do not (packing off, or refused: the stage logs why), `concatenated` builds the
concatenation at every call: correct, at the cost of a copy of the group's weights per step.

The CPU reference (also every non-CUDA implementation) computes one GEMM per weight and
concatenates the outputs: what the unfused graph computes, bit for bit, whatever the batch (one
GEMM over the concatenation rounds differently from separate GEMMs on CPU from 3 rows on).

Output is one tensor rather than a list: the split is a view, and consumers (the KDA decode and
MLA low-rank norm kernels) read column slices of it, as vLLM's fused in-projection does.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("k3compile")
_COPIED: set[tuple] = set()  # the groups whose per-call copy was logged (once each)


def adjacent(weights: list[torch.Tensor]) -> bool:
    """Whether the 2-D weights lie back to back, row after row, in one buffer."""
    first = weights[0]
    ptr = first.data_ptr()
    for w in weights:
        if (w.dim() != 2 or not w.is_contiguous() or w.dtype != first.dtype
                or w.device != first.device or w.shape[1] != first.shape[1]
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or w.data_ptr() != ptr):
            return False
        ptr += w.numel() * w.element_size()
    return True


def concatenated(weights: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(weights): a view where they lie back to back in one buffer, else a fresh
    concatenation (never cached: a cached copy would miss writes through `.data`, which bump no
    version counter)."""
    if adjacent(weights):
        first = weights[0].detach()
        return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]),
                                first.stride())
    key = tuple((tuple(w.shape), w.dtype, w.device) for w in weights)
    if key not in _COPIED:  # the cost a GPU profile shows as a concatenation per step
        _COPIED.add(key)
        log.warning("k3: a fused GEMM copies its %d weights (%.1f MB) on every call: they do not "
                    "lie back to back in one buffer (stage pack's log says why; shapes %s)",
                    len(weights), sum(w.nbytes for w in weights) / 1e6,
                    [tuple(w.shape) for w in weights])
    return torch.cat(weights)


def linear_concat_ref(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """One GEMM per weight, outputs concatenated: the unfused graph's values, bit for bit."""
    return torch.cat([F.linear(x, w) for w in weights], dim=-1)


@torch.library.custom_op("k3::linear_concat", mutates_args=())
def linear_concat(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x [..., D], weights [N_i, D] -> x·cat(weights)ᵀ [..., Σ N_i] in x's dtype."""
    return linear_concat_ref(x, weights)


@linear_concat.register_fake
def _(x, weights):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))
