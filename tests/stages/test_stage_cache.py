"""Each bucket's stage output on disk (k3compile/stage_cache.py, K3_CACHE_DIR/stages).

A recompile of the same graph in a fresh Dynamo (as in a new process) loads the stages' graph
instead of running them: the same final graph, bitwise the same outputs, the same rewrite report
and contract; `pack` still moves the new module's weights. A changed option or model shape misses;
a corrupt entry, or one made from other table values, is logged, rebuilt and never loaded.
A small tensor constant of the graph is part of the key by value (another value misses).
A link entry keyed by Dynamo's graph (`skip_aot`) makes the recompile skip AOTAutograd where
its wrappers do nothing: bitwise the same outputs and written state (executors aten and
inductor, a static batch and `mark_batch`'s buckets); a changed option misses; a graph whose
wrappers do something (an output aliasing an input) takes the full path; a corrupt link is
rebuilt.
The direct compile hands Inductor the arguments AOTAutograd handed it, as torch 2.13 and as
2.11 do: the warm compile hits the FX graph cache the cold one stored.
`slow`: a second process compiling the tiny model loads every bucket and matches the first;
a second process compiling the same step hits the FX graph cache (2.11's arguments).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import k3compile.ops  # noqa: F401
from k3compile import stage_cache
from k3compile.backend import last_compiled, mark_batch
from k3compile.math import rms_norm, situ
from k3compile.ops.linear_concat import adjacent
from k3compile.rewrite import inductor
from tests.conftest import cold_and_warm

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = {"executor": "aten", "stage_cache": True, "buckets": (4,), "skip_aot": False}


class Block(nn.Module):
    """A norm feeding one GEMM (k3.norm_linear) and a SiTU gate|up pair (k3.situ_gate_up, whose
    two weights stage `pack` stores as one buffer)."""

    def __init__(self, seed: int, d: int = 32, f: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(d, generator=g))
        self.w = nn.Parameter(torch.randn(f, d, generator=g) / d ** 0.5)
        self.gate = nn.Parameter(torch.randn(f, d, generator=g) / d ** 0.5)
        self.up = nn.Parameter(torch.randn(f, d, generator=g) / d ** 0.5)

    def forward(self, x):
        h = F.linear(rms_norm(x, self.norm, 1e-6), self.w)
        return situ(F.linear(x, self.gate), F.linear(x, self.up), 4.0, 20.0) + h


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh stage cache (the traced patterns stay in the user's cache: tracing is slow)."""
    monkeypatch.setattr(stage_cache, "root", lambda: tmp_path / "k3cache" / "stages")
    monkeypatch.setattr(stage_cache, "STATS", Counter())
    return tmp_path / "k3cache"


def _compile(x, seed: int = 0, f: int = 64, **options):
    """A fresh module and a fresh Dynamo (as in a new process): outputs, compiled, stats delta."""
    torch._dynamo.reset()
    before = Counter(stage_cache.STATS)
    model = Block(seed, f=f)
    with torch.no_grad():
        out = torch.compile(model, backend="k3", options={**OPTIONS, **options})(x)
    compiled = last_compiled()
    return out, compiled, model, dict(Counter(stage_cache.STATS) - before)


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("stages/*.json"))


def _final(compiled) -> str:
    graph = next(iter(compiled.observer.graphs.values()))
    return fx.GraphModule(torch.nn.Module(), graph).code


