"""Weight-streaming GEMV (kernels/common/gemv.py) against cuBLAS (F.linear) at one K3 TP16 rank's shapes.

    python benchmarks/gemv.py [--m 1,8,16] [--only 3206x7168,896x7168] [--out DIR or r.json]
    python benchmarks/gemv.py --sweep [--m 1,16] [--jobs 12] [--budget 150] --out DIR  # every Config
    python benchmarks/gemv.py --table-from DIR/gemv_sweep.json --table kernels/common/gemv_tuned.json

Both sides are captured into CUDA graphs, >= CALLS calls per graph, each call reading the next
copy of W (enough copies that >= 2 x 60 MB of weights pass between two reads of one copy, so the
L2 does not serve them); x stays L2-resident, as in a decode step. Time per call = median over
replays of graph time / calls. GB/s counts W bytes only; "% copy" compares it with a 4 GiB
device-to-device copy measured in the same run (read + write bytes).

The sweep times every `gemv.configs()` entry (R rows per block, T threads, C persistent CTAs per
SM) and the heuristic config, each checked against cuBLAS first, and prints the best against the
copy bandwidth; above GEMV_MAX_M rows also what `router.linear` runs there now (gemm_tc or
cuBLAS), for the routing decision. With --out it writes DIR/gemv_sweep.json and, shape by shape (a sweep cut short
by --budget keeps what it timed), the table `gemv.tuned()` reads: DIR/gemv_tuned.json (copy it
over kernels/common/ to ship it; --table PATH writes it elsewhere).
"""

import argparse
import functools
import json
import re
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from graph_timing import graph_us as replay_us
from k3compile.kernels.common import gemv, router
from k3compile.kernels.common.gemm import GEMV_MAX_M

# [N, K] of one TP16 rank (see tests/kernels/test_gemv.py)
SHAPES = [(3206, 7168), (2112, 7168), (3584, 7168), (7168, 3584), (896, 7168), (7168, 768),
          (768, 7168), (1152, 1536), (7168, 384), (768, 128)]
L2_BYTES = 60e6
CALLS, REPLAYS = 24, 30
NOISE = 0.02  # a tuned config replaces the heuristic's only when faster by more than this


def copy_gbps() -> float:
    """Device-to-device copy of 4 GiB, bytes read + written per second (the NOTES ceiling)."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (4 << 30) / min(times) / 1e9


def graph_us(call, weights) -> float:
    """Median µs per call of call(w), at least CALLS calls per graph, cycling over every weight
    copy (whole cycles: each copy is read as often as the others)."""
    calls = -(-CALLS // len(weights)) * len(weights)
    return replay_us([functools.partial(call, weights[i % len(weights)]) for i in range(calls)],
                     [functools.partial(call, w) for w in weights[:2]], REPLAYS)


def weight_copies(n, k):
    bytes_ = 2 * n * k
    count = max(3, -(-int(2 * L2_BYTES) // bytes_) + 1)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
    return [w] + [w.clone() for _ in range(count - 1)]


def gemv_call(x, out, cfg=None):
    return lambda w: gemv.gemv_cuda(x, w, out=out, cfg=cfg)


def check(x, w, out, cfg=None):
    """The kernel ran and agrees with cuBLAS (a benchmark of wrong results is worthless)."""
    y = gemv.gemv_cuda(x, w, out=out, cfg=cfg)
    assert y is out, f"gemv refused {tuple(x.shape)} x {tuple(w.shape)} (see the log)"
    ref = F.linear(x, w).float()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"gemv disagrees with cuBLAS: relative error {err:.2e}"


def run(shapes, ms, gbps):
    rows = []
    for n, k in shapes:
        weights = weight_copies(n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            check(x, weights[0], out)
            t_gemv = graph_us(gemv_call(x, out), weights)
            t_mm = graph_us(functools.partial(F.linear, x), weights)
            moved = 2 * n * k
            row = {"N": n, "K": k, "M": m, "config": str(gemv.config(n, k, gemv.bucket(m))),
                   "gemv_us": round(t_gemv, 2), "mm_us": round(t_mm, 2),
                   "gemv_GBps": round(moved / t_gemv / 1e3), "mm_GBps": round(moved / t_mm / 1e3),
                   "speedup": round(t_mm / t_gemv, 2)}
            row["gemv_pct_copy"] = round(100 * row["gemv_GBps"] / gbps, 1)
            row["mm_pct_copy"] = round(100 * row["mm_GBps"] / gbps, 1)
            rows.append(row)
            print(f"{n:5d} x {k:5d} M={m:2d}  gemv {t_gemv:6.2f} us {row['gemv_GBps']:5d} GB/s "
                  f"{row['gemv_pct_copy']:5.1f}%  mm {t_mm:6.2f} us {row['mm_GBps']:5d} GB/s "
                  f"{row['mm_pct_copy']:5.1f}%  x{row['speedup']:.2f}  {row['config']}",
                  flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def sweep_inputs(shapes, ms):
    """(n, k, m, x, out, weights) for every shape and M of a config sweep: x and a bf16 output per
    M, the weight copies rotated past L2 per shape (freed after it)."""
    for n, k in shapes:
        weights = weight_copies(n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            yield n, k, m, x, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), weights
        del weights
        torch.cuda.empty_cache()


def time_configs(configs, x, weights, out, call, check) -> dict:
    """µs per call of each config (`call(x, out, cfg)`), each checked first (`check`)."""
    results = {}
    for cfg in configs:
        check(x, weights[0], out, cfg)
        results[cfg] = graph_us(call(x, out, cfg), weights)
    return results


def sweep_configs(n: int, k: int, m: int) -> list:
    """The heuristic's config and every `gemv.configs()` entry at this shape and M."""
    b = gemv.bucket(m)
    return list(dict.fromkeys([gemv.heuristic_config(n, k, b), *gemv.configs(n, k, b)]))


