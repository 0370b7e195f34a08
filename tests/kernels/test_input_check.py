"""The device-side input check as one CuTe kernel launch (kernels/input_check.py, opt-in with
`K3_CHECK_KERNEL`): what it refuses, the switch, which path `InputChecks` takes on CPU (the
kernel never: the torch reference stays the CPU path, tests/e2e/test_validation.py), and on a GPU
the kernel's mask and outputs equal the torch reference (`validate.redirect_ref`) for valid
inputs and each kind of bad input, padded rows ignored, at B 1 / 2 / 8 / 64 and T 1 / 8,
launched directly and replayed from a CUDA graph with changed inputs. Its sm_90a builds:
tests/kernels/test_build.py::test_input_check_builds; the end-to-end device mode with the switch
on: tests/e2e/test_validation.py::test_rejected_cuda_graph_replay_leaves_state_and_raises."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from k3compile.kernels import input_check

from k3compile import settings
from k3compile.validate import DUPLICATE, RANGE, SCRATCH, InputChecks, Limit, redirect_ref

VOCAB, SEQ, STATE = 1000, 64, 65  # state rows 0..64, 64 the scratch slot


def _limits(T: int) -> list[Limit]:
    return [Limit(0, "input_ids", "ids", 0, VOCAB - 1, "vocab", True),
            Limit(1, "positions", "positions", 0, SEQ - T, "cache", True),
            Limit(2, "slots", "slots", 0, STATE - 1, "rows", True, STATE - 1)]


# ---- CPU -----------------------------------------------------------------------------------------


def test_check_refusals():
    lim = _limits(1)
    ok = [torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32),
          torch.zeros(4, dtype=torch.int64)]
    assert input_check.refusal(lim, ok) is None
    assert input_check.refusal(lim * 3, ok * 3) == "9 checked inputs (want 1 to 8)"
    assert "dtype torch.int16" in input_check.refusal(lim, [ok[0], ok[1], ok[2].short()])
    assert "dtype torch.float32" in input_check.refusal(lim, [ok[0].float(), *ok[1:]])
    big = torch.zeros(64, 65, dtype=torch.int64)
    assert input_check.refusal(lim, [big, *ok[1:]]) == "input_ids: 4160 elements (want 1 to 4096)"
    assert "0 elements" in input_check.refusal(lim, [ok[0][:0], *ok[1:]])
    many = torch.zeros(64, 17, dtype=torch.int64)
    assert input_check.refusal(lim, [*ok[:2], many]) == (
        "1088 slot values (want at most 1024: the duplicate check)")
    no_scratch = [*lim[:2], Limit(2, "slots", "slots", 0, 7, "rows", True)]
    assert input_check.refusal(no_scratch, ok) == "slots: a slot input without a scratch slot"
    wide = [*lim[:2], Limit(2, "slots", "slots", 0, 2**40, "rows", True, 2**40)]
    assert input_check.refusal(wide, ok[:2] + [ok[2].int()]) == "slots: fill 1099511627776 past int32"
    assert input_check.refusal(wide, ok) is None  # int64 slots take it
    huge = [Limit(0, "input_ids", "ids", 0, 2**64, "vocab", True)]
    assert "past int64" in input_check.refusal(huge, ok[:1])


def test_check_specs_and_config():
    lim = _limits(8)
    checked = [torch.zeros(64, 8, dtype=torch.int64), torch.zeros(64, 8, dtype=torch.int32),
               torch.zeros(64, dtype=torch.int64)]
    specs = input_check.specs_of(lim, checked)
    assert specs == (input_check.Spec("int64", 512, 64, 0, VOCAB - 1, None, 0),
                     input_check.Spec("int32", 512, 64, 0, SEQ - 8, None, 0),
                     input_check.Spec("int64", 64, 64, 0, STATE - 1, STATE - 1, STATE - 1))
    assert input_check.config(specs).threads == 256
    assert input_check.config(specs[2:]).threads == 64
    assert input_check.config(input_check.specs_of(lim[2:], [checked[2][:1]])).threads == 32
    unbatched = Limit(0, "table", "index", 0, 9, "table", False)
    assert input_check.specs_of([unbatched], [torch.zeros(3, dtype=torch.int64)])[0].rows is None


def test_check_kernel_switch(monkeypatch):
    assert settings.KernelSettings().check_kernel is True  # its GPU tests passed (H100, session 24)
    monkeypatch.delenv("K3_CHECK_KERNEL", raising=False)
    assert settings.KernelSettings.from_env().check_kernel is True
    monkeypatch.setenv("K3_CHECK_KERNEL", "1")
    assert settings.KernelSettings.from_env().check_kernel is True
    monkeypatch.setenv("K3_CHECK_KERNEL", "off")
    assert settings.KernelSettings.from_env().check_kernel is False
    monkeypatch.setenv("K3_CHECK_KERNEL", "maybe")
    with pytest.raises(ValueError, match="K3_CHECK_KERNEL='maybe'"):
        settings.KernelSettings.from_env()


def _checks(compiled: bool | None) -> InputChecks:
    checks = InputChecks([], "device", STATE - 1, True)
    checks.limits, checks.compiled = _limits(1), compiled
    checks._resolve = lambda example_inputs: "device"
    return checks


@pytest.mark.parametrize("compiled,path", [(None, "torch"), (False, "torch")])
def test_check_kernel_never_takes_cpu_inputs(compiled, path, monkeypatch):
    """With the switch on, CPU inputs keep the torch path (the reference), checked as before."""
    monkeypatch.setattr(settings.KERNELS, "check_kernel", True)
    checks = _checks(compiled)
    step = checks.guard(lambda *args: args, [torch.zeros(3, dtype=torch.int64)] * 3)
    assert checks.redirect_by == path
    checks._rows, checks._mask = torch.tensor(3), torch.tensor(-1)
    out = step(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1]))
    assert int(checks._mask) == 1 << (3 * 2 + DUPLICATE)
    assert out[2].tolist() == [STATE - 1] * 3


def test_check_kernel_refusal_is_logged_once(caplog):
    """Where the kernel cannot run (here: no CUDA device) `redirect` says why once and hands the
    call back (validate then compiles the check with Inductor)."""
    input_check._logged.clear()
    refused = input_check.redirects["refused"]
    checked = [torch.zeros(2, dtype=torch.int64)] * 3
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        for _ in range(2):
            if torch.cuda.is_available():
                assert input_check.redirect(_limits(1) * 3, checked * 3) is None
            else:
                assert input_check.redirect(_limits(1), checked) is None
    found = [r for r in caplog.records if "input check stays with Inductor" in r.getMessage()]
    assert len(found) == 1
    assert input_check.redirects["refused"] == refused + 2  # counted every time (benchmarks)


# ---- GPU -----------------------------------------------------------------------------------------


def _valid(B: int, T: int, gen: torch.Generator):
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    positions = torch.randint(0, SEQ - T + 1, (B, T) if T > 1 else (B,), generator=gen)
    slots = torch.randperm(STATE - 1, generator=gen)[:B]
    return ids, positions.int(), slots


def _cases(B: int, T: int):
    """(name, real rows, ids, positions, slots, failed bits expected or None: whatever the
    reference says)."""
    gen = torch.Generator().manual_seed(B * 100 + T)
    out = []

    def case(name, rows=B, bits=None, **change):
        ids, positions, slots = (t.clone() for t in _valid(B, T, gen))
        for key, fn in change.items():
            fn({"ids": ids, "positions": positions, "slots": slots}[key])
        out.append((name, rows, ids, positions, slots, bits))

    def put(index, value):
        return lambda t: t.view(-1).__setitem__(index, value)

    ids_bit, pos_bit, slot_bit = (1 << 0), (1 << 3), (1 << 6)
    case("valid", bits=0)
    case("id past the vocabulary", bits=ids_bit << RANGE, ids=put(-1, VOCAB))
    case("negative id", bits=ids_bit << RANGE, ids=put(0, -1))
    case("negative position", bits=pos_bit << RANGE, positions=put(0, -1))
    case("position past the cache", bits=pos_bit << RANGE, positions=put(-1, SEQ - T + 1))
    case("negative slot", bits=slot_bit << RANGE, slots=put(-1, -1))
    case("slot past the state", bits=slot_bit << RANGE, slots=put(0, STATE))
    case("scratch slot", bits=slot_bit << SCRATCH, slots=put(-1, STATE - 1))
    case("id and slot", bits=(ids_bit << RANGE) | (slot_bit << RANGE),
         ids=put(0, VOCAB + 7), slots=put(0, -5))
    if B > 1:
        case("duplicate slots", bits=slot_bit << DUPLICATE,
             slots=lambda t: t.__setitem__(B - 1, t[0]))
        real = B // 2

        def padding(t, value):
            t[real:] = value

        # padding rows hold the scratch slot (duplicates too), bad ids and positions, and a
        # real row's slot: none of it is checked
        case("padded rows ignored", rows=real, bits=0,
             ids=lambda t: padding(t, VOCAB + 3), positions=lambda t: padding(t, -7),
             slots=lambda t: (padding(t, STATE - 1), t.__setitem__(B - 1, t[0])))
        case("bad real row with padding", rows=real, bits=slot_bit << SCRATCH,
             slots=lambda t: (padding(t, STATE - 1), t.__setitem__(real - 1, STATE - 1)))
        case("out of range in a padded row only", rows=real, bits=0,
             slots=lambda t: padding(t, STATE + 100))
    return out


def _compare(got, mask, want, want_mask, name):
    assert int(mask) == int(want_mask), name
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), name


def _finish(deadline_s: float = 20.0) -> None:
    """torch.cuda.synchronize(), but a launch that never finishes (a hung kernel) ends the test
    session at the deadline instead of hanging it: every later CUDA call of this process would
    wait behind the hung launch, so no later test could run anyway."""
    done = torch.cuda.Event()
    done.record()
    end = time.monotonic() + deadline_s
    while not done.query():
        if time.monotonic() > end:
            pytest.exit(f"input_check: a launch did not finish in {deadline_s:.0f} s (hung)",
                        returncode=1)
        time.sleep(1e-3)


BT = [(1, 1), (2, 1), (8, 1), (64, 1), (1, 8), (2, 8), (8, 8), (64, 8)]


@pytest.mark.gpu
@pytest.mark.dsl
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("B,T", BT, ids=[f"B{b}T{t}" for b, t in BT])
def test_check_kernel_equals_reference(B, T, pdl, monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "pdl", pdl)
    monkeypatch.setattr(settings.KERNELS, "pdl_max_rows", 64)
    limits = _limits(T)
    cuda = [t.cuda() for t in _valid(B, T, torch.Generator().manual_seed(0))]
    run = input_check.redirect(limits, cuda)
    assert run is not None
    for name, rows, *inputs, bits in _cases(B, T):
        inputs = [t.cuda() for t in inputs]
        rows_t = torch.tensor(rows, device="cuda")
        want_mask = torch.full((), -1, dtype=torch.int64, device="cuda")
        want = redirect_ref(limits, rows_t, want_mask, *inputs)
        mask = torch.full((), -1, dtype=torch.int64, device="cuda")
        got = run(rows_t, mask, *inputs)
        _finish()
        if bits is not None:
            assert int(want_mask) == bits, name  # the case is what it says
        _compare(got, mask, want, want_mask, name)


@pytest.mark.gpu
@pytest.mark.dsl
@pytest.mark.parametrize("B,T", [(2, 1), (64, 8), (1, 8)], ids=["B2T1", "B64T8", "B1T8"])
def test_check_kernel_in_a_cuda_graph(B, T):
    """Captured once, replayed with each case's inputs and row count copied in: the same mask
    and outputs as the reference, every replay (a rejected replay, then a valid one again)."""
    limits = _limits(T)
    static = [t.cuda() for t in _valid(B, T, torch.Generator().manual_seed(1))]
    rows = torch.tensor(B, device="cuda")
    mask = torch.zeros((), dtype=torch.int64, device="cuda")
    run = input_check.redirect(limits, static)
    run(rows, mask, *static)  # outside the capture first, as the backend's first run
    _finish()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(rows, mask, *static)
    cases = _cases(B, T)
    for name, real, *inputs, _ in cases + cases[:1]:
        for s, t in zip(static, inputs):
            s.copy_(t)
        rows.fill_(real)
        mask.fill_(-1)
        graph.replay()
        want_mask = torch.zeros((), dtype=torch.int64, device="cuda")
        want = redirect_ref(limits, rows, want_mask, *static)
        _finish()
        _compare(outs, mask, want, want_mask, name)