def test_warm_equals_cold(cache_dir):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    cold, c_cold, _, s_cold = _compile(x)
    warm, c_warm, model, s_warm = _compile(x)
    assert s_cold == {"missed": 1, "stored": 1} and s_warm == {"loaded": 1}
    assert len(_entries(cache_dir)) == 1
    assert torch.equal(cold, warm)
    torch.testing.assert_close(warm, Block(0)(x), rtol=1e-5, atol=1e-5)
    assert _final(c_cold) == _final(c_warm)
    assert "k3.norm_linear" in _final(c_warm)
    r_cold, r_warm = (next(iter(c.observer.reports.values())) for c in (c_cold, c_warm))
    assert r_cold.counts == r_warm.counts and r_cold.counts
    assert [str(m) for m in r_cold.near_misses] == [str(m) for m in r_warm.near_misses]
    assert c_cold.summary() == c_warm.summary()
    assert [r.name for r in c_warm.observer.records[4]][:2] == ["cache", "normalize"]
    # `pack` ran on the loaded graph: the new module's gate|up are one buffer
    pack = next(iter(c_warm.observer.notes.values()))["pack"]
    assert pack.packed and adjacent([model.gate, model.up])


def test_a_changed_option_or_shape_misses(cache_dir):
    x = torch.randn(4, 32)
    _, cold, _, _ = _compile(x)
    _, other, _, stats = _compile(x, disabled_patterns=("norm_linear",))
    assert stats == {"missed": 1, "stored": 1}
    assert "k3.norm_linear" not in _final(other)
    _, _, _, stats = _compile(x, f=48)  # another model config: other weight shapes
    assert stats == {"missed": 1, "stored": 1}
    assert len(_entries(cache_dir)) == 3
    _, _, _, stats = _compile(x, stage_cache=False)
    assert stats == {} and len(_entries(cache_dir)) == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "not_json", "format", "key"])
def test_a_corrupt_entry_is_rebuilt(cache_dir, damage, caplog):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    cold, c_cold, _, _ = _compile(x)
    path, = _entries(cache_dir)
    data = path.read_bytes()
    entry = json.loads(data)
    if damage == "flip":  # one byte of the body: the checksum fails
        i = data.index(b'"body"') + 40
        data = data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "not_json":
        data = b"\x00garbage"
    elif damage == "format":
        data = json.dumps({**entry, "format": -1}).encode()
    else:
        data = json.dumps({**entry, "key": entry["key"] + " "}).encode()
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        warm, c_warm, _, stats = _compile(x)
    assert stats == {"rebuilt": 1, "stored": 1}
    assert "unusable" in caplog.text
    assert torch.equal(cold, warm) and _final(c_cold) == _final(c_warm)
    assert json.loads(path.read_text())["sha256"] == entry["sha256"]  # whole again
    assert _compile(x)[3] == {"loaded": 1}


def test_other_table_values_are_not_loaded(cache_dir):
    """An entry records the digest of each input a stage read the value of (the MXFP4 tables);
    other values there make it unusable."""

    def graph_module():
        gm = torch.fx.symbolic_trace(lambda lut, x: torch.ops.aten.mul.Tensor(x, lut))
        mode = FakeTensorMode()
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                n.meta["val"] = mode.from_tensor(torch.empty(16))
        return gm

    gm = graph_module()
    gm.meta["inputs_read"] = {0}
    lut = torch.arange(16.0)
    path = cache_dir / "stages" / "x.json"
    assert stage_cache.store(path, "key", gm, [lut, None], [], _report(), {})
    assert stage_cache.lookup(path, "key", graph_module(), [lut.clone(), None]) is not None
    assert stage_cache.lookup(path, "key", graph_module(), [lut.flip(0), None]) is None
    assert stage_cache.STATS["rebuilt"] == 1 and not path.exists()


def _report():
    from k3compile.rewrite import RewriteReport

    return RewriteReport()


class Stateful(Block):
    """Block, writing its output into rows `slots` of a state buffer (an input mutation that
    AOTAutograd keeps in the graph); `alias`: also returns a view of the state (an output
    aliasing an input, which AOTAutograd's wrapper regenerates)."""

    def __init__(self, seed: int, alias: bool = False):
        super().__init__(seed)
        self.alias = alias
        self.register_buffer("state", torch.zeros(8, 64))

    def forward(self, x, slots):
        y = super().forward(x)
        self.state.index_copy_(0, slots, y)
        return (y, self.state[:2]) if self.alias else y


