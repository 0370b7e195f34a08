"""One cell of the differential suite: a K3 spelling under backend="k3" against its eager twin.

A cell is (spelling, dtype, T, world size, buckets, seed, steps). The spelling is built twice
with one seed (equal weights, separately owned state); one copy is compiled (fullgraph,
executor "aten", batch marked dynamic) and both run the same seeded request schedule
(`schedule.py`). After every step the logits and every state buffer (every real slot; the
scratch slot is where padding rows write, by design) are compared, and so is every other
buffer. The first tensor over the cell's tolerance stops the cell with a `CellFailure` naming
the cell, the step, the tensor and its max relative error (max|a - b| / max|b|).

World size 2 runs the cell in 2 gloo processes (`run_tp`), each rank holding its TP shard of
both copies; every rank must agree. `run_tp` takes several cells of one world size and runs them
in one pair of processes, one after another (a process start, the imports and the pattern traces
once, not per cell); after a failed cell the ranks' collectives are out of step, so the cells
after it run in fresh processes.

The cell also checks that the comparison compared something: every step ran a compiled bucket
(none fell back to Dynamo's graph), and the compiled graphs hold fused k3 ops.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback

import torch

import k3compile.backend as k3be
from k3compile.models import get_config
from tests import gloo
from tests.conftest import TOL, rel_err
from tests.diffsuite.schedule import schedule
from tests.diffsuite.spellings import SPELLINGS, reset_slot, state_buffers

# The tiny config with 4 layers: every layer template (dense, kda_moe, mla_moe, last) once.
CONFIG = dataclasses.replace(get_config("tiny"), num_hidden_layers=4, full_attn_layers=(2, 3))
MAX_SEQ_LEN = 64
SPARE_SLOTS = 2  # slots beyond the largest bucket: requests that wait while others run

# The tolerance per dtype, from the one table (tests/conftest.py TOL; bf16: see its entry)
TOLERANCE = {torch.float32: TOL["aten_cpu"], torch.bfloat16: TOL["diffsuite_bf16"]}


@dataclasses.dataclass(frozen=True)
class Cell:
    spelling: str
    dtype: torch.dtype
    T: int
    world: int
    buckets: tuple[int, ...]
    seed: int = 0
    steps: int = 50
    # the smallest batch drawn; 2 leaves out batch 1, which Dynamo specialises into a graph of
    # its own (a second compile: the bounded cells cannot afford it)
    min_rows: int = 1

    @property
    def id(self) -> str:
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[self.dtype]
        buckets = "-".join(map(str, self.buckets))
        rows = "" if self.min_rows == 1 else f"-r{self.min_rows}"
        return (f"{self.spelling}-{dtype}-T{self.T}-w{self.world}-b{buckets}{rows}-s{self.seed}"
                f"-n{self.steps}")

    @property
    def max_batch(self) -> int:
        return max(self.buckets) + SPARE_SLOTS

    def skip_reason(self) -> str | None:
        return SPELLINGS[self.spelling].skip(self.world)


class CellFailure(AssertionError):
    pass


@dataclasses.dataclass
class CellResult:
    cell: Cell
    worst: dict[str, float]  # tensor kind ("logits", buffer leaf name) -> max rel error seen
    fused_ops: int
    buckets_run: dict[int, int]
    seconds: float = 0.0  # wall time of the cell (the build, the compiles, the steps)

    def summary(self) -> str:
        errs = ", ".join(f"{k} {v:.2e}" for k, v in sorted(self.worst.items()))
        return (f"{self.cell.id}: worst {errs}; {self.fused_ops} fused ops; runs "
                f"{self.buckets_run}; {self.seconds:.0f} s")


def _mark_batch(*tensors):
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _fused_ops(compiled: list) -> int:
    return sum(len(report.hits) for c in compiled for report in c.observer.reports.values())


def _compare(cell: Cell, step, got, want, eager, model, worst: dict[str, float]):
    tol = TOLERANCE[cell.dtype]
    slots = cell.max_batch + 1
    pairs = [("logits", got, want)]
    mine = dict(model.named_buffers())
    states = state_buffers(eager, slots)
    for name, buf in eager.named_buffers():
        rows = slice(0, cell.max_batch) if name in states else slice(None)
        pairs.append((name, mine[name][rows], buf[rows]))
    for name, a, b in pairs:
        if a.dtype == torch.uint8 or not a.is_floating_point():
            err = 0.0 if torch.equal(a, b) else float("inf")
        else:
            err = rel_err(a, b)
        kind = name.rsplit(".", 1)[-1]
        worst[kind] = max(worst.get(kind, 0.0), err)
        if not err <= tol:  # NaN fails too
            raise CellFailure(f"{cell.id}: step {step.index} ({step.describe()}): {name} max rel "
                              f"error {err:.3e} > {tol:.0e}")


def run_cell(cell: Cell, group=None) -> CellResult:
    """Run `cell` in this process (world size 1, or one rank of `run_tp`)."""
    if reason := cell.skip_reason():
        raise ValueError(f"{cell.id} cannot run: {reason}")
    start = time.perf_counter()
    torch._dynamo.reset()
    cfg = CONFIG.with_tp(cell.world) if cell.world > 1 else CONFIG
    build = SPELLINGS[cell.spelling].build
    args = (cfg, cell.dtype, group, cell.max_batch, MAX_SEQ_LEN, cell.seed)
    eager, model = build(*args), build(*args)
    first = len(k3be._compiled)
    step_fn = torch.compile(model, backend="k3", fullgraph=True,
                            options={"executor": "aten", "buckets": cell.buckets})
    worst: dict[str, float] = {}
    plan = schedule(cell.seed, cell.steps, max_batch=cell.max_batch, T=cell.T,
                    rows=(cell.min_rows, max(cell.buckets)), max_seq_len=MAX_SEQ_LEN,
                    vocab=cfg.vocab_size)
    with torch.no_grad():
        for step in plan:
            for slot in step.started:
                reset_slot(eager, cell.max_batch + 1, slot)
                reset_slot(model, cell.max_batch + 1, slot)
            _mark_batch(step.input_ids, step.positions, step.slots)
            got = step_fn(step.input_ids, step.positions, step.slots)
            want = eager(step.input_ids, step.positions, step.slots)
            _compare(cell, step, got, want, eager, model, worst)
    compiled = k3be._compiled[first:]
    runs = {}
    for c in compiled:
        for entry in c.buckets.values():
            runs[entry.batch] = runs.get(entry.batch, 0) + entry.runs
    if sum(runs.values()) != cell.steps:
        raise CellFailure(f"{cell.id}: {sum(runs.values())} of {cell.steps} steps ran a compiled "
                          f"bucket ({runs}); the rest ran Dynamo's graph uncompiled")
    result = CellResult(cell, worst, _fused_ops(compiled), runs, time.perf_counter() - start)
    if result.fused_ops == 0:
        raise CellFailure(f"{cell.id}: the compiled graphs hold no fused k3 op")
    return result


# ---- world size 2: one gloo process per rank -----------------------------------------------------


def _outcome_path(out_dir: str, cell: Cell, rank: int) -> str:
    return os.path.join(out_dir, f"{cell.id}.rank{rank}.pt")


def _worker(rank: int, cells: list[Cell], out_dir: str):
    import torch.distributed as dist

    for cell in cells:
        try:
            outcome = run_cell(cell, dist.group.WORLD)
        except Exception:  # reported by the parent, with the rank; the peers may be inside a
            torch.save(traceback.format_exc(), _outcome_path(out_dir, cell, rank))  # collective
            raise  # of this cell, so the spawn ends them (tests/gloo.py)
        torch.save(outcome, _outcome_path(out_dir, cell, rank))


def run_tp(cells: list[Cell], out_dir: str) -> dict[str, list[CellResult] | CellFailure]:
    """Run `cells` (one world size) on `world` gloo processes: per cell id, every rank's result,
    or a `CellFailure` naming the failing ranks. The cells after a failed one run in new
    processes."""
    world = cells[0].world
    assert all(c.world == world for c in cells), [c.id for c in cells]
    done: dict[str, list[CellResult] | CellFailure] = {}
    todo = list(cells)
    while todo:
        for cell in todo:  # a rank that dies before it reports must not read as an old outcome
            for rank in range(world):
                if os.path.exists(path := _outcome_path(out_dir, cell, rank)):
                    os.remove(path)
        spawn_error = None
        try:
            gloo.spawn(_worker, todo, out_dir, world=world)
        except Exception as error:  # noqa: BLE001 - the failing rank's outcome file says where
            spawn_error = error
        ran = 0
        for cell in todo:
            outcomes = {rank: torch.load(path, weights_only=False) for rank in range(world)
                        if os.path.exists(path := _outcome_path(out_dir, cell, rank))}
            failed = {rank: o for rank, o in outcomes.items() if isinstance(o, str)}
            if not failed and len(outcomes) < world:
                break
            ran += 1
            if not failed:
                done[cell.id] = [outcomes[rank] for rank in range(world)]
                continue
            # every failing rank's last line first, then the tracebacks
            lines = [f"rank {rank}: {tb.strip().splitlines()[-1]}" for rank, tb in failed.items()]
            done[cell.id] = CellFailure("\n".join(lines + list(failed.values())))
            break
        if ran == 0:
            raise CellFailure(f"{todo[0].id}: no rank reported an outcome") from spawn_error
        todo = todo[ran:]
    return done


def run(cell: Cell, out_dir: str) -> list[CellResult]:
    if cell.world == 1:
        return [run_cell(cell)]
    outcome = run_tp([cell], out_dir)[cell.id]
    if isinstance(outcome, CellFailure):
        raise outcome
    return outcome
