"""The compiled step checks its inputs before it writes state (issue 20 items 3-4,
k3compile/validate.py).

Each bad input the issue found (a position past the cache, a negative position, a negative or
too large slot, duplicate slots, the scratch slot where padding or the device-side check writes
it, ids past the vocabulary, batch sizes that disagree) raises a ValueError naming the argument, and every state buffer is bit-equal to before
the call (the device-side check: every row but the scratch row, which no request owns); the next
valid call gives eager's result. Covered on the bucketed (padded) and static paths, with the
check on the host and the device-side check run on CPU, for two small decode modules spelled two
ways (fast) and for the tiny K3 of both test spellings (the built-in model and
tests/models/hf_k3.py; slow). The GPU test: a rejected CUDA-graph replay, with the check compiled
by Inductor and as one CuTe kernel (K3_CHECK_KERNEL).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import k3compile.backend as k3be
from k3compile import settings
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err
from tests.models.hf_k3 import from_reference

# ---- two small decode modules: the same step, spelled two ways -----------------------------------


class IndexingDecode(nn.Module):
    """One state row per slot, a cache written at positions + arange(T), an embedding."""

    def __init__(self, vocab=32, dim=8, max_batch=4, max_seq_len=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.register_buffer("state", torch.zeros(max_batch + 1, dim))
        self.register_buffer("cache", torch.zeros(max_batch + 1, max_seq_len, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, positions, slots):
        ids = input_ids.unsqueeze(1) if input_ids.dim() == 1 else input_ids
        B, T = ids.shape
        x = self.embed(ids)
        s = self.state[slots] + x.sum(1)
        self.state[slots] = s
        pos = positions.view(B, 1) + torch.arange(T)
        self.cache[slots.view(B, 1), pos] = x * s.unsqueeze(1)
        return _attend(self.head, x, self.cache[slots], pos, input_ids.dim() == 1)


class ForeignDecode(IndexingDecode):
    """The same step as code from elsewhere writes it: index_copy_ / index_select on the state,
    the embedding as a row lookup, a RoPE-style table read at the positions."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("table", torch.linspace(0.5, 1.5, self.cache.shape[1]))

    def forward(self, input_ids, positions, slots):
        ids = input_ids.unsqueeze(-1) if input_ids.dim() == 1 else input_ids
        T = ids.shape[1]
        x = self.embed.weight[ids]
        s = torch.index_select(self.state, 0, slots) + x.sum(1)
        self.state.index_copy_(0, slots, s)
        cache_position = positions.unsqueeze(1) + torch.arange(T)
        x = x * self.table[cache_position].unsqueeze(-1)
        self.cache.index_put_((slots.unsqueeze(1), cache_position), x * s.unsqueeze(1))
        return _attend(self.head, x, self.cache.index_select(0, slots), cache_position,
                       input_ids.dim() == 1)


def _attend(head, x, cache, pos, single):
    visible = torch.arange(cache.shape[1]) <= pos.unsqueeze(-1)
    att = torch.einsum("btd,bld->btl", x, cache).masked_fill(~visible, float("-inf")).softmax(-1)
    logits = head(torch.einsum("btl,bld->btd", att, cache))
    return logits.squeeze(1) if single else logits


def _toy(cls):
    torch.manual_seed(0)
    return cls().eval().requires_grad_(False)


# ---- helpers -------------------------------------------------------------------------------------


def _states(model) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith(("state", "cache"))}


def _assert_untouched(model, before, scratch: int | None):
    """Bit-equal; `scratch`: the row a device-side rejection may write (no request owns it)."""
    for name, buf in model.named_buffers():
        if name not in before:
            continue
        keep = torch.ones(buf.shape[0], dtype=torch.bool)
        if scratch is not None:
            keep[scratch] = False
        assert torch.equal(buf[keep], before[name][keep]), name


def _compile(model, path: str, mode: str, **options):
    torch._dynamo.reset()
    opts = {"executor": "aten", "buckets": (4,), "validate": mode, **options}
    return torch.compile(model, backend="k3", fullgraph=True, options=opts)


def _args(ids, positions, slots, path):
    args = tuple(torch.tensor(v) for v in (ids, positions, slots))
    if path == "bucketed":
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
    return args


