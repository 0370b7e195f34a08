"""The differential suite (issue 20): every test spelling of K3 under backend="k3" against eager,
over seeded random request schedules, logits and every state buffer after every step.

Bounded form (the slow run): `BOUNDED`, a few cells of a few steps, one compiled graph each.
Full form (`K3_DIFFSUITE=full`, or `pytest -m diffsuite`): `FULL`, every spelling x dtype (fp32,
bf16) x T (1, 8) x world size (1, 2 over gloo) x bucket list, 50 steps each; cells a spelling
cannot run are listed as skipped with the reason (`spellings.py`).

The driver's own checks (it fails on a real difference and says where) run in the default form
too, on tensors, without compiling.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from k3compile import settings
from tests.diffsuite.driver import SPARE_SLOTS, Cell, CellFailure, _compare, run, run_cell, run_tp
from tests.diffsuite.schedule import Step, schedule
from tests.diffsuite.spellings import SPELLINGS

fp32, bf16 = torch.float32, torch.bfloat16

# One compiled graph per cell (batch 1 left out, see Cell.min_rows); batch 3 pads to bucket 4.
# The foreign spelling in fp32 (the exact bound), the built-in model in bf16 with verify rows.
BOUNDED = [
    Cell("hf", fp32, T=1, world=1, buckets=(4,), steps=6, min_rows=2),
    Cell("builtin", bf16, T=8, world=1, buckets=(4,), steps=4, min_rows=2),
]
# (buckets, min_rows): (1, 2, 4): batch 1 (Dynamo's own graph), exact buckets and padding
# 3 -> 4; (3, 8): every batch of 2..8 pads, up to 5 padding rows. Batch 1 only in the first:
# in the second it compiled the same bucket-1 graph again (a third of that cell's compiles).
BUCKET_LISTS = (((1, 2, 4), 1), ((3, 8), 2))
FULL = [Cell(s, dtype, T, world, buckets, seed=0, steps=50, min_rows=rows)
        for s, dtype, T, world, (buckets, rows) in itertools.product(
            SPELLINGS, (fp32, bf16), (1, 8), (1, 2), BUCKET_LISTS)]


# Findings: failing cells, minimised, reported to the lead (non-strict: they pass when fixed).
# None now: the fp32 spikes of session 10 came from seeded depth-mix queries of std 1 (spellings.py)
XFAIL: dict[str, str] = {}


def _params(cells, *marks):
    out = []
    for cell in cells:
        reason = cell.skip_reason()
        skip = [pytest.mark.skip(reason=reason)] if reason else []
        if cell.id in XFAIL:
            skip.append(pytest.mark.xfail(reason=XFAIL[cell.id], raises=CellFailure, strict=False))
        out.append(pytest.param(cell, id=cell.id, marks=[*marks, *skip]))
    return out


def _full_requested(config) -> bool:
    mode = (settings.env("K3_DIFFSUITE") or "bounded").strip().lower()
    if mode not in ("bounded", "full"):
        raise ValueError(f"K3_DIFFSUITE={mode!r}: expected `bounded` or `full`")
    return mode == "full" or "diffsuite" in (config.option.markexpr or "")


def _check(cell: Cell, tmp_path):
    for result in run(cell, str(tmp_path)):
        print(result.summary())


# world size > 1: the first cell of a (spelling, dtype, world) group that this session runs
# runs the group's selected cells in one pair of processes (driver.run_tp); each cell's test then
# reports its own outcome
_TP_OUTCOMES: dict[str, list | CellFailure] = {}


def _tp_group(cell: Cell, node) -> list[Cell]:
    """`cell` and the cells of its group that this session runs after it."""
    key = (cell.spelling, cell.dtype, cell.world)
    items = node.session.items
    group = [cell]
    for item in items[items.index(node) + 1:] if node in items else []:
        other = getattr(item, "callspec", None) and item.callspec.params.get("cell")
        if (getattr(item, "originalname", None) == "test_full_cell" and isinstance(other, Cell)
                and (other.spelling, other.dtype, other.world) == key
                and not other.skip_reason()):
            group.append(other)
    return group


def _check_full(cell: Cell, request, tmp_path_factory):
    if cell.world == 1:
        print(run_cell(cell).summary())
        return
    if cell.id not in _TP_OUTCOMES:
        out_dir = tmp_path_factory.mktemp(f"tp-{cell.id}")
        _TP_OUTCOMES.update(run_tp(_tp_group(cell, request.node), str(out_dir)))
    outcome = _TP_OUTCOMES.pop(cell.id)
    if isinstance(outcome, CellFailure):
        raise outcome
    for result in outcome:
        print(result.summary())


@pytest.mark.parametrize("cell", _params(BOUNDED, pytest.mark.slow))
def test_bounded_cell(cell, tmp_path):
    _check(cell, tmp_path)


@pytest.mark.parametrize("cell", _params(FULL, pytest.mark.slow, pytest.mark.diffsuite))
def test_full_cell(cell, request, tmp_path_factory):
    if not _full_requested(request.config):
        pytest.skip("the full differential suite: K3_DIFFSUITE=full or pytest -m diffsuite")
    _check_full(cell, request, tmp_path_factory)


@pytest.mark.slow
@torch.no_grad()
def test_fp32_cells_are_well_conditioned():
    """What TOL["aten_cpu"] rests on: over a full cell's schedule, eager fp32 with every embedding
    entry moved by one ulp up or down (the last-bit differences a padded bucket makes, README
    "Numerics") moves the logits by far less than the tolerance. Measured 2026-12-02: 4.4e-6;
    5.3e-5 with the depth-mix pseudo-queries drawn at std 1 (before that day)."""
    from tests.conftest import TOL, rel_err
    from tests.diffsuite.driver import CONFIG, MAX_SEQ_LEN
    from tests.diffsuite.spellings import reset_slot

    cell = Cell("builtin", fp32, T=1, world=1, buckets=(3, 8))
    build = SPELLINGS["builtin"].build
    base, nudged = (build(CONFIG, fp32, None, cell.max_batch, MAX_SEQ_LEN, 0) for _ in range(2))
    gen = torch.Generator().manual_seed(1)
    table = nudged.language_model.model.embed_tokens.weight
    away = (torch.randint(0, 2, table.shape, generator=gen) * 2 - 1) * float("inf")
    table.copy_(torch.nextafter(table, away))
    worst = 0.0
    for step in schedule(0, 50, max_batch=cell.max_batch, rows=(1, 8), max_seq_len=MAX_SEQ_LEN,
                         T=1, vocab=CONFIG.vocab_size):
        for model in (base, nudged):
            for slot in step.started:
                reset_slot(model, cell.max_batch + 1, slot)
        args = (step.input_ids, step.positions, step.slots)
        worst = max(worst, rel_err(nudged(*args), base(*args)))
    print(f"logits moved by {worst:.2e}")
    assert worst <= TOL["aten_cpu"] / 10, worst


# ---- the driver's own checks (no compile) --------------------------------------------------------


def _plan(T: int, steps: int = 200, rows=(1, 4), max_batch: int = 6, max_seq_len: int = 64):
    return list(schedule(3, steps, max_batch=max_batch, rows=rows, max_seq_len=max_seq_len, T=T,
                         vocab=512))


@pytest.mark.parametrize("T", [1, 8])
def test_schedule_is_a_real_request_stream(T):
    position: dict[int, int] = {}
    starts = finishes = waits = 0
    for step in _plan(T):
        for s in step.finished:
            position.pop(s)
        for s in step.started:
            assert s not in position, f"step {step.index}: slot {s} started while in use"
            position[s] = 0
        slots = step.slots.tolist()
        assert len(set(slots)) == len(slots) and all(0 <= s < 6 for s in slots), step.describe()
        assert step.input_ids.shape == ((len(slots),) if T == 1 else (len(slots), T))
        for s, p in zip(slots, step.positions.tolist()):
            assert p == position[s] and 0 <= p <= 64 - T, step.describe()
            position[s] += T
        starts, finishes = starts + len(step.started), finishes + len(step.finished)
        waits += len(position) > len(slots)
    assert starts > 20 and finishes > 20 and waits > 20, (starts, finishes, waits)


def test_schedule_draws_every_batch_size_and_is_seeded():
    sizes = {len(step.slots) for step in _plan(1, rows=(1, 8), max_batch=10)}
    assert sizes == set(range(1, 9))
    again = _plan(8)
    for a, b in zip(_plan(8), again):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.slots, b.slots)


class _Buffers(torch.nn.Module):
    """A state buffer over slots (the last the scratch slot) and one table, like the models."""

    def __init__(self, slots: int):
        super().__init__()
        self.register_buffer("recurrent_state", torch.randn(slots, 2, 3, 3))
        self.register_buffer("e2m1", torch.arange(16.0))


def _failure(eager, model, got, want, dtype=fp32) -> str:
    cell = Cell("builtin", dtype, T=1, world=1, buckets=(4,))
    step = Step(7, torch.tensor([1]), torch.tensor([5]), torch.tensor([2]), (), ())
    worst: dict[str, float] = {}
    with pytest.raises(CellFailure) as failure:
        _compare(cell, step, got, want, eager, model, worst)
    return str(failure.value)


def test_compare_names_cell_step_tensor_and_error():
    slots = 4 + SPARE_SLOTS + 1
    eager, model = _Buffers(slots), _Buffers(slots)
    model.load_state_dict(eager.state_dict())
    logits = torch.randn(1, 512)
    bad = logits.clone()
    bad[0, 3] += 1e-2 * logits.abs().max()
    msg = _failure(eager, model, bad, logits)
    assert "builtin-fp32-T1-w1-b4-s0-n50: step 7" in msg and "logits max rel error 1.000e-02" in msg
    # a slot outside the batch that moved (state only; the logits agree)
    model.recurrent_state[5, 0, 0, 0] += 1.0
    assert "recurrent_state max rel error" in _failure(eager, model, logits, logits)
    # the scratch slot is padding's: a difference there passes
    model.recurrent_state.copy_(eager.recurrent_state)
    model.recurrent_state[slots - 1] += 1.0
    worst: dict[str, float] = {}
    step = Step(0, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), (), ())
    _compare(Cell("builtin", fp32, 1, 1, (4,)), step, logits, logits, eager, model, worst)
    assert worst == {"logits": 0.0, "recurrent_state": 0.0, "e2m1": 0.0}
    # NaN fails, and so does a table that changed
    assert "logits max rel error nan" in _failure(eager, model, logits * float("nan"), logits)
    model.e2m1[0] = 5.0
    assert "e2m1 max rel error" in _failure(eager, model, logits, logits)


def test_bf16_tolerance_is_tighter_than_a_real_bug():
    """An error of 10% in one logit (a wrong weight row, a wrong slot) fails the bf16 bound."""
    slots = 4 + SPARE_SLOTS + 1
    eager, model = _Buffers(slots), _Buffers(slots)
    model.load_state_dict(eager.state_dict())
    logits = torch.randn(1, 512).to(bf16)
    bad = logits.clone()
    bad[0, 0] += 0.1 * logits.abs().max()
    assert "logits max rel error" in _failure(eager, model, bad, logits, bf16)
