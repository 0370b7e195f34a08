"""Tensor-core skinny GEMM (kernels/common/gemm_tc.py) against cuBLAS (F.linear) at one K3 TP16 rank's
shapes, M = 2..64 rows.

    python benchmarks/gemm_tc.py [--m 2,8,64] [--only 768x7168] [--gemv] [--out DIR]
    python benchmarks/gemm_tc.py --sweep --m 8,64 --only 768x7168,7168x768 [--out DIR]
    python benchmarks/gemm_tc.py [--sweep] --table kernels/common/gemm_tc_tuned.json   # ship the winners
    python benchmarks/gemm_tc.py --sweep --table kernels/common/gemm_tc_tuned_h100.json  # on an H100
    python benchmarks/gemm_tc.py --table-from DIR/gemm_tc.json --table kernels/common/gemm_tc_tuned.json
    python benchmarks/gemm_tc.py --fused [--m 2,8,64] [--out DIR]   # the one-launch variants
    python benchmarks/gemm_tc.py --fixed [--m 8] [--only 768x7168] [--out DIR]  # cost per launch

Timing as benchmarks/gemv.py (whose helpers it uses): both sides captured into CUDA graphs, each
call reading the next copy of W (>= 2 x 60 MB of weights between two reads of one copy), x
L2-resident; µs per call = median over replays of graph time / calls. GB/s counts W bytes only;
"% copy" compares with a 4 GiB device copy of the same run (read + write). `--gemv` adds the
CUDA-core gemv at M <= 16. The sweep times every `gemm_tc.configs()` entry (each checked against
cuBLAS first), best first. JSON: DIR/gemm_tc.json or DIR/gemm_tc_sweep.json. `--table` merges
the measured winner of every (shape, bucket) into the table `gemm_tc.tuned()` reads: the best
config, or cuBLAS where it was faster (`router.linear` then keeps cuBLAS for that shape); one
table per GPU model, `gemm_tc_tuned_<name>.json` beside the H200's (`gemm.load_tuned`).
`--fused` times
the one-launch variants against the two launches they replace at one TP16 rank: the split over
the packed moe_front [W_r; W_d] against two `router.linear` calls, SiTU over the shared experts'
[W_g; W_u] against `router.linear` + the situ kernel, the norm prologue over the latent
up-projection [7168, 3584] against the rms_norm kernel + `router.linear` (where its re-read limit
refuses a bucket, "one launch" is torch: read the refusal in the log) (DIR/gemm_tc_fused.json).
`--fixed` splits each call's time into a cost per launch and a streaming rate (issue 21: why
the skinny shapes fall short of copy speed): gemm_tc at its config, cuBLAS and a device copy of
W (`copy_`, 2x the bytes) are timed over [N, K / d] for d in FIXED_DIVS, and a least-squares
line t = a + bytes / rate fitted to each (a: µs per launch, rate: GB/s of the marginal bytes);
gemm_tc also with PDL between the calls (`settings.KERNELS.pdl_max_rows` raised to 64 for that
timing; above 4 rows the decode runs without it) (DIR/gemm_tc_fixed.json).
"""

import argparse
import functools
import json
from datetime import date
from pathlib import Path

import numpy
import torch
import torch.nn.functional as F
from gemv import (
    graph_us,
    merge_table,
    parse_config,
    report,
    setup,
    sweep_inputs,
    time_configs,
    weight_copies,
    write_json,
)
from k3compile.kernels.common import gemm_tc, gemv

# [N, K] of one TP16 rank (see tests/kernels/test_gemm_tc.py), and the packed moe_front
# [W_r; W_d] that gemm_tc's split variant reads (its `prefers` entry)
SHAPES = [(3206, 7168), (2112, 7168), (3584, 7168), (7168, 3584), (896, 7168), (7168, 768),
          (768, 7168), (1152, 1536), (7168, 384), (768, 128), (4480, 7168)]