class Harness:
    """A compiled step and its eager twin, stepped in lockstep on valid calls."""

    def __init__(self, make, path: str, mode: str, scratch: int, **options):
        self.model, self.eager = make(), make()
        self.path, self.mode, self.scratch = path, mode, scratch
        self.pads = path == "bucketed" or mode == "device"  # something writes the scratch row
        self.step = _compile(self.model, path, mode, **options)
        self.valid()  # compiles
        self.compiled = k3be.last_compiled()

    def valid(self, ids=(1, 2, 3), positions=(0, 3, 1), slots=(0, 2, 1)):
        args = _args(ids, positions, slots, self.path)
        got, want = self.step(*args), self.eager(*args)
        assert rel_err(got, want) <= TOL["aten_cpu"]
        ours = dict(self.model.named_buffers())
        for name, buf in _states(self.eager).items():  # the scratch row: padding rows' garbage
            assert rel_err(ours[name][:self.scratch], buf[:self.scratch]) <= TOL["aten_cpu"], name

    def rejects(self, ids, positions, slots, match: str):
        before = _states(self.model)
        with pytest.raises(ValueError, match=match):
            self.step(*_args(ids, positions, slots, self.path))
        _assert_untouched(self.model, before, self.scratch if self.mode == "device" else None)
        self.valid()  # the next valid call gives eager's result

    def check(self, ids, positions, slots, match: str):
        if self.scratch in slots and not self.pads:  # a static graph checked on the host:
            self.valid(ids, positions, slots)  # the last row is a request's, as in eager
        else:
            self.rejects(ids, positions, slots, match)


# batch 3 (the bucketed path pads it to 4 with the scratch slot), scratch slot 4
TOY_BAD = {
    "position past the cache": ((1, 2, 3), (3, 16, 3), (0, 2, 1), "positions"),
    "negative position": ((1, 2, 3), (3, -1, 3), (0, 2, 1), "positions"),
    "negative slot": ((1, 2, 3), (0, 3, 1), (0, -2, 1), "slots"),
    "slot past the state": ((1, 2, 3), (0, 3, 1), (0, 5, 1), "slots"),
    "duplicate slots": ((1, 2, 3), (0, 3, 1), (1, 1, 3), "slots"),
    "scratch slot": ((1, 2, 3), (0, 3, 1), (0, 4, 1), "slots"),
    "id past the vocabulary": ((1, 32, 3), (0, 3, 1), (0, 2, 1), "input_ids"),
    "negative id": ((1, -1, 3), (0, 3, 1), (0, 2, 1), "input_ids"),
}


@pytest.fixture(scope="module", params=[(cls, path, mode) for cls in (IndexingDecode, ForeignDecode)
                                        for path in ("bucketed", "static")
                                        for mode in ("host", "device")],
                ids=lambda p: f"{p[0].__name__}-{p[1]}-{p[2]}")
def toy(request):
    cls, path, mode = request.param
    return Harness(lambda: _toy(cls), path, mode, scratch=4)


@pytest.mark.parametrize("case", TOY_BAD)
def test_toy_rejects_bad_input_before_writing(toy, case):
    toy.check(*TOY_BAD[case])


def test_roles_found_from_the_graph_not_the_names():
    """Both spellings give the same limits; the argument names are the caller's."""
    limits = {}
    for cls in (IndexingDecode, ForeignDecode):
        h = Harness(functools.partial(_toy, cls), "bucketed", "host", scratch=4)
        limits[cls] = {(lim.name, lim.role, lim.lo, lim.hi, lim.scratch)
                       for lim in h.compiled.checks.limits}
    assert limits[IndexingDecode] == {("input_ids", "ids", 0, 31, None),
                                      ("slots", "slots", 0, 4, 4),
                                      ("positions", "positions", 0, 15, None)}
    assert limits[ForeignDecode] == limits[IndexingDecode] - {("input_ids", "ids", 0, 31, None)} \
        | {("input_ids", "index", 0, 31, None)}  # a row lookup, not aten.embedding


@pytest.mark.parametrize("mode", ["host", "device"])
def test_verify_rows_bound_positions_by_max_seq_len_minus_t(mode):
    h = Harness(lambda: _toy(IndexingDecode), "static", mode, scratch=4)
    h.valid(ids=((1, 2), (3, 4)), positions=(0, 14), slots=(0, 1))  # rows 14, 15 of 16
    h.rejects(((1, 2), (3, 4)), (0, 15), (0, 1), match=r"positions.*\[0, 14\]")


def test_inputs_that_disagree_on_the_batch_are_refused():
    """A static graph traced with a broadcast position (the foreign spelling takes it)."""
    h = Harness(lambda: _toy(ForeignDecode), "static", "host", scratch=4)
    before = _states(h.model)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        h.step(*_args((1, 2, 3), (2,), (0, 2, 1), "static"))
    _assert_untouched(h.model, before, None)


