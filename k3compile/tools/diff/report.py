"""The diff report as data: plain values, so that it crosses process boundaries (at world size
> 1 rank 0's report is pickled back to the parent), and the few formatting helpers that the
analysis and both renderings share."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence

from k3compile.rewrite import Hit
from k3compile.stages.contract import NO_LAYER


@dataclasses.dataclass
class DrawNode:
    name: str
    label: str
    inputs: tuple[str, ...]  # the launches it reads, through views
    type: str
    status: str  # "kept", "removed" (before only), "new" (after only)


@dataclasses.dataclass
class Miss:
    """A near miss of one layer: the engine's record (`rewrite.NearMiss`), or one that
    `near_miss.explain` found where the contract fell short and the engine recorded none."""

    layer: int
    module: str
    node: str
    pattern: str
    reason: str  # which node, which condition
    kind: str  # the reason without node names and sizes: what groups sites in the terminal
    source: str  # "engine", or "diff" (found by this tool)

    @property
    def family(self) -> str:
        return self.pattern.split("[")[0].split(" ")[0]


@dataclasses.dataclass
class PrefetchPoint:
    op: str
    module: str
    weights: list[str]  # parameter names where known
    nbytes: int | None
    before: str  # the wait or fused collective it overlaps
    stream: int = 0  # a side stream where it runs beside a fused collective

    def text(self, limit: int | None = None) -> str:
        names = [w.replace("language_model.model.", "") for w in self.weights]
        shown = ", ".join(names[:limit]) + (f", +{len(names) - limit} more"
                                            if limit and len(names) > limit else "")
        size = f", {self.nbytes / 2**20:.2f} MiB" if self.nbytes is not None else ""
        where = ""
        if self.before:  # a side-stream prefetch runs beside its collective, not before it
            where = (f" beside {self.before} on stream {self.stream}" if self.stream
                     else f" before {self.before}")
        return f"{self.op}{where} @ {self.module}: {len(names)} weights{size} ({shown})"


@dataclasses.dataclass
class LayerInfo:
    index: int
    reads_as: str  # dense / kda_moe / mla_moe / last, from the input graph's structure
    contract_template: str  # what the contract checked (the graph as it entered stage fuse)
    wl_before: str
    wl_after: str
    ops_before: Counter
    ops_after: Counter
    kernels_before: int
    kernels_after: int
    fused: Counter  # k3 op -> count
    hits: list[Hit]
    near_misses: list[Miss]
    reverted: list[str]  # rewrites undone by verify mode: "pattern @ module: error"
    expected: dict[str, int]
    shortfall: dict[str, int]
    streams: Counter  # (stream, op) -> count, side streams only
    sync_ops: list[str]  # fork/join/event ops: "op @ module"
    prefetch: list[PrefetchPoint]


@dataclasses.dataclass
class Template:
    id: str
    name: str  # what most of its layers read as (dense, kda_moe, mla_moe, last)
    layers: list[int]
    wl: str
    representative: int


@dataclasses.dataclass
class StageRow:
    name: str
    seconds: float
    ops_before: int
    ops_after: int


@dataclasses.dataclass
class StageDiff:
    a: str
    b: str
    histogram: list[tuple[str, int, int]]
    unified: list[str]


@dataclasses.dataclass
class BucketReport:
    bucket: int | None
    met: bool
    stages: list[StageRow]
    layers: dict[int, LayerInfo]
    outside: LayerInfo
    templates: list[Template]
    deviations: dict[int, list[str]]
    drawings: dict[int, tuple[list[DrawNode], list[DrawNode]]]
    has_before: bool
    stage_texts: dict[str, str]
    stage_diff: StageDiff | None = None
    deferred: dict[str, str] = dataclasses.field(default_factory=dict)  # op -> why not fused
    pack: str = ""  # stage `pack`'s summary (fused groups' weights stored as one buffer)
    status: str = ""  # the contract's: "met", "NOT met", "no K3 layer found" ("": from `met`)
    verified: tuple[int, int] | None = None  # verify mode: (rewrites verified, reverted)

    @property
    def verdict(self) -> str:
        return self.status or ("met" if self.met else "NOT met")


@dataclasses.dataclass
class DiffReport:
    source: str
    batches: list[int]
    T: int
    world_size: int
    executor: str
    symbol: str | None
    guards: dict[int, str]
    graphs: int  # Dynamo graphs compiled (more than one: graph breaks)
    seconds: float
    buckets: list[BucketReport]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def met(self) -> bool:
        return all(b.met for b in self.buckets)

    @property
    def verdict(self) -> str:
        """"met", "NOT met", or "no K3 layer found" where no bucket's graph holds one."""
        if self.buckets and all(b.verdict == NO_LAYER for b in self.buckets):
            return NO_LAYER
        return "met" if self.met else "NOT met"

    @property
    def exit_code(self) -> int:
        return 0 if self.met else 1


def pretty(op: str) -> str:
    return re.sub(r"<built-in function (\w+)>", r"\1", op)


def ranges(xs: Sequence[int]) -> str:
    """[1, 2, 4, 5, 6] -> '1-2,4-6'."""
    xs, parts, i = sorted(xs), [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def hist_rows(a: Counter, b: Counter, changed_only: bool) -> list[tuple[str, int, int]]:
    rows = [(op, a[op], b[op]) for op in set(a) | set(b) if not changed_only or a[op] != b[op]]
    return sorted(rows, key=lambda r: (-abs(r[2] - r[1]), -r[1], r[0]))