# the variants' composites at one TP16 rank: (variant, N, K, split or I)
FUSED = [("split", 4480, 7168, 896), ("situ", 768, 7168, 384), ("norm", 7168, 3584, 0)]
MS = (2, 4, 8, 16, 32, 64)
MAX_PDL_ROWS = 64  # --fixed: PDL at every bucket for its PDL timing
FIXED_DIVS = (1, 2, 4)  # --fixed: K, K/2, K/4 at the same config


def tc_call(x, out, cfg=None):
    return lambda w: gemm_tc.gemm_tc_cuda(x, w, out=out, cfg=cfg)


def gemv_call(x, out):
    return lambda w: gemv.gemv_cuda(x, w, out=out)


def check(x, w, out, cfg=None):
    """The kernel ran and agrees with cuBLAS (a benchmark of wrong results is worthless)."""
    y = gemm_tc.gemm_tc_cuda(x, w, out=out, cfg=cfg)
    assert y is out, f"gemm_tc refused {tuple(x.shape)} x {tuple(w.shape)} (see the log)"
    ref = F.linear(x, w).float()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"gemm_tc {cfg} disagrees with cuBLAS: relative error {err:.2e}"


def run(shapes, ms, gbps, with_gemv):
    rows = []
    for n, k in shapes:
        weights = weight_copies(n, k)
        moved = 2 * n * k
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            check(x, weights[0], out)
            t_tc = graph_us(tc_call(x, out), weights)
            t_mm = graph_us(functools.partial(F.linear, x), weights)
            row = {"N": n, "K": k, "M": m, "config": str(gemm_tc.config(n, k, gemm_tc.bucket(m))),
                   "tc_us": round(t_tc, 2), "mm_us": round(t_mm, 2),
                   "tc_GBps": round(moved / t_tc / 1e3), "mm_GBps": round(moved / t_mm / 1e3),
                   "speedup": round(t_mm / t_tc, 2)}
            row["tc_pct_copy"] = round(100 * row["tc_GBps"] / gbps, 1)
            row["mm_pct_copy"] = round(100 * row["mm_GBps"] / gbps, 1)
            if with_gemv and m <= gemv.MAX_M:
                row["gemv_us"] = round(graph_us(gemv_call(x, out), weights), 2)
            rows.append(row)
            print(f"{n:5d} x {k:5d} M={m:2d}  tc {t_tc:6.2f} us {row['tc_GBps']:5d} GB/s "
                  f"{row['tc_pct_copy']:5.1f}%  mm {t_mm:6.2f} us {row['mm_GBps']:5d} GB/s "
                  f"{row['mm_pct_copy']:5.1f}%  x{row['speedup']:.2f}"
                  + (f"  gemv {row['gemv_us']:.2f} us" if "gemv_us" in row else "")
                  + f"  {row['config']}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def short(cfg) -> str:
    return f"R{cfg.tile_rows}/S{cfg.splits}/st{cfg.stages}"


def sweep(shapes, ms):
    """Every config at each shape and M (tunes `gemm_tc.config`)."""
    rows = []
    for n, k, m, x, out, weights in sweep_inputs(shapes, ms):
        results = time_configs(gemm_tc.configs(n, k, gemm_tc.bucket(m)), x, weights, out, tc_call,
                               check)
        t_mm = graph_us(functools.partial(F.linear, x), weights)
        ranked = sorted(results, key=results.get)
        chosen = gemm_tc.config(n, k, gemm_tc.bucket(m))
        if chosen not in results:
            results |= time_configs([chosen], x, weights, out, tc_call, check)
        rows.append({"N": n, "K": k, "M": m, "default": str(chosen), "best": str(ranked[0]),
                     "mm_us": round(t_mm, 2),
                     "us": {str(c): round(results[c], 2) for c in ranked}})
        print(f"{n:5d} x {k:5d} M={m:2d}  mm {t_mm:.2f} us  default {short(chosen)} "
              f"{results[chosen]:.2f} us  best {short(ranked[0])} {results[ranked[0]]:.2f} us"
              " | " + "  ".join(f"{short(c)}={results[c]:.2f}" for c in ranked[:8]),
              flush=True)
    return rows


def fused(ms):
    """Each one-launch variant against the two launches it replaces (weights rotated past L2),
    after checking that both agree."""
    from k3compile.kernels import situ_gate_up
    from k3compile.kernels.common import router
    from k3compile.kernels.rms_norm import rms_norm_cuda

    rows = []
    for variant, n, k, part in FUSED:
        weights = weight_copies(n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            if variant == "split":
                def one(w, x=x, part=part):
                    return gemm_tc.gemm_tc_split_cuda(x, w, part)

                def two(w, x=x, part=part):
                    return (router.linear(x, w[:part], out_dtype=torch.float32),
                            router.linear(x, w[part:]))
            elif variant == "norm":
                g = (1 + 0.1 * torch.randn(k, device="cuda")).bfloat16()

                def one(w, x=x, g=g):
                    return (gemm_tc.gemm_tc_norm_cuda(x, g, w, 1e-5),)

                def two(w, x=x, g=g):
                    return (router.linear(rms_norm_cuda(x, g, 1e-5), w),)
            else:
                def one(w, x=x):
                    return (gemm_tc.gemm_tc_situ_cuda(x, w, 4.0, 25.0),)

                def two(w, x=x):
                    return (situ_gate_up.situ_cuda(router.linear(x, w), 4.0, 25.0),)
            for a, b in zip(one(weights[0]), two(weights[0]), strict=True):
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert err < 1e-2, f"{variant} M={m}: one launch vs two: relative error {err:.2e}"
            t_one, t_two = graph_us(one, weights), graph_us(two, weights)
            cfg = gemm_tc.config(n, k, gemm_tc.bucket(m), gemm_tc.Fusion(split=part)
                                 if variant == "split" else gemm_tc.NORM if variant == "norm"
                                 else gemm_tc.SITU)
            rows.append({"variant": variant, "N": n, "K": k, "M": m, "config": str(cfg),
                         "one_us": round(t_one, 2), "two_us": round(t_two, 2)})
            print(f"{variant:5s} {n:5d} x {k:5d} M={m:2d}  one launch {t_one:6.2f} us  two "
                  f"{t_two:6.2f} us  x{t_two / t_one:.2f}  {short(cfg)}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def fit_line(points) -> tuple[float, float]:
    """Least squares t = a + bytes / rate over (bytes, µs) points: (a in µs, rate in GB/s)."""
    slope, a = numpy.polyfit(*zip(*points), 1)
    return float(a), float(1e-3 / slope)


def fixed(shapes, ms, gbps):
    """gemm_tc, cuBLAS and a copy of W over [N, K / d] (d in FIXED_DIVS) at gemm_tc's config for
    [N, K]: per launch µs and marginal GB/s of each (`fit_line`); gemm_tc with PDL at full K."""
    from k3compile.settings import KERNELS

    rows = []
    for n, k in shapes:
        for m in ms:
            cfg = gemm_tc.config(n, k, gemm_tc.bucket(m))
            times = {"tc": [], "mm": [], "copy": []}
            for d in FIXED_DIVS:
                kd = k // d // 64 * 64
                if kd // 64 < 2 * cfg.splits:  # each CTA keeps >= 2 K slices
                    continue
                weights = weight_copies(n, kd)
                x = torch.randn(m, kd, device="cuda").bfloat16()
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                check(x, weights[0], out, cfg)
                moved = 2 * n * kd
                times["tc"].append((moved, graph_us(tc_call(x, out, cfg), weights)))
                times["mm"].append((moved, graph_us(functools.partial(F.linear, x), weights)))
                dst = torch.empty_like(weights[0])
                times["copy"].append((moved, graph_us(dst.copy_, weights)))
                if d == 1:
                    before = KERNELS.pdl_max_rows
                    KERNELS.pdl_max_rows = MAX_PDL_ROWS
                    try:
                        t_pdl = graph_us(tc_call(x, out, cfg), weights)
                    finally:
                        KERNELS.pdl_max_rows = before
                del weights, dst
                torch.cuda.empty_cache()
            row = {"N": n, "K": k, "M": m, "config": str(cfg), "tc_pdl_us": round(t_pdl, 2)}
            for name, points in times.items():
                a, rate = fit_line(points)
                row |= {f"{name}_us": [round(t, 2) for _, t in points],
                        f"{name}_fixed_us": round(a, 2), f"{name}_rate_GBps": round(rate),
                        f"{name}_rate_pct_copy": round(100 * rate / gbps * (2 if name == "copy"
                                                                             else 1), 1)}
            rows.append(row)
            print(f"{n:5d} x {k:5d} M={m:2d} {short(cfg)}  tc {row['tc_us']} us: "
                  f"{row['tc_fixed_us']:.2f} us + {row['tc_rate_GBps']} GB/s "
                  f"({row['tc_rate_pct_copy']}%), PDL {t_pdl:.2f}  |  mm {row['mm_us']}: "
                  f"{row['mm_fixed_us']:.2f} + {row['mm_rate_GBps']}  |  copy {row['copy_us']}: "
                  f"{row['copy_fixed_us']:.2f} + {row['copy_rate_GBps']} "
                  f"({row['copy_rate_pct_copy']}% counting read + write)", flush=True)
    return rows


def table_entries(rows) -> list[dict]:
    """The winner per (N, K, bucket) of run rows (the default config vs cuBLAS) or sweep rows
    (every config vs cuBLAS): its config, None where cuBLAS was faster."""
    best = {}
    for r in rows:
        cfg, us = (r["best"], r["us"][r["best"]]) if "best" in r else (r["config"], r["tc_us"])
        key = (r["N"], r["K"], gemm_tc.bucket(r["M"]))
        entry = {"N": r["N"], "K": r["K"], "bucket": key[2], "M": r["M"],
                 "config": parse_config(cfg) if us < r["mm_us"] else None,
                 "us": us, "mm_us": r["mm_us"]}
        if key not in best or min(us, r["mm_us"]) < min(best[key]["us"], best[key]["mm_us"]):
            best[key] = entry
    return list(best.values())


def write_table(path, rows, device: str, source: str) -> None:
    """Merge this run's winners into the table at `path` (entries of other shapes kept)."""
    entries = merge_table(path, table_entries(rows), device, source)
    wins = sum(e["config"] is not None for e in entries)
    print(f"{path}: {len(entries)} entries, gemm_tc faster than cuBLAS on {wins}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default=",".join(map(str, MS)))
    ap.add_argument("--only", help="shapes as NxK, comma-separated")
    ap.add_argument("--gemv", action="store_true", help="also time gemv at M <= 16")
    ap.add_argument("--sweep", action="store_true", help="time every config instead")
    ap.add_argument("--out", help="folder for the JSON")
    ap.add_argument("--table", help="merge the winners into this tuned table (JSON)")
    ap.add_argument("--table-from", help="take the rows from this saved JSON instead of running")
    ap.add_argument("--fused", action="store_true", help="time the one-launch variants instead")
    ap.add_argument("--fixed", action="store_true",
                    help="cost per launch and streaming rate (K, K/2, K/4) instead")
    opts = ap.parse_args()
    if opts.table_from:
        saved = json.loads(Path(opts.table_from).read_text())
        write_table(opts.table, saved["rows"], saved["device"], opts.table_from)
        return
    ms, shapes, gbps = setup(opts, SHAPES)
    if opts.fused:
        write_json(opts.out, "gemm_tc_fused", fused(ms), gbps)
        return
    if opts.fixed:
        write_json(opts.out, "gemm_tc_fixed", fixed(shapes, ms, gbps), gbps)
        return
    source = f"benchmarks/gemm_tc.py{' --sweep' if opts.sweep else ''}, {date.today()}"
    rows = []
    for shape in shapes:  # the table grows shape by shape: a cut-short sweep keeps what it timed
        rows += sweep([shape], ms) if opts.sweep else run([shape], ms, gbps, opts.gemv)
        if opts.table:
            write_table(opts.table, rows, torch.cuda.get_device_name(), source)
    report(rows, gbps, opts, "gemm_tc", "tc")


if __name__ == "__main__":
    main()