def _steps(batches, executor="aten", alias=False, marked=False, **options):
    """Compile a fresh Stateful in a fresh Dynamo and run one step per batch: each step's
    outputs and state, the compiled graph, the module and the stats delta."""
    torch._dynamo.reset()
    before = Counter(stage_cache.STATS)
    model = Stateful(0, alias)
    step = torch.compile(model, backend="k3", options={
        **OPTIONS, "executor": executor, "skip_aot": True, "buckets": tuple(batches), **options})
    results = []
    with torch.no_grad():
        for b in batches:
            x = torch.randn(b, 32, generator=torch.Generator().manual_seed(b))
            slots = torch.arange(b) * 2 % 8
            if marked:
                mark_batch(x, slots)
            out = step(x, slots)
            results.append([o.clone() for o in (out if alias else (out,))] + [model.state.clone()])
    return results, last_compiled(), model, dict(Counter(stage_cache.STATS) - before)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for r, s in zip(a, b, strict=True) for x, y in zip(r, s, strict=True))


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_a_link_skips_aot_and_equals_cold(cache_dir, executor):
    cold, c_cold, _, s_cold = _steps([4], executor)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    warm, c_warm, model, s_warm = _steps([4], executor)
    if executor == "inductor":  # it is handed the graph the cold compile handed it
        assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1
    assert s_cold == {"missed": 1, "stored": 1, "linked": 1}
    assert s_warm == {"loaded": 1, "direct": 1}
    assert _equal(cold, warm)  # outputs and written state, bit for bit
    torch.testing.assert_close(warm[0][0], Block(0)(torch.randn(
        4, 32, generator=torch.Generator().manual_seed(4))), rtol=1e-5, atol=1e-5)
    assert "k3.norm_linear" in _final(c_warm)
    if executor == "aten":  # Inductor edits the graph it is handed (reinplacing), or not on a hit
        assert _final(c_cold) == _final(c_warm)
    assert c_cold.summary() == c_warm.summary()
    pack = next(iter(c_warm.observer.notes.values()))["pack"]  # replayed: this module's weights
    assert pack.packed and adjacent([model.gate, model.up])


class ScaledBlock(Block):
    """Block times a tensor constant built in the forward (as `torch.tensor([...])` in a model's
    code: AOTAutograd makes it a get_attr of the ATen graph)."""

    def __init__(self, seed: int, scale: list[float]):
        super().__init__(seed)
        self.scale = scale

    def forward(self, x):
        return super().forward(x) * torch.tensor(self.scale)


def _scaled(scale: list[float], x, **options):
    torch._dynamo.reset()
    before = Counter(stage_cache.STATS)
    model = ScaledBlock(0, scale)
    with torch.no_grad():
        out = torch.compile(model, backend="k3", options={**OPTIONS, **options})(x)
        want = model(x)
    return out, want, dict(Counter(stage_cache.STATS) - before)


