"""CUDA-graph replay time of each CuTe DSL kernel against Inductor, per batch bucket.

    python benchmarks/kernels.py [--buckets 1,8,64] [--only attn_mix9,moe_route] [--out r.json]
    python benchmarks/kernels.py --sweep   # attn_mix9 over cluster sizes x vectors per thread

For every case and bucket, two callables are captured REPS times each into one CUDA graph: the
k3 op (its CUDA implementation is our kernel) and `torch.compile` (Inductor, default mode, static
shapes: compiled for each bucket) of the op's `*_ref` function. The time per call is the median over replays of graph time / REPS, so it
includes the gap between back-to-back kernels in a graph. Inputs stay L2-resident, as they are in
a decode step (the previous kernel just wrote them). Shapes are one K3 TP16 rank's. Our kernels
are timed with programmatic dependent launch off and on (`common.settings.KERNELS.pdl`; on, the next launch's
prologue overlaps the previous kernel, as in a decode step's graph).
"""

from k3compile import settings
import argparse
import json
import math

import torch
from graph_timing import graph_us as replay_us
from k3compile.kernels import attn_res_mix_norm, register_all
from k3compile.kernels.common.dsl import pick_threads

from k3compile.ops.attn_res_mix_norm import attn_res_mix_norm_ref
from k3compile.ops.moe_route import moe_route_ref
from k3compile.ops.rms_norm import rms_norm_ref

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
HIDDEN, LATENT, EXPERTS, TOP_K = 7168, 3584, 896, 16
REPS, REPLAYS = 20, 50


def _randn(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def attn_mix(n, n_blocks):
    bank = _randn(n, 8, HIDDEN)
    args = (_randn(n, HIDDEN), _randn(n, HIDDEN), [bank[:, j] for j in range(n_blocks)],
            1 + _randn(HIDDEN, scale=0.1), _randn(1, HIDDEN, scale=3 / math.sqrt(HIDDEN)),
            1 + _randn(HIDDEN, scale=0.1), 1e-5, 1e-5)
    moved = 2 * HIDDEN * (n * (n_blocks + 4) + (3 if n_blocks else 1))
    return (lambda: torch.ops.k3.attn_res_mix_norm(*args),
            lambda f: (lambda: f(*args)), attn_res_mix_norm_ref, moved)


def mla_norm(n):
    fused = _randn(n, 1536 + 576)
    args = (fused[:, :1536], fused[:, 1536:], 1 + _randn(1536, scale=0.1),
            1 + _randn(512, scale=0.1), 1e-6)

    def ref(cq, ckv, wq, wkv, eps):
        return rms_norm_ref(cq, wq, eps), rms_norm_ref(ckv[:, :512], wkv, eps), ckv[:, 512:] * 1

    return (lambda: torch.ops.k3.mla_lowrank_norm(*args), lambda f: (lambda: f(*args)), ref,
            2 * (2 * n * 2112 + 2048))


def latent_norm(n):
    args = (_randn(n, LATENT), 1 + _randn(LATENT, scale=0.1), 1e-5)
    return (lambda: torch.ops.k3.rms_norm(*args), lambda f: (lambda: f(*args)), rms_norm_ref,
            2 * (2 * n * LATENT + LATENT))


def route(n):
    args = (_randn(n, EXPERTS, scale=2, dtype=torch.float32),
            _randn(EXPERTS, scale=0.1, dtype=torch.float32), TOP_K, 2.5)
    return (lambda: torch.ops.k3.moe_route(*args), lambda f: (lambda: f(*args)), moe_route_ref,
            4 * (n * EXPERTS + EXPERTS) + 12 * n * TOP_K)


CASES = {
    "attn_mix9": lambda n: attn_mix(n, 8),  # pre-attention: 8 blocks + prefix, with delta
    "attn_add_norm": lambda n: attn_mix(n, 0),  # no completed blocks: prefix add + RMSNorm
    "mla_lowrank_norm": mla_norm,
    "rms_norm_latent": latent_norm,
    "moe_route": route,
}


def graph_us(fn) -> float:
    """Median µs per call of fn, REPS calls per CUDA graph, REPLAYS timed replays."""
    return replay_us([fn] * REPS, [fn] * 3, REPLAYS, warm_replays=3)


def sweep(buckets):
    """attn_mix9 with every cluster size and vectors-per-thread cap, to tune `config`."""
    default = attn_res_mix_norm.config
    print("\nattn_mix9 sweep: us per call by (cluster_n, threads x vectors)")
    try:
        for n in buckets:
            ours = attn_mix(n, 8)[0]
            results = {}
            for c in (1, 2, 4, 8):
                for v in (1, 2, 4):
                    cfg = attn_res_mix_norm.Config(*pick_threads(HIDDEN // 8 // c, v), c)
                    if cfg in results or not attn_res_mix_norm._fits(cfg, 13):
                        continue
                    attn_res_mix_norm.config = lambda *_, cfg=cfg: cfg
                    results[cfg] = graph_us(ours)
            best = min(results, key=results.get)
            print(f"N={n:3d} default {default(HIDDEN, 8, True, n)}  best {best}: "
                  f"{results[best]:.2f} us | " + "  ".join(
                      f"c{k.cluster_n}/{k.threads}x{k.vec_per_thread}={t:.2f}"
                      for k, t in results.items()), flush=True)
    finally:
        attn_res_mix_norm.config = default


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--buckets", default=",".join(map(str, BUCKETS)))
    ap.add_argument("--only", default=",".join(CASES))
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true", help="only the attn_mix9 config sweep")
    opts = ap.parse_args()
    assert register_all(), "CuTe DSL not importable: nothing to benchmark"
    torch.manual_seed(0)
    buckets = [int(b) for b in opts.buckets.split(",")]
    if opts.sweep:
        return sweep(buckets)
    floor_x = torch.zeros(8, device="cuda")
    floor = graph_us(lambda: floor_x.add_(1))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"launch floor (tiny elementwise kernel in a graph): {floor:.2f} us")
    rows, default_pdl = [], settings.KERNELS.pdl
    torch._dynamo.config.cache_size_limit = 64  # one compile per case and bucket
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    for name in opts.only.split(","):
        for n in buckets:
            ours, bind, ref, moved = CASES[name](n)
            ref_c = torch.compile(ref, dynamic=False)
            t_pdl = {}
            for pdl in (False, True):
                settings.KERNELS.pdl = pdl
                t_pdl[pdl] = graph_us(ours)
            settings.KERNELS.pdl = default_pdl
            t_ours, t_ind = t_pdl[False], graph_us(bind(ref_c))
            rows.append({"kernel": name, "batch": n, "cute_us": round(t_ours, 2),
                         "cute_pdl_us": round(t_pdl[True], 2),
                         "inductor_us": round(t_ind, 2), "speedup": round(t_ind / t_ours, 2),
                         "GB/s": round(moved / t_ours / 1e3, 1)})
            print(f"{name:18s} N={n:3d}  cute {t_ours:6.2f} us (PDL {t_pdl[True]:6.2f})  "
                  f"inductor {t_ind:6.2f} us  x{t_ind / t_ours:4.2f}  "
                  f"{moved / t_ours / 1e3:7.1f} GB/s", flush=True)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "floor_us": floor, "rows": rows},
                      f, indent=1)
    print("\n| kernel | " + " | ".join(f"N={n}" for n in buckets) + " |")
    print("|---|" + "---|" * len(buckets))
    for name in opts.only.split(","):
        cells = [f"{r['cute_us']:.2f} / {r['inductor_us']:.2f}" for r in rows
                 if r["kernel"] == name]
        print(f"| {name} (cute / inductor us) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
