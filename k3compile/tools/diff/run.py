"""Compiling the model for the report: a built-in config (cut to N layers, batch buckets, verify
rows T) or a user's `module:factory`, with `backend="k3"` inside `capture()`; at world size > 1
one process per rank under gloo on CPU, rank 0's report pickled back."""

from __future__ import annotations

import dataclasses
import importlib
import os
import pickle
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from k3compile import backend
from k3compile.tools.diff.analyze import analyze, capture
from k3compile.tools.diff.report import DiffReport


@dataclasses.dataclass
class Spec:
    config: str | None = "tiny"
    model: str | None = None  # "module:factory" -> (model, example_inputs)
    batches: tuple[int, ...] = (2,)
    T: int = 1
    world_size: int = 1
    layers: int | None = None
    dtype: str = "bfloat16"
    options: dict = dataclasses.field(default_factory=dict)
    stages: tuple[str, str] | None = None
    device: str = "cpu"


def _builtin(spec: Spec, group, world_size: int):
    from k3compile.models import build_model, get_config

    cfg = get_config(spec.config, world_size if world_size > 1 else None)
    if spec.layers:
        cfg = cfg.with_layers(spec.layers)
    device = torch.device(spec.device)
    model = build_model(cfg, device=device, dtype=getattr(torch, spec.dtype), group=group,
                        max_batch=max(spec.batches), max_seq_len=64 + spec.T)
    calls = []
    gen = torch.Generator().manual_seed(0)
    for b in spec.batches:
        shape = (b,) if spec.T == 1 else (b, spec.T)
        ids = torch.randint(0, cfg.vocab_size, shape, generator=gen).to(device)
        pos = torch.zeros(b, dtype=torch.long, device=device)
        slots = torch.arange(b, device=device)
        for t in (ids, pos, slots):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        calls.append(((ids, pos, slots), {}))
    return model, calls


def load_factory(text: str):
    """`module:factory` -> the factory (a function returning (model, example_inputs))."""
    module, _, name = text.partition(":")
    if not module or not name:
        raise ValueError(f"wants module:factory, got {text!r}")
    return getattr(importlib.import_module(module), name)


def _factory(spec: Spec):
    model, example = load_factory(spec.model)()
    call = ((), dict(example)) if isinstance(example, dict) else (tuple(example), {})
    return model, [call]


def _compile(spec: Spec, group=None, world_size: int = 1) -> DiffReport:
    model, calls = _factory(spec) if spec.model else _builtin(spec, group, world_size)
    options = {**spec.options, "strict": False, "keep_graphs": True}
    options.setdefault("executor", "aten")
    torch._dynamo.reset()  # a model compiled before in this process would hit Dynamo's cache
    backend.ensure_registered()
    n0 = len(backend._compiled)
    t0 = time.perf_counter()
    failed = None
    with capture() as captured, torch.no_grad():
        compiled_model = torch.compile(model, backend="k3", fullgraph=spec.model is None,
                                       options=options)
        for args, kwargs in calls:
            try:
                compiled_model(*args, **kwargs)
            except Exception as e:  # report what compiled, then say it failed
                if len(backend._compiled) == n0:
                    raise
                failed = f"the compiled graph failed at run time: {type(e).__name__}: {e}"[:400]
                break
    seconds = time.perf_counter() - t0
    new = backend._compiled[n0:]
    if not new:
        raise RuntimeError("the model compiled no graph with backend='k3'")
    cut = f" (first {spec.layers} layers)" if spec.layers else ""
    source = spec.model or f"config {spec.config}{cut}"
    batches = [int(a[0].shape[0]) if a and isinstance(a[0], torch.Tensor) else 0 for a, _ in calls]
    if spec.model is None:
        # fullgraph: several graphs are recompiles (Dynamo specialises batch 1): one per bucket
        reports = [analyze(c, spec.stages, captured=captured) for c in new]
        report = reports[0]
        for other in reports[1:]:
            report.buckets += other.buckets
            report.guards = report.guards or other.guards
            report.symbol = report.symbol or other.symbol
    else:  # with graph breaks the decode step is the graph with the most nodes
        report = analyze(max(new, key=lambda c: len(c.gm.graph.nodes)), spec.stages,
                         captured=captured)
        if len(new) > 1:
            report.notes.append(f"{len(new)} graphs compiled (graph breaks or recompiles); "
                                "reporting the largest")
    report.source, report.batches, report.T = source, batches, spec.T
    report.world_size, report.graphs, report.seconds = world_size, len(new), seconds
    if failed:
        report.notes.append(failed)
    return report


def _worker(rank: int, spec: Spec, store: str, out: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a FileStore of this run's own: a TCP port picked free and bound later could meet another
    # job's group on this machine
    dist.init_process_group("gloo", store=dist.FileStore(store, spec.world_size), rank=rank,
                            world_size=spec.world_size)
    try:
        report = _compile(spec, dist.group.WORLD, spec.world_size)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(report))
    finally:
        dist.destroy_process_group()


def run(config: str | None = "tiny", model: str | None = None, batch: int | Sequence[int] = 2,
        T: int = 1, world_size: int = 1, layers: int | None = None, dtype: str = "bfloat16",
        options: dict | None = None, stages: tuple[str, str] | None = None,
        device: str = "cpu") -> DiffReport:
    """Compile a built-in config (or `module:factory`) with backend "k3" and report.

    With world_size > 1 every rank compiles its tensor-parallel slice under gloo and rank 0
    reports; a factory then runs in every rank, after the process group is up
    (`torch.distributed.group.WORLD`). Resets Dynamo's caches first."""
    batches = (batch,) if isinstance(batch, int) else tuple(batch)
    spec = Spec(config, model, batches, T, world_size, layers, dtype, dict(options or {}),
                tuple(stages) if stages else None, device)
    if world_size <= 1:
        return _compile(spec)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.pkl")
        mp.spawn(_worker, args=(spec, os.path.join(tmp, "store"), out), nprocs=world_size,
                 join=True)
        report = pickle.loads(Path(out).read_bytes())
    report.notes.append(f"world size {world_size}: gloo on CPU, rank 0's graph shown")
    return report