@pytest.mark.parametrize("skip_aot", [False, True])
def test_a_tensor_constant_is_cached_by_value(cache_dir, skip_aot, monkeypatch):
    """A graph holding a small tensor constant is cached with the constant's values in its key
    (and a link's graph rebuilt with them): the warm compile loads, bit for bit the cold one's
    output; another value misses; a constant past MAX_CONSTANT elements is not cached."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    scale = [1.0, 0.5, 2.0, -1.0] * 16
    stored = {"missed": 1, "stored": 1} | ({"linked": 1} if skip_aot else {})
    cold, want, s_cold = _scaled(scale, x, skip_aot=skip_aot)
    warm, _, s_warm = _scaled(scale, x, skip_aot=skip_aot)
    assert s_cold == stored
    assert s_warm == {"loaded": 1} | ({"direct": 1} if skip_aot else {})
    assert torch.equal(cold, warm)
    torch.testing.assert_close(warm, want, rtol=1e-5, atol=1e-5)
    other = [v * 3 for v in scale]
    out, want, s_other = _scaled(other, x, skip_aot=skip_aot)
    assert s_other == stored  # another constant: another key
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    big = [0.5] * (stage_cache.MAX_CONSTANT + 64)
    for limit, cached in ((stage_cache.MAX_CONSTANT, False), (len(big), True)):
        monkeypatch.setattr(stage_cache, "MAX_CONSTANT", limit)
        model = ScaledBlock(0, big)
        model.forward = lambda x, model=model: Block.forward(model, x) * torch.tensor(big)[:64]
        torch._dynamo.reset()
        before = Counter(stage_cache.STATS)
        with torch.no_grad():
            out = torch.compile(model, backend="k3", options={**OPTIONS, "skip_aot": skip_aot})(x)
            torch.testing.assert_close(out, Block.forward(model, x) * 0.5, rtol=1e-5, atol=1e-5)
        assert ("stored" in Counter(stage_cache.STATS) - before) == cached


def _as_torch_2_11(monkeypatch) -> None:
    """AOTAutograd hands the inner compile what torch 2.11's `compile_fx` hands it: no
    `get_decomp_fn` (2.13's passes Inductor's default). Every argument the direct compile passes
    `compile_fx_inner` is part of Inductor's FX graph cache key: on the H200 (torch 2.11, session
    15) the direct compile passed one the cold compile had not, and every warm bucket missed."""
    real = inductor.compile_fx

    def compile_fx(gm, inputs, inner_compile, **kwargs):
        def inner(*args, get_decomp_fn=None, **kw):
            return inner_compile(*args, **kw)

        return real(gm, inputs, inner_compile=inner, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", compile_fx)


def _fx_cache(delta: Counter) -> tuple[int, int]:
    return delta["fxgraph_cache_hit"], delta["fxgraph_cache_miss"]


@pytest.mark.parametrize("torch_2_11", [False, True])
def test_the_direct_compile_hands_inductor_aots_arguments(cache_dir, monkeypatch, torch_2_11):
    """The link records the arguments AOTAutograd handed Inductor, and the direct compile passes
    exactly those: its FX graph cache key is the cold compile's (a hit), on either torch."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir.parent / "inductor"))
    if torch_2_11:
        _as_torch_2_11(monkeypatch)
    before = Counter(counters["inductor"])
    cold, _, _, _ = _steps([4], "inductor")
    middle = Counter(counters["inductor"])
    warm, _, _, s_warm = _steps([4], "inductor")
    assert s_warm == {"loaded": 1, "direct": 1}
    assert _fx_cache(middle - before) == (0, 1)  # a fresh cache: the cold compile stores
    assert _fx_cache(Counter(counters["inductor"]) - middle) == (1, 0)
    assert _equal(cold, warm)
    if torch_2_11:  # (as torch hands it: 2.13 passes Inductor's default, 2.11 none)
        link = json.loads(next(cache_dir.glob("stages/links/*.json")).read_text())
        assert json.loads(link["body"])["direct"]["decomp"] is False


