"""The observer: one wrapper around every pipeline stage that records wall time, op histograms
before/after, a printed copy of the graph and the rewrite report, per bucket. The fusion
contract and the graph-diff tool read what it records."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from torch import fx

from k3compile.rewrite import RewriteReport

log = logging.getLogger("k3compile")


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


class Observer:
    """Records every stage of every compiled bucket: time, op histograms, graph text."""

    def __init__(self, keep_graphs: bool = True):
        self.keep_graphs = keep_graphs
        self.records: dict[int | None, list[StageRecord]] = collections.defaultdict(list)
        self.reports: dict[int | None, RewriteReport] = {}
        self.notes: dict[int | None, dict[str, Any]] = {}  # what each stage reported, by bucket
        self.graphs: dict[int | None, fx.Graph] = {}  # the final graph of each bucket

    def run(self, name: str, stage: Callable, gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
        before = op_histogram(gm.graph)
        t0 = time.perf_counter()
        gm = stage(gm, ctx) or gm
        seconds = time.perf_counter() - t0
        text = gm.print_readable(print_output=False) if self.keep_graphs else ""
        self.records[ctx.batch].append(StageRecord(name, seconds, before, op_histogram(gm.graph), text))
        log.debug("stage %s (batch %s): %.3fs", name, ctx.batch, seconds)
        return gm

    def stage(self, name: str, batch: int | None = None) -> StageRecord:
        batch = batch if batch in self.records else next(iter(self.records), None)
        for rec in self.records[batch]:
            if rec.name == name:
                return rec
        raise KeyError(f"no stage {name!r} recorded (stages: {[r.name for r in self.records[batch]]})")
