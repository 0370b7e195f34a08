"""Traced pattern graphs on disk (k3compile/rewrite/trace_cache.py, K3_CACHE_DIR/patterns).

A pattern traced once is stored; a fresh pattern object (as in a new process) loads it instead of
tracing, and gets the same matcher pattern and search graph, so the same rewrites, bit for bit.
Each trace route is covered (fwd_only, fake, joint passes). Every corrupt or stale entry
(flipped byte, truncated, not JSON, another format or key, an op this torch lacks) is logged,
traced again and rewritten, never loaded. The key follows the inputs and the source. `slow`: a
second process loads every variant of the tiny model's compile and gives bitwise the outputs
of the cold one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from k3compile.patterns import allreduce_attn_res_mix_norm, linear_concat, rms_norm

import k3compile.ops  # noqa: F401
from k3compile import settings
from k3compile.math import rms_norm as rms_norm_math
from k3compile.rewrite import apply_patterns, inductor, trace_cache

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "cache_dir", str(tmp_path / "k3cache"))
    monkeypatch.setattr(trace_cache, "STATS", Counter())
    return tmp_path / "k3cache"


# one variant per trace route: make_fx, fake tensors (a collective), Inductor's joint passes
ROUTES = {
    "fwd_only": lambda: rms_norm.patterns()[0],
    "fake": lambda: allreduce_attn_res_mix_norm.patterns()[0],
    "joint": lambda: next(p for p in linear_concat.patterns() if p.joint_passes),
}


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("patterns/*/*.json"))


def _same(a, b) -> None:
    assert repr(a.expr) == repr(b.expr)
    assert a._search_gm.code == b._search_gm.code
    assert a.op_signature == b.op_signature
    shapes = [{n.name: inductor.traced_shape(n) for n in p._search_gm.graph.nodes} for p in (a, b)]
    assert shapes[0] == shapes[1] and any(shapes[0].values())  # kept for the view check


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_fresh_pattern_loads_the_stored_trace(cache_dir, route):
    cold = ROUTES[route]()
    cold.expr  # noqa: B018
    assert trace_cache.stats() == {"traced": 1, "stored": 1}
    (entry,) = _entries(cache_dir)
    warm = ROUTES[route]()  # a new object: nothing cached in memory
    warm.expr  # noqa: B018
    assert trace_cache.stats() == {"traced": 1, "stored": 1, "loaded": 1}
    _same(cold, warm)
    assert _entries(cache_dir) == [entry]


def _rms_site():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 1, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    gm = inductor.fwd_only_fake(lambda x, w: rms_norm_math(x, w, 1e-6) * 2, [x, w])
    return gm, [x, w]


def test_a_loaded_trace_rewrites_as_the_traced_one(cache_dir):
    outs = []
    for _ in range(2):  # traced, then loaded
        gm, args = _rms_site()
        report = apply_patterns(gm.graph, rms_norm.patterns())
        gm.recompile()
        outs.append((dict(report.counts), gm.code, gm(*args)))
    assert trace_cache.stats()["loaded"] == 2  # both dtype variants
    assert outs[0][0] == outs[1][0] == {"rms_norm[bfloat16]": 1}
    assert outs[0][1] == outs[1][1]
    assert torch.equal(outs[0][2], outs[1][2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    i = data.index(b"aten::") + 2  # inside the graph: its checksum no longer holds
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _rekey(path: Path, what: str) -> None:
    entry = json.loads(path.read_text())
    if what == "format":
        entry["format"] += 1
    elif what == "key":
        entry["key"] = entry["key"].replace('"torch": ["', '"torch": ["0.0+old')
    elif what == "op":  # a graph naming an op this torch lacks, its checksum made right
        entry["graph"] = entry["graph"].replace("aten::rsqrt", "aten::no_such_op")
        entry["sha256"] = hashlib.sha256(entry["graph"].encode()).hexdigest()
    path.write_text(json.dumps(entry))


BAD = {
    "flipped": _flip,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:100]),
    "empty": lambda p: p.write_bytes(b""),
    "not_json": lambda p: p.write_bytes(b"\x00K3 not an entry"),
    "format": lambda p: _rekey(p, "format"),
    "key": lambda p: _rekey(p, "key"),
    "op": lambda p: _rekey(p, "op"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_entry_is_traced_again_never_loaded(cache_dir, bad, caplog):
    cold = rms_norm.patterns()[0]
    cold.expr  # noqa: B018
    (entry,) = _entries(cache_dir)
    good = entry.read_bytes()
    BAD[bad](entry)
    warm = rms_norm.patterns()[0]
    with caplog.at_level(logging.WARNING, logger="k3compile.rewrite"):
        warm.expr  # noqa: B018
    assert trace_cache.stats() == {"traced": 2, "stored": 2, "rebuilt": 1}
    assert "unusable" in caplog.text and "tracing again" in caplog.text
    _same(cold, warm)
    assert entry.read_bytes() == good  # rewritten whole
    again = rms_norm.patterns()[0]
    again.expr  # noqa: B018
    assert trace_cache.stats()["loaded"] == 1


def test_the_key_follows_inputs_and_source(cache_dir, monkeypatch):
    bf16, fp32 = rms_norm.patterns()
    bf16.expr, fp32.expr  # noqa: B018
    assert len(_entries(cache_dir)) == 2  # the dtype of the example inputs is in the key
    monkeypatch.setattr(trace_cache, "sources", lambda folders: "edited")
    edited = rms_norm.patterns()[0]
    edited.expr  # noqa: B018
    assert trace_cache.stats() == {"traced": 3, "stored": 3}
    assert len(_entries(cache_dir)) == 3


def test_the_cache_off_stores_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "cache_dir", None)
    monkeypatch.setattr(trace_cache, "STATS", Counter())
    rms_norm.patterns()[0].expr  # noqa: B018
    assert trace_cache.stats() == {}


def test_an_unwritable_folder_only_costs_the_trace(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setattr(settings.KERNELS, "cache_dir", str(blocked))
    monkeypatch.setattr(trace_cache, "STATS", Counter())
    p = rms_norm.patterns()[0]
    p.expr  # noqa: B018
    assert trace_cache.stats() == {"traced": 1, "unstored": 1}


@pytest.mark.slow
def test_a_second_process_loads_every_trace_and_compiles_the_same(tmp_path):
    """Two processes compile the tiny model's B2 bucket (executor aten) with one cache folder:
    the second traces no pattern and returns bitwise the first's outputs."""
    script = ROOT / "benchmarks" / "compile_time.py"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(script), "--config", "tiny", "--device", "cpu",
                    "--batches", "2", "--verify", "0", "--executor", "aten", "--context", "64",
                    "--cache-dir", str(tmp_path / "cache"), "--out", str(out)],
                   env=env, check=True, cwd=ROOT, timeout=1200)
    report = json.loads((out / "compile_time.json").read_text())
    cold, warm = report["cold"]["buckets"][0], report["warm"]["buckets"][0]
    assert cold["patterns"].get("traced") and not cold["patterns"].get("loaded")
    assert warm["patterns"].get("loaded") == cold["patterns"]["traced"]
    assert not warm["patterns"].get("traced")
    assert warm["outputs_sha256"] == cold["outputs_sha256"]
    assert report["problems"] == []


def test_the_key_follows_what_the_search_closes_over(cache_dir):
    def variant(flag):
        def search(x, w):
            return rms_norm_math(x, w, 1e-6) * (2 if flag else 3)
        return search

    x, w = torch.randn(2, 8), torch.randn(8)
    a = trace_cache.key_text("p", variant(True), inductor.fwd_only, [x, w], {})
    b = trace_cache.key_text("p", variant(False), inductor.fwd_only, [x, w], {})
    assert a is not None and b is not None and a != b
    table = torch.ones(8)  # a closed-over tensor has no stable description: not stored

    def search(x, w):
        return x * table + w

    assert trace_cache.key_text("p", search, inductor.fwd_only, [x, w], {}) is None