@pytest.mark.slow
def test_a_second_process_hits_the_fx_graph_cache(tmp_path):
    """Two processes compile the same step (executor inductor) on one pair of cache folders, as
    torch 2.11 hands the inner compile its arguments: the second loads the stages, skips
    AOTAutograd, hits Inductor's FX graph cache and gives bitwise the first's outputs."""
    env = {**os.environ, "K3_CACHE_DIR": str(tmp_path / "k3"), "K3_QUIET": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    (cold, cold_out), (warm, warm_out) = cold_and_warm("tests.stages.test_stage_cache", tmp_path,
                                                       env)
    assert cold == {"fx": [0, 1], "stages": {"missed": 1, "stored": 1, "linked": 1}}
    assert warm == {"fx": [1, 0], "stages": {"loaded": 1, "direct": 1}}
    assert _equal(cold_out, warm_out)


def _one_process(out: Path) -> None:
    """test_a_second_process_hits_the_fx_graph_cache's child: one compile and step; the FX graph
    cache's (hits, misses) and the stage cache's stats to `out`.json, the step to `out`.pt."""
    from k3compile.backend import ensure_registered

    ensure_registered()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _as_torch_2_11(monkeypatch)
        results, _, _, stats = _steps([4], "inductor")
    out.with_suffix(".json").write_text(json.dumps(
        {"fx": _fx_cache(counters["inductor"]), "stages": stats}))
    torch.save(results, out.with_suffix(".pt"))


@pytest.mark.parametrize("marked", [False, True])
def test_a_cold_compile_reaches_the_fx_graph_cache(cache_dir, marked):
    """The backend compiles a bucket at its first call, outside Dynamo's tracing context. Its
    graph must reach Inductor's FX graph cache (stored, or a hit): a bypass ("No shape env", as
    on the H200 on 2026-12-03, every bucket) leaves a warm process nothing to load."""
    before = Counter(counters["inductor"])
    cold, _, _, _ = _steps([2, 4] if marked else [4], "inductor", marked=marked)
    delta = Counter(counters["inductor"]) - before
    assert delta["fxgraph_cache_bypass"] == 0
    assert delta["fxgraph_cache_miss"] + delta["fxgraph_cache_hit"] == (2 if marked else 1)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    warm, _, _, _ = _steps([2, 4] if marked else [4], "inductor", marked=marked)
    assert counters["inductor"]["fxgraph_cache_hit"] == hits + (2 if marked else 1)
    assert _equal(cold, warm)


def test_marked_batch_buckets_skip_aot(cache_dir):
    """One Dynamo graph for every bucket (`mark_batch`): each bucket's link hits."""
    cold, _, _, s_cold = _steps([2, 4], marked=True)
    warm, c_warm, _, s_warm = _steps([2, 4], marked=True)
    assert s_cold == {"missed": 2, "stored": 2, "linked": 2}
    assert s_warm == {"loaded": 2, "direct": 2}
    assert c_warm.symbol is not None and _equal(cold, warm)


def test_a_changed_option_misses_the_link(cache_dir):
    _steps([4])
    _, other, _, stats = _steps([4], disabled_patterns=("norm_linear",))
    assert stats == {"missed": 1, "stored": 1, "linked": 1}
    assert "k3.norm_linear" not in _final(other)


def test_wrappers_that_do_something_take_the_full_path(cache_dir):
    """An output that is a view of the state buffer: AOTAutograd's wrapper makes it again from
    the buffer, so the link records why and the recompile runs AOTAutograd."""
    cold, _, _, s_cold = _steps([4], alias=True)
    warm, _, _, s_warm = _steps([4], alias=True)
    assert s_cold == {"missed": 1, "stored": 1, "linked": 1}
    assert s_warm == {"loaded": 1, "linked": 1}  # no "direct"
    assert _equal(cold, warm)
    body = json.loads(json.loads(next(cache_dir.glob("stages/links/*.json")).read_text())["body"])
    assert body["direct"] is None and body["why"] == "aliased outputs"


def test_a_corrupt_link_is_rebuilt(cache_dir, caplog):
    cold, _, _, _ = _steps([4])
    path, = cache_dir.glob("stages/links/*.json")
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        warm, _, _, stats = _steps([4])
    assert "unusable" in caplog.text
    assert stats == {"rebuilt": 1, "loaded": 1, "linked": 1} and _equal(cold, warm)
    assert _steps([4])[3] == {"loaded": 1, "direct": 1}


def test_a_folder_in_place_of_an_entry_or_a_link_never_fails_a_compile(cache_dir, caplog):
    """A folder where an entry or a link was (or a cache it cannot write) cannot be removed: the
    compile runs the stages and AOTAutograd again, logs why, and equals the cold one."""
    cold, _, _, _ = _steps([4])
    for path in [*_entries(cache_dir), *cache_dir.glob("stages/links/*.json")]:
        path.unlink()
        (path / "x").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="k3compile"):
        warm, _, _, stats = _steps([4])
    assert caplog.text.count("not removed (IsADirectoryError") == 2, caplog.text
    assert stats["rebuilt"] == 2 and _equal(cold, warm)


