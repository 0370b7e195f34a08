"""The tensor-parallel all-reduce of the fused ops' CUDA paths, algorithm chosen by message size.

    one_shot   every rank copies its input into its symmetric-memory buffer, a barrier, then
               every rank reads all W buffers over NVLink and sums them (one kernel,
               `symm_mem.one_shot_all_reduce_copy`). Lowest latency for small messages: one
               hop, W× the bytes read.
    two_shot   reduce-scatter then all-gather through the same buffer (`two_shot_all_reduce_out`,
               after a copy into the buffer): 2 hops, each rank reads 2× its share. Mid sizes.
    nccl       `_c10d_functional.all_reduce` (NCCL's own choice of ring / tree). Large sizes and
               every case the symmetric-memory path cannot take.

Decode messages are N rows × 7168 bf16 (14 KB per row: 14 KB .. 0.9 MB over the buckets), so
the choice is made per bucket by `algorithm(nbytes, world)`; `K3_ALLREDUCE=nccl|one_shot|two_shot`
forces one (benchmarks). Collectives stay on the caller's stream (the main stream). NVLink
multicast stays off: `TORCH_SYMM_MEM_DISABLE_MULTICAST=1` is set before the first buffer.

The symmetric buffer is one per (group, device, dtype), sized for the largest message seen
(at least `MIN_ROWS_BYTES`), allocated and rendezvoused on first use: a collective, so every rank
reaches it at the same call — the ranks run the same compiled graph (stage `ranks` checks) and
the first call of a bucket runs before its CUDA-graph capture. Where symmetric memory is
unavailable (no P2P, an old torch, a CPU group), the NCCL path runs and the reason is logged once.
"""

from __future__ import annotations

import logging

import torch

from k3compile.settings import ALLREDUCE_ALGORITHMS, KERNELS, torch_env_default

log = logging.getLogger("k3compile.kernels")

c10d = torch.ops._c10d_functional
ALGORITHMS = ALLREDUCE_ALGORITHMS
# Largest message (bytes) per algorithm at world size 2..8 on the H200's NVLink; larger goes to
# the next. World size 2 measured by benchmarks/allreduce.py (BENCHMARKS.md, 2026-11-29: one-shot
# fastest at every decode bucket, 8.0 µs at 14 KB .. 15.3 µs at 0.9 MB, NCCL 12.2 .. 17.6);
# 4 and 8 are estimates until those machines are lent (one-shot reads W× the bytes).
ONE_SHOT_MAX = {2: 2 * 1024 * 1024, 4: 256 * 1024, 8: 128 * 1024}
TWO_SHOT_MAX = {2: 0, 4: 2 * 1024 * 1024, 8: 2 * 1024 * 1024}
MIN_BUFFER_BYTES = 64 * 14336  # 64 rows of 7168 bf16: every decode bucket in one buffer

_buffers: dict[tuple[str, str, torch.dtype], torch.Tensor] = {}
_unavailable: dict[str, str] = {}


def algorithm(nbytes: int, world: int) -> str:
    if forced := KERNELS.allreduce:
        return forced
    w = min((k for k in ONE_SHOT_MAX if k >= world), default=8)
    if nbytes <= ONE_SHOT_MAX[w]:
        return "one_shot"
    if nbytes <= TWO_SHOT_MAX[w]:
        return "two_shot"
    return "nccl"


def _symmetric_buffer(x: torch.Tensor, group_name: str) -> torch.Tensor | None:
    """This rank's symmetric buffer holding at least x.numel() elements, or None (logged)."""
    if group_name in _unavailable:
        return None
    key = (group_name, str(x.device), x.dtype)
    buf = _buffers.get(key)
    if buf is not None and buf.numel() >= x.numel():
        return buf
    try:
        torch_env_default("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        from torch.distributed import _symmetric_memory as symm_mem

        numel = max(x.numel(), MIN_BUFFER_BYTES // x.element_size())
        buf = symm_mem.empty(numel, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, group_name)
    except (RuntimeError, ImportError, AttributeError, NotImplementedError) as e:
        _unavailable[group_name] = f"{type(e).__name__}: {e}"
        log.warning("symmetric memory unavailable for group %s (%s): all-reduce runs on NCCL",
                    group_name, _unavailable[group_name])
        return None
    _buffers[key] = buf
    return buf


def all_reduce(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """sum over the group of x (contiguous), on the current stream."""
    algo = algorithm(x.numel() * x.element_size(), world) if x.is_cuda else "nccl"
    if algo != "nccl":
        buf = _symmetric_buffer(x, group_name)
        if buf is not None:
            flat = x.reshape(-1)
            if algo == "one_shot":
                out = torch.ops.symm_mem.one_shot_all_reduce_copy(
                    buf[: flat.numel()], flat, "sum", group_name)
            else:
                staged = buf[: flat.numel()]
                staged.copy_(flat)
                out = torch.ops.symm_mem.two_shot_all_reduce_out(
                    staged, "sum", group_name, torch.empty_like(flat))
            return out.view(x.shape)
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))
