"""Which k3 ops have a CUDA kernel in this process, and that kernel's limits.

Kernels register themselves here (`k3compile.kernels.register_all` on a GPU machine with the DSL);
patterns and stages ask here, so no pattern imports a kernel module:

    register_kernel("moe_experts", refusal=fn)   # fn(*op tensor arguments or metas) -> reason | None
    kernel_refusal("moe_experts", *metas)        # None: the kernel takes these shapes
    cuda_ops()                                   # ops that run a kernel (or a native reference)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

Refusal = Callable[..., "str | None"]


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    op: str
    refusal: Refusal | None = None  # the kernel's own limits beyond the op's constraints
    native: bool = False  # the op's torch reference is what a GPU should run (no kernel of ours)


_entries: dict[str, KernelEntry] = {}


def register_kernel(op: str, *, refusal: Refusal | None = None, native: bool = False) -> None:
    _entries[op] = KernelEntry(op, refusal, native)


def unregister_kernel(op: str) -> None:
    _entries.pop(op, None)


def kernel_refusal(op: str, *args, **kwargs) -> str | None:
    """Why the CUDA kernel of `k3.<op>` would not take these arguments (tensors or metas)."""
    entry = _entries.get(op)
    if entry is None:
        return f"no CUDA kernel registered for k3.{op}"
    return entry.refusal(*args, **kwargs) if entry.refusal is not None else None


def cuda_ops() -> frozenset[str]:
    return frozenset(_entries)


def entry(op: str) -> KernelEntry | None:
    return _entries.get(op)