@pytest.mark.slow
def test_a_second_process_loads_every_bucket(tmp_path):
    """benchmarks/compile_time.py on the tiny model (CPU, two buckets and B1xT8): the warm pass
    loads every bucket's stages, traces no pattern and gives bitwise the cold pass's outputs."""
    env = {**os.environ, "K3_STAGE_CACHE": "1", "K3_QUIET": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_time.py"), "--config", "tiny",
         "--device", "cpu", "--batches", "1,4", "--verify", "8", "--executor", "aten",
         "--context", "64", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "compile_time.json").read_text())
    assert all(b["stage_cache"] == {"missed": 1, "stored": 1, "linked": 1}
               for b in report["cold"]["buckets"])
    assert all(b["stage_cache"] == {"loaded": 1, "direct": 1} for b in report["warm"]["buckets"])
    assert report["problems"] == []


def test_fx_key_misses_name_the_details_whose_hashes_differ(tmp_path):
    """compile_time.py --fx-keys: a warm key the cold pass did not compute is explained by the
    detail lines whose hashes differ from the nearest cold key (not by a value's text alone, as
    a function's address that changes between processes)."""
    from tests.conftest import load_benchmark

    ct = load_benchmark("compile_time")
    head = "FX graph cache hash details for key "

    def entry(key, *lines):
        return head + key + ":\n" + "\n".join(lines) + "\n\n"

    same = ("[aaa] gm: graph", "[bbb] fx_kwargs[get_decomp_fn]: <function at 0x1>")
    (tmp_path / "fx_keys_cold.txt").write_text(
        entry("k1", *same, "[ccc] fx_kwargs[cudagraphs]: BoxedBool(value=True)")
        + entry("k9", "[zzz] gm: other"))
    (tmp_path / "fx_keys_warm.txt").write_text(
        entry("k1", *same, "[ccc] fx_kwargs[cudagraphs]: BoxedBool(value=True)")
        + entry("k2", "[aaa] gm: graph", "[bbb] fx_kwargs[get_decomp_fn]: <function at 0x2>",
                "[ddd] fx_kwargs[cudagraphs]: BoxedBool(value=False)"))
    (miss,) = ct.fx_key_misses(tmp_path)
    assert miss.startswith("k2: 2 lines differ")
    assert "warm: [ddd]" in miss and "cold: [ccc]" in miss and "get_decomp_fn" not in miss


@pytest.mark.parametrize("cold_had_it", [False, True])
def test_the_direct_compile_passes_inductor_what_the_cold_one_got(monkeypatch, cold_had_it):
    """Inductor's FX graph cache hashes `compile_fx_inner`'s arguments (a function by its repr,
    address included). torch 2.11's `compile_fx` passes no `get_decomp_fn`; the direct path
    passed one anyway, so every warm process missed the cache (2.11 on the CPU, session 16:
    "fx_kwargs[get_decomp_fn]: <function select_decomp_table at 0x...>" only in the warm key)."""
    from torch._inductor.decomposition import select_decomp_table

    cold_kwargs = {"static_input_idxs": [1], "graph_id": 3}
    if cold_had_it:
        cold_kwargs["get_decomp_fn"] = select_decomp_table
    data = inductor.compile_kwargs(cold_kwargs)
    seen = {}
    monkeypatch.setattr(inductor, "compile_fx_inner", lambda gm, fakes, **kw: seen.update(kw))
    monkeypatch.setattr(inductor, "register_fallbacks", lambda gm: None)
    gm = torch.fx.symbolic_trace(lambda x: (x + 1,))
    inductor.compile_fx_inner_direct(gm, [torch.zeros(2)], data)
    assert ("get_decomp_fn" in seen) == cold_had_it
    assert seen["static_input_idxs"] == [1] and seen["graph_id"] == 3


if __name__ == "__main__":
    _one_process(Path(sys.argv[1]))