def precompile(shapes, ms, jobs: int) -> None:
    """Build every config the sweep times in `jobs` processes first, into the on-disk kernel
    cache (K3_CACHE_DIR), so that the timing loop loads them instead of compiling one by one."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    work = [(n, k, m, cfg) for n, k in shapes for m in ms for cfg in sweep_configs(n, k, m)]
    start = time.time()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile, work, chunksize=2))
    print(f"{len(work)} builds in {jobs} processes: {time.time() - start:.0f} s", flush=True)


def _compile(item) -> None:
    n, k, m, cfg = item  # as gemv_cuda compiles it: bf16 output, no residual
    b = gemv.bucket(m)
    gemv.KERNEL.compiled(n, k, b, False, False, cfg, rows=b, fusion=gemv.PLAIN)


def short(cfg) -> str:
    return f"R{cfg.rows_per_cta}/T{cfg.threads}" + (f"/C{cfg.ctas_per_sm}" if cfg.ctas_per_sm
                                                     else "")


def sweep(shapes, ms, gbps):
    """Every Config at each shape and M, and the heuristic's (tunes `gemv.config`)."""
    rows = []
    for n, k, m, x, out, weights in sweep_inputs(shapes, ms):
        default = gemv.heuristic_config(n, k, gemv.bucket(m))
        results = time_configs(sweep_configs(n, k, m), x, weights, out, gemv_call, check)
        ranked = sorted(results, key=results.get)
        best, moved = ranked[0], 2 * n * k
        pct = {c: round(100 * moved / results[c] / 1e3 / gbps, 1) for c in ranked}
        row = {"N": n, "K": k, "M": m, "default": str(default), "best": str(best),
               "us": {str(c): round(results[c], 2) for c in ranked},
               "pct_copy": {str(c): pct[c] for c in ranked}}
        other = ""
        if m > GEMV_MAX_M:  # what decode runs at this M now: gemm_tc or cuBLAS (router.linear)
            row["router_us"] = round(graph_us(lambda w, x=x: router.linear(x, w), weights), 2)
            other = (f"  router {row['router_us']:.2f} us "
                     f"{100 * moved / row['router_us'] / 1e3 / gbps:.1f}%")
        rows.append(row)
        print(f"{n:5d} x {k:5d} M={m:2d}  default {short(default)} {results[default]:.2f} us "
              f"{pct[default]:.1f}%  best {short(best)} {results[best]:.2f} us "
              f"{round(moved / results[best] / 1e3)} GB/s {pct[best]:.1f}% of copy{other} | " +
              "  ".join(f"{short(c)}={results[c]:.2f}" for c in ranked[1:8]), flush=True)
    return rows


def parse_config(text: str) -> dict:
    """'Config(tile_rows=64, ...)' -> {'tile_rows': 64, ...}"""
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}


