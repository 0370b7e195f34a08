"""The observer: one wrapper around every pipeline stage that records wall time, op histograms
before/after, a printed copy of the graph and the rewrite report, per bucket. The fusion
contract reads what it records; tools subscribe to it (`Observer.subscribe`) to see every
stage as it runs, e.g. the graph a bucket enters the pipeline with (the stages rewrite it in
place). It also hands each stage's graphs and rewrites to torch's logging (`k3compile.logs`:
TORCH_LOGS artifacts k3_graphs / k3_fusion, TORCH_TRACE)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import fx

from k3compile import logs
from k3compile.rewrite import RewriteReport

if TYPE_CHECKING:
    from k3compile.stages import Context

log = logging.getLogger("k3compile")
logs.register()  # the names TORCH_LOGS and set_logs take ("k3", "k3_fusion", ...)


@dataclasses.dataclass
class StageRecord:
    name: str
    seconds: float
    ops_before: collections.Counter
    ops_after: collections.Counter
    graph_after: str


def op_histogram(graph: fx.Graph) -> collections.Counter:
    return collections.Counter(
        str(n.target).replace("aten.", "").replace(".default", "")
        for n in graph.nodes if n.op == "call_function")


@dataclasses.dataclass(frozen=True)
class StageEvent:
    """What a subscriber sees, twice per stage: before it runs (`record` None; `gm` the graph it
    receives) and after (`record` the stage's record; `gm` the graph it returned). The graph is
    the pipeline's own, rewritten in place by later stages: copy what you keep."""

    observer: Observer
    batch: int | None  # the bucket being compiled
    stage: str
    gm: fx.GraphModule
    record: StageRecord | None = None
    first: bool = False  # before the bucket's first stage: `gm` is the graph the pipeline received


Listener = Callable[[StageEvent], None]


class Observer:
    """Records every stage of every compiled bucket: time, op histograms, graph text; calls the
    subscribed listeners around each stage."""

    _listeners: ClassVar[list[Listener]] = []

    def __init__(self, keep_graphs: bool = False):
        self.keep_graphs = keep_graphs
        self.records: dict[int | None, list[StageRecord]] = collections.defaultdict(list)
        self.reports: dict[int | None, RewriteReport] = {}
        self.notes: dict[int | None, dict[str, Any]] = {}  # what each stage reported, by bucket
        self.graphs: dict[int | None, fx.Graph] = {}  # the final graph of each bucket
        # Dynamo's compile of the frame (the backend makes its observer inside it); buckets
        # compile later, outside it, and their structured logs name this one
        self.compile_id = torch._guards.CompileContext.current_compile_id()

    @classmethod
    @contextlib.contextmanager
    def subscribe(cls, listener: Listener) -> Iterator[Listener]:
        """Call `listener(event)` before and after every stage that any Observer of this process
        runs while the block is open (the backend makes its observers inside `torch.compile`, so
        the subscription is per process, not per observer). Yields the listener."""
        cls._listeners.append(listener)
        try:
            yield listener
        finally:
            cls._listeners.remove(listener)

    def _notify(self, event: StageEvent) -> None:
        for listener in list(self._listeners):
            listener(event)

    def run(self, name: str, stage: Callable, gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
        first = not self.records.get(ctx.batch)
        if first:
            logs.stage_graph(name, "before", gm, ctx, None, self.compile_id)
        self._notify(StageEvent(self, ctx.batch, name, gm, first=first))
        before = op_histogram(gm.graph)
        t0 = time.perf_counter()
        gm = stage(gm, ctx) or gm
        seconds = time.perf_counter() - t0
        text = gm.print_readable(print_output=False) if self.keep_graphs else ""
        record = StageRecord(name, seconds, before, op_histogram(gm.graph), text)
        self.records[ctx.batch].append(record)
        self._notify(StageEvent(self, ctx.batch, name, gm, record))
        log.debug("stage %s (batch %s): %.3fs", name, ctx.batch, seconds)
        logs.stage_graph(name, "after", gm, ctx, seconds, self.compile_id, text or None)
        logs.stage_report(name, ctx, self.compile_id)
        return gm

    def stage(self, name: str, batch: int | None = None) -> StageRecord:
        batch = batch if batch in self.records else next(iter(self.records), None)
        for rec in self.records[batch]:
            if rec.name == name:
                return rec
        raise KeyError(f"no stage {name!r} recorded (stages: {[r.name for r in self.records[batch]]})")
