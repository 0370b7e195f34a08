"""Backend options: `torch.compile(model, backend="k3", options={...})` or environment."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class Options:
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    strict: bool = False  # a fusion-contract shortfall raises instead of warning
    verify: bool = False  # check every rewrite numerically at compile time (K3_VERIFY=1)
    cuda_graphs: bool = True  # capture each bucket in a CUDA graph (GPU only)
    disabled_patterns: frozenset[str] = frozenset()  # names or name prefixes
    disabled_stages: frozenset[str] = frozenset()
    scratch_slot: int | None = None  # state slot for padding rows; inferred when None
    keep_graphs: bool = True  # the observer keeps each stage's graph text (for the tools)
    # What runs the graph the patterns leave: "inductor" (default), or "aten": the fused ATen
    # graph op by op, no codegen (CPU tests: Inductor's C++ build costs ~30 s per bucket there).
    executor: str = "inductor"
    # L2 bytes the `prefetch` stage budgets from (None: the GPU's own; on CPU an H200's 60 MB)
    l2_bytes: int | None = None
    # Prefetch also before side-stream joins. Off by default: on the H200 at world size 1 the
    # join hides almost nothing and the prefetch's own read cost 50-80 us (BENCHMARKS.md).
    prefetch_on_join: bool = False
    # On CUDA, fuse also the ops that have no GPU kernel yet (they then run their torch reference
    # op by op: correct, slower than Inductor on the unfused graph). Off by default; K3_FUSE_ALL=1.
    fuse_without_kernels: bool = False
    # under tensor parallelism, all-gather a fingerprint of each rank's compiled graph and fail
    # on a mismatch (k3compile.ranks)
    check_ranks: bool = True
    # Stage `shard` (TP > 1): "auto" shards a replicated MoE projection only where the weight
    # bytes it saves per rank outweigh the all-gather it adds (k3compile.shard.worth_sharding);
    # "on" shards every one it can, "off" none. K3_SHARD_MOE=on|off|auto.
    shard_moe: str = "auto"
    # Side streams (stage `streams`: the shared experts; stage `prefetch`: beside fused
    # collectives). On under both executors: the Inductor CUDA-graph test passed on the H200 and
    # the B1 yardstick went 103.5 -> 91.7 us per layer (session 6). K3_SIDE_STREAMS=1|0.
    side_streams: bool = True
    # Stage `pack`: each fused group's weights (linear_concat, moe_front) moved once into one
    # buffer, the parameters views of it, so no concatenated copy exists (k3compile.weights).
    # K3_PACK_WEIGHTS=0 turns it off.
    pack_weights: bool = True

    @classmethod
    def make(cls, options: dict[str, Any] | None = None) -> Options:
        opts = dict(options or {})
        if os.environ.get("K3_VERIFY", "") not in ("", "0"):
            opts.setdefault("verify", True)
        if os.environ.get("K3_STRICT", "") not in ("", "0"):
            opts.setdefault("strict", True)
        unknown = set(opts) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown k3 backend options {sorted(unknown)}")
        for key in ("disabled_patterns", "disabled_stages"):
            if key in opts:
                opts[key] = frozenset(opts[key])
        if "buckets" in opts:
            buckets = tuple(sorted(set(int(b) for b in opts["buckets"])))
            if not buckets or buckets[0] < 1:
                raise ValueError(f"buckets must be positive batch sizes, got {opts['buckets']}")
            opts["buckets"] = buckets
        if os.environ.get("K3_FUSE_ALL", "") not in ("", "0"):
            opts.setdefault("fuse_without_kernels", True)
        if os.environ.get("K3_SIDE_STREAMS", "") != "":
            opts.setdefault("side_streams", os.environ["K3_SIDE_STREAMS"] != "0")
        if os.environ.get("K3_PACK_WEIGHTS", "") != "":
            opts.setdefault("pack_weights", os.environ["K3_PACK_WEIGHTS"] != "0")
        if os.environ.get("K3_EXECUTOR"):
            opts.setdefault("executor", os.environ["K3_EXECUTOR"])
        if os.environ.get("K3_SHARD_MOE"):
            opts.setdefault("shard_moe", os.environ["K3_SHARD_MOE"])
        if opts.get("shard_moe", "auto") not in ("auto", "on", "off"):
            raise ValueError(f"shard_moe must be 'auto', 'on' or 'off', got {opts['shard_moe']!r}")
        if opts.get("executor", "inductor") not in ("inductor", "aten"):
            raise ValueError(f"executor must be 'inductor' or 'aten', got {opts['executor']!r}")
        return cls(**opts)

    def pattern_enabled(self, name: str) -> bool:
        return not any(name == d or name.startswith(d) for d in self.disabled_patterns)