def merge_table(path, new: list[dict], device: str, source: str) -> list[dict]:
    """Merge `new` entries ({"N", "K", "bucket", ...}) into the tuned table at `path`, one entry
    a line; entries of other shapes are kept where measured on this device. Returns them all."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() else {"entries": []}
    keys = {(e["N"], e["K"], e["bucket"]) for e in new}
    kept = [e for e in old["entries"] if (e["N"], e["K"], e["bucket"]) not in keys
            and old.get("device") == device]
    entries = sorted(kept + new, key=lambda e: (e["N"], e["K"], e["bucket"]))
    lines = ",\n  ".join(json.dumps(e) for e in entries)
    path.write_text(f'{{"device": {json.dumps(device)}, "source": {json.dumps(source)},\n'
                    f' "entries": [\n  {lines}\n]}}\n')
    return entries


def table_entries(rows) -> list[dict]:
    """The config per (N, K, bucket) of sweep rows: the fastest, unless the heuristic's is within
    NOISE of it (then the heuristic's: a change must pay); of several M per bucket, the largest."""
    best = {}
    for r in rows:
        pick = r["best"] if r["us"][r["best"]] < (1 - NOISE) * r["us"][r["default"]] \
            else r["default"]
        key = (r["N"], r["K"], gemv.bucket(r["M"]))
        best[key] = {"N": r["N"], "K": r["K"], "bucket": key[2], "M": r["M"],
                     "config": parse_config(pick), "us": r["us"][pick],
                     "default_us": r["us"][r["default"]], "pct_copy": r["pct_copy"][pick],
                     **({"router_us": r["router_us"]} if "router_us" in r else {})}
    return list(best.values())


def write_table(path, rows, device: str, source: str) -> None:
    entries = merge_table(path, table_entries(rows), device, source)
    print(f"{path}: {len(entries)} entries, "
          f"{sum(e['us'] < e['default_us'] for e in entries)} off the heuristic")


def setup(opts, shapes_default) -> tuple[list[int], list[tuple[int, int]], float]:
    """The M values and shapes asked for (--m, --only), the measured copy bandwidth, printed."""
    from k3compile.kernels.common.dsl import runtime_refusal

    assert torch.cuda.is_available() and not runtime_refusal(), runtime_refusal() or "no GPU"
    torch.manual_seed(0)
    ms = [int(m) for m in opts.m.split(",")]
    shapes = [tuple(map(int, s.split("x"))) for s in opts.only.split(",")] if opts.only \
        else shapes_default
    gbps = copy_gbps()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"4 GiB device copy: {gbps:.0f} GB/s (read + write)", flush=True)
    return ms, shapes, gbps


def write_json(out: str | None, name: str, rows, gbps: float, **extra) -> None:
    """rows (with the device and copy bandwidth) to OUT/<name>.json; `out` a folder or a .json
    path; nothing without `out`."""
    if not out:
        return
    path = Path(out)
    if path.suffix != ".json":
        path.mkdir(parents=True, exist_ok=True)
        path = path / f"{name}.json"
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": round(gbps), **extra,
                   "rows": rows}, f, indent=1)


def chain_main(doc: str, name: str, run, default_m: str) -> None:
    """The command line of a benchmark that times `run(ms)` at --m rows and writes its rows to
    --out/<name>.json (pdl_chain, gemv_fused)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--m", default=default_m)
    ap.add_argument("--out", help="folder (or .json path) for the JSON")
    opts = ap.parse_args()
    opts.only = None
    ms, _, gbps = setup(opts, [])
    write_json(opts.out, name, run(ms), gbps)


def report(rows, gbps, opts, name: str, key: str) -> None:
    """rows to OUT/<name>.json (--out: a folder, or a .json path) and, unless sweeping, a table
    of the kernel (its row fields `<key>_us` ...) against torch.mm."""
    write_json(opts.out, f"{name}{'_sweep' if opts.sweep else ''}", rows, gbps, sweep=opts.sweep)
    if opts.sweep:
        return
    print(f"\n| weight [N, K] | M | {name} µs | GB/s | % copy | torch.mm µs | GB/s | % copy | "
          "speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['N']} × {r['K']} | {r['M']} | {r[key + '_us']:.2f} | {r[key + '_GBps']} | "
              f"{r[key + '_pct_copy']} | {r['mm_us']:.2f} | {r['mm_GBps']} | {r['mm_pct_copy']} | "
              f"x{r['speedup']:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,8,16")
    ap.add_argument("--only", help="shapes as NxK, comma-separated")
    ap.add_argument("--sweep", action="store_true", help="time every config instead")
    ap.add_argument("--budget", type=float, help="sweep: start no shape after this many seconds")
    ap.add_argument("--jobs", type=int, default=0,
                    help="sweep: build every config in this many processes first (disk cache)")
    ap.add_argument("--out", help="folder (or .json path) for the JSON")
    ap.add_argument("--table", help="sweep: the tuned table to merge the winners into (default: "
                    "OUT/gemv_tuned.json with a folder --out)")
    ap.add_argument("--table-from", help="take the sweep rows from this saved JSON instead")
    opts = ap.parse_args()
    if opts.table_from:
        saved = json.loads(Path(opts.table_from).read_text())
        write_table(opts.table, saved["rows"], saved["device"], opts.table_from)
        return
    ms, shapes, gbps = setup(opts, SHAPES)
    if not opts.sweep:
        return report(run(shapes, ms, gbps), gbps, opts, "gemv", "gemv")
    table = opts.table or (opts.out and Path(opts.out).suffix != ".json"
                           and Path(opts.out) / "gemv_tuned.json")
    if opts.jobs:
        precompile(shapes, ms, opts.jobs)
    source, start, rows = f"benchmarks/gemv.py --sweep, {date.today()}", time.time(), []
    for shape in shapes:
        if opts.budget and time.time() - start > opts.budget:
            print(f"budget of {opts.budget:.0f} s spent: shapes from {shape} on not swept")
            break
        rows += sweep([shape], ms, gbps)
        report(rows, gbps, opts, "gemv", "gemv")
        if table:
            write_table(table, rows, torch.cuda.get_device_name(), source)


if __name__ == "__main__":
    main()