def test_ids_must_be_integers():
    """Dynamo recompiles on a dtype change (and its trace then fails on a float index); the check
    is for a caller of the compiled graph itself."""
    h = Harness(lambda: _toy(IndexingDecode), "static", "host", scratch=4)
    args = [None] * len(h.compiled.inputs)
    for lim in h.compiled.checks.limits:
        args[lim.index] = torch.tensor([0, 2, 1])
    ids = next(lim for lim in h.compiled.checks.limits if lim.role == "ids")
    h.compiled.checks.before(args, None)  # integers: accepted
    args[ids.index] = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="input_ids has dtype torch.float32"):
        h.compiled.checks.before(args, None)


def test_off_checks_nothing():
    h = Harness(lambda: _toy(IndexingDecode), "static", "off", scratch=4)
    assert h.compiled.checks.mode == "off"
    h.valid(slots=(0, 4, 1))  # the scratch slot: eager takes it, and so does the unchecked step


# ---- the tiny K3, both test spellings ------------------------------------------------------------

# layer 0 KDA (conv + recurrent state), layer 1 MLA (latent cache); dense MLPs keep it quick
CFG = dataclasses.replace(get_config("tiny"), num_hidden_layers=2, full_attn_layers=(1,),
                          first_k_dense_replace=2)
MAX_BATCH, MAX_LEN = 4, 32


def _k3(spelling: str):
    model = build_model(CFG, dtype=torch.float32, max_batch=MAX_BATCH, max_seq_len=MAX_LEN)
    return from_reference(model) if spelling == "hf" else model


K3_BAD = {  # scratch slot 4, vocab 512, max_seq_len 32
    "position past the cache": ((1, 2, 3), (3, 32, 3), (1, 2, 3), "positions"),  # issue 20.3
    "negative position": ((1, 2, 3), (3, -1, 3), (0, 2, 1), "positions"),
    "negative slot": ((1, 2, 3), (0, 3, 1), (0, -2, 1), "slots"),
    "duplicate slots": ((1, 2, 3), (0, 3, 1), (1, 1, 3), "slots"),
    "scratch slot": ((1, 2, 3), (0, 3, 1), (0, 4, 1), "slots"),
    "negative scratch": ((1, 2, 3), (0, 3, 1), (0, -1, 1), "slots"),
    "id past the vocabulary": ((1, 512, 3), (0, 3, 1), (0, 2, 1), "input_ids"),
}


@pytest.fixture(scope="module", params=[("k3", "bucketed", "host"), ("k3", "static", "host"),
                                        ("k3", "bucketed", "device"), ("hf", "bucketed", "host"),
                                        ("hf", "static", "host"), ("hf", "static", "device")],
                ids="-".join)
def k3(request):
    spelling, path, mode = request.param
    return Harness(lambda: _k3(spelling), path, mode, scratch=MAX_BATCH)


@pytest.mark.slow
@pytest.mark.parametrize("case", K3_BAD)
def test_k3_rejects_bad_input_before_writing(k3, case):
    k3.check(*K3_BAD[case])


# ---- GPU: the check inside the CUDA graph --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("check_kernel", [False, True], ids=["inductor", "kernel"])
def test_rejected_cuda_graph_replay_leaves_state_and_raises(check_kernel, monkeypatch):
    """`kernel`: the check as one CuTe launch (K3_CHECK_KERNEL, kernels/input_check.py)."""
    if check_kernel:
        pytest.importorskip("cutlass")
    monkeypatch.setattr(settings.KERNELS, "check_kernel", check_kernel)
    torch._dynamo.reset()
    model, eager = (build_model(CFG, device="cuda", dtype=torch.float32, max_batch=MAX_BATCH,
                                max_seq_len=MAX_LEN) for _ in range(2))
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "buckets": (4,)})

    def args(slots):
        out = tuple(torch.tensor(v, device="cuda") for v in ((1, 2, 3), (0, 3, 1), slots))
        for a in out:
            torch._dynamo.mark_dynamic(a, 0)
        return out

    for _ in range(2):  # the first run captures, the second replays
        step(*args((0, 2, 1))), eager(*args((0, 2, 1)))
    compiled = k3be.last_compiled()
    assert compiled.checks.mode == "device"
    assert compiled.checks.redirect_by == ("kernel" if check_kernel else "inductor")
    assert any(b.graph is not None for b in compiled.buckets.values())
    for slots, match in [((1, 1, 3), "slots holds duplicates"),
                         ((0, 4, 1), "slots holds the scratch slot"),
                         ((0, 5, 1), r"slots out of range \[0, 4\]")]:
        before = _states(model)
        step(*args(slots))  # no host sync: the check runs inside the replay
        with pytest.raises(ValueError, match=match):
            compiled.checks.wait()
        torch.cuda.synchronize()
        _assert_untouched(model, before, scratch=MAX_BATCH)
        got, want = step(*args((0, 2, 1))), eager(*args((0, 2, 1)))
        assert rel_err(got, want) <= TOL["gpu_bf16"]


