"""`y = k3.linear_concat(x, weights)`: one GEMM for several linears that read the same input
(spec §3.1 step 1, §3.2 step 1).

    y = x · [W_0; W_1; ...; W_{n-1}]ᵀ   [..., Σ N_i]; the caller splits it

The concatenated weight is built once per set of weights and cached, keyed by every weight's
(data_ptr, _version, shape, dtype, device): a weight updated in place (`load_state_dict`, `copy_`)
bumps its `_version` and gets a fresh concatenation; nothing is concatenated per step. The first
call fills the cache, so under CUDA graphs the first (eager) run of a bucket, which the backend
makes before capturing, is the one that allocates; replays only read the cached weight. The cache
(`concatenated`) also serves `k3.situ_gate_up`'s [W_g; W_u].

Weights that already lie back to back in one buffer (the backend's `pack` stage,
`k3compile.stages.pack`, stores every fused group so) are returned as one view of it: no copy and
no cache entry. Otherwise the cache holds a second copy of the fused weights (KDA in-proj 46 MB per
layer per GPU at TP16).

Output is one tensor rather than a list: the split is a view, and consumers (the KDA decode and
MLA low-rank norm kernels) read column slices of it, as vLLM's fused in-projection does.
"""

from __future__ import annotations

import weakref

import torch

_CACHE: dict[tuple, tuple] = {}  # key of the weights -> (weakrefs to them, the concatenation)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter
        return 0


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage t views (t itself if it is no view): views made per call (a
    weight sliced in the graph) die at once, their owner lives as long as the weight does."""
    return t._base if t._base is not None else t


def _key(weights: list[torch.Tensor]) -> tuple:
    return tuple((w.data_ptr(), _version(w), tuple(w.shape), w.stride(), w.dtype, w.device)
                 for w in weights)


def _stale(refs, key, now) -> bool:
    """An entry is stale when one of its weights' owners is gone (its memory may be reused) or
    is one of the owners at hand in another version (updated in place since; views share their
    owner's version counter)."""
    for ref, k in zip(refs, key):
        w = ref()
        if w is None or now.get(id(w), k[1]) != k[1]:
            return True
    return False


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
    """torch.cat(weights): a view where they lie back to back in one buffer, else built on first
    use and reused while every weight lives unchanged (weights may be views, e.g. per-head slices
    of a parameter)."""
    if adjacent(weights):
        first = weights[0].detach()
        return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]),
                                first.stride())
    key = _key(weights)
    hit = _CACHE.get(key)
    if hit is not None and all(r() is not None for r in hit[0]):
        return hit[1]
    now = {id(_owner(w)): k[1] for w, k in zip(weights, key)}
    for k in [k for k, (refs, _) in _CACHE.items() if _stale(refs, k, now)]:
        del _CACHE[k]
    cat = torch.cat(weights)
    _CACHE[key] = (tuple(weakref.ref(_owner(w)) for w in weights), cat)
    return cat


def clear_cache() -> None:
    _CACHE.clear()


def linear_concat_ref(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.linear(x, concatenated(list(weights)))


@torch.library.custom_op("k3::linear_concat", mutates_args=())
def linear_concat(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x [..., D], weights [N_i, D] -> x·cat(weights)ᵀ [..., Σ N_i] in x's dtype."""
    return linear_concat_ref(x, weights)


@linear_concat.register_fake
def _(x, weights):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))
