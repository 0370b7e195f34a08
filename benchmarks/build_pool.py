"""A bucket's CuTe DSL kernels built one by one vs by a pool of processes (K3_BUILD_WORKERS).

    python benchmarks/build_pool.py --workers 0,2            # CPU: builds for CUTE_DSL_ARCH
    python benchmarks/build_pool.py --workers 0,4,8,15 --out out
    python benchmarks/build_pool.py --workers 4 --order slowest,recorded   # submission orders

The kernels: a B1 set at one K3 TP16 rank's shapes (`SET`: the kernels' `prepare` helpers at
bucket 1, their keys collected in record mode, kernels/common/launch.py), close to but not
exactly what the yardstick's B1 graph meets. For each worker count, a fresh K3_CACHE_DIR: 0
builds each in this process (`Kernel.compiled`, as the first call does today); N starts a pool
of N spawned processes (timed apart: in the backend it starts with the first compile and its
imports overlap the stages) and builds them there (kernels/common/build_pool.py); then this
process loads every kernel (none may be built). `--order`: the pool's submission order, slowest
first (build_pool.order: a fresh cache, so the ops' FAMILY_SECONDS) or as recorded (results under
"N:recorded"). Prints and writes build_pool.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
from k3compile.kernels import (
    attn_res_mix_norm,
    kda_decode,
    mla_decode,
    mla_lowrank_norm,
    moe_experts,
    moe_route,
    rms_norm,
    situ_gate_up,
)
from k3compile.kernels.common import build_pool, disk_cache, gemv
from k3compile.kernels.common.dsl import CompileCache, have_dsl
from k3compile.kernels.common.launch import Build, Kernel, recording

from k3compile import settings

B1 = (1,)
SET = [
    lambda: attn_res_mix_norm.prepare(7168, 8, True, B1),
    lambda: attn_res_mix_norm.prepare(7168, 8, False, B1),
    lambda: attn_res_mix_norm.prepare(7168, 3, True, B1),
    lambda: attn_res_mix_norm.prepare(7168, 0, True, B1),
    lambda: mla_lowrank_norm.prepare(1536, 512, 64, B1),
    lambda: rms_norm.prepare(3584, B1),
    lambda: moe_route.prepare(896, 16, B1),
    lambda: situ_gate_up.prepare(384, B1),
    lambda: kda_decode.prepare(1, 6, 4, B1),
    lambda: mla_decode.prepare(1, 6, 512, 64, B1),
    lambda: moe_experts.prepare(3584, 192, 16, B1),
    *(lambda n=n, k=k: gemv.prepare(n, k, B1) for n, k in [
        (3206, 7168), (2112, 7168), (3584, 7168), (7168, 3584), (768, 7168), (1152, 1536),
        (7168, 384)]),
    lambda: gemv.prepare(896, 7168, B1, out_dtype=torch.float32),
    lambda: gemv.prepare(7168, 768, B1, residual=True),
]


def kernel_set() -> list[Build]:
    """The keys of SET, recorded (nothing built: every compiled kernel a no-op)."""
    with recording() as rec:
        rec.probing = True
        for prepare in SET:
            prepare()
    return list(rec.builds.values())


def kernels() -> list[Kernel]:
    mods = (attn_res_mix_norm, kda_decode, mla_decode, mla_lowrank_norm, moe_experts, moe_route,
            rms_norm, situ_gate_up, gemv)
    return [m.KERNEL for m in mods]


def fresh(folder: Path) -> None:
    """A new cache folder, empty in-process caches and counters."""
    settings.KERNELS.cache_dir = str(folder)
    for k in kernels():
        k.cache = CompileCache(k.op)
    disk_cache.STATS.clear()


def serial(builds: list[Build], each: list[float] | None = None) -> tuple[float, float]:
    """Wall and CPU seconds of building (or loading) `builds` in this process (`each`: gets
    each one's wall seconds)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for b in builds:
        kernel = next(k for k in kernels() if k.op == b.op)
        t1 = time.perf_counter()
        kernel.compiled(*b.scalars, arch=b.arch, pdl=b.pdl, **dict(b.options))
        if each is not None:
            each.append(round(time.perf_counter() - t1, 2))
    return time.perf_counter() - t0, time.process_time() - c0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pooled(builds: list[Build], workers: int, recorded: bool = False) -> dict:
    t0 = time.perf_counter()
    c0 = children_cpu()
    pool = build_pool.start(workers)
    for f in [pool.submit(build_pool._ready) for _ in range(workers)]:
        f.result()  # the workers up, the DSL imported
    started = time.perf_counter() - t0
    t0 = time.perf_counter()
    order = build_pool.order
    if recorded:
        build_pool.order = list
    finished: list[tuple[str, float, int]] = []  # (op, worker seconds, worker) as they end
    try:
        done, failed = build_pool.build(builds, workers, lambda b: finished.append(
            (b.build.op, round(b.seconds, 2), b.worker)))
    finally:
        build_pool.order = order
    built = time.perf_counter() - t0
    build_pool.shutdown()
    cpu = children_cpu() - c0  # the workers' whole lives: start, imports, builds
    fresh(Path(settings.KERNELS.cache_dir))  # this process: load what the pool stored
    loaded, _ = serial(builds)
    return {"start_s": round(started, 2), "build_s": round(built, 2),
            "workers_cpu_s": round(cpu, 1), "built": done, "failed": failed,
            "load_s": round(loaded, 3), "stats": dict(disk_cache.STATS), "finished": finished}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="0,2", help="comma list; 0: one by one in this process")
    p.add_argument("--order", default="slowest",
                   help="comma list of pool submission orders: slowest, recorded")
    p.add_argument("--out", default="out")
    args = p.parse_args(argv)
    if not have_dsl():
        raise SystemExit("needs nvidia-cutlass-dsl")
    arch = os.environ.get("CUTE_DSL_ARCH") or "detected"
    with tempfile.TemporaryDirectory(prefix="k3-pool-") as tmp:
        fresh(Path(tmp) / "keys")
        builds = kernel_set()
        print(f"{len(builds)} kernels ({arch}, {os.cpu_count()} cores, load "
              f"{os.getloadavg()[0]:.1f})", flush=True)
        results = {}
        runs = [(int(w), o) for w in args.workers.split(",")
                for o in (["slowest"] if w == "0" else args.order.split(","))]
        for workers, order in runs:
            name = str(workers) if order == "slowest" else f"{workers}:{order}"
            fresh(Path(tmp) / f"w{workers}{order}")
            if workers == 0:
                each: list[float] = []
                wall, cpu = serial(builds, each)
                results[name] = {"build_s": round(wall, 2), "cpu_s": round(cpu, 1),
                                 "stats": dict(disk_cache.STATS),
                                 "each_s": [(b.op, s) for b, s in zip(builds, each)]}
            else:
                results[name] = pooled(builds, workers, recorded=order == "recorded")
            print(f"workers {name}: {json.dumps(results[name])}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "build_pool.json").write_text(json.dumps(
        {"kernels": len(builds), "arch": arch, "cores": os.cpu_count(),
         "ops": sorted({b.op for b in builds}), "results": results}, indent=1))
    bad = [w for w, r in results.items() if w != "0" and (r["failed"] or r["stats"].get("built"))]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