@pytest.mark.slow
def test_inductor_compiled_device_check_equals_eager():
    """On CUDA the device check is one Inductor-compiled function per bucket (a few fused kernels
    in the step's CUDA graph); forced here on CPU: the same mask and redirected inputs as the
    eager check for valid and each kind of bad input, a strided ids view included."""
    from k3compile.validate import InputChecks, Limit

    limits = [Limit(0, "ids", "ids", 0, 99, "vocab", True),
              Limit(1, "positions", "positions", 0, 31, "cache", True),
              Limit(2, "slots", "slots", 0, 7, "rows", True, 8)]
    calls = [((1, 2, 3, 0), (0, 3, 5, 0), (0, 1, 2, 8)),  # valid, one padding row
             ((1, 2, 3, 0), (0, 3, 5, 0), (0, 1, 1, 8)),  # duplicate slots
             ((1, 200, 3, 0), (0, 3, 5, 0), (0, 1, 2, 8)),  # an id past the vocabulary
             ((1, 2, 3, 0), (0, -1, 40, 0), (8, 1, 2, 8)),  # positions out of range, scratch
             ((1, 2, 3, 0), (0, 3, 5, 0), (0, 1, 2, 3))]  # the padding row is not checked
    seen = {}
    for compiled in (False, True):
        checks = InputChecks([], "device", 8, True)
        checks.limits, checks.compiled = limits, compiled
        checks._resolve = lambda example_inputs: "device"
        example = [torch.arange(4) for _ in limits]
        step = checks.guard(lambda *args: [a.clone() for a in args], example)
        assert checks.redirect_by == ("inductor" if compiled else "torch")
        for ids, positions, slots in calls:
            checks._rows, checks._mask = torch.tensor(3), torch.tensor(-1)
            wide = torch.tensor([ids, ids]).t()[:, 0]  # ids as a strided view
            args = step(wide, torch.tensor(positions), torch.tensor(slots))
            seen.setdefault(compiled, []).append((int(checks._mask), *args))
    assert [m for m, *_ in seen[False]] == [0, 1 << 8, 1, (1 << 3) + (1 << 6) + (1 << 7), 0]
    for (want_mask, *want), (got_mask, *got) in zip(seen[False], seen[True]):
        assert got_mask == want_mask
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_row_count_written_only_where_it_changes(monkeypatch):
    """The device check's row count: the shared tensor is refilled only for a new value (a stale
    value written behind its back stays: no fill ran); inside a caller's capture an unpadded call
    reads a constant of its size, and once a fill was captured (a padded call there) every later
    call fills again, since the caller's replays may rewrite the shared tensor."""
    from k3compile import validate

    capturing = [False]
    monkeypatch.setattr(validate, "_capturing", lambda: capturing[0])
    rows, cpu = validate.RowCount(), torch.device("cpu")
    shared = rows.tensor(cpu, 3, 4)  # a padded batch: 3 real rows of 4
    assert int(shared) == 3
    assert rows.tensor(cpu, 4, 4) is shared and int(shared) == 4  # unpadded, outside a capture
    shared.fill_(99)  # what a stale tensor would hold
    assert int(rows.tensor(cpu, 4, 4)) == 99  # same value as last written: no fill
    assert int(rows.tensor(cpu, 3, 4)) == 3  # a new value: filled
    capturing[0] = True
    constant = rows.tensor(cpu, 4, 4)
    assert constant is not shared and int(constant) == 4 and int(shared) == 3
    assert rows.tensor(cpu, 2, 4) is shared and int(shared) == 2  # a captured fill
    capturing[0] = False
    shared.fill_(99)  # a replay of the caller's graph may write it
    assert int(rows.tensor(cpu, 2, 4)) == 2  # so it is filled again, though the value is the same
