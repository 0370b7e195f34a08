"""The MLA decode kernel (kernels/mla_decode.py: cache write + absorbed split-KV attention)
against its torch reference, eager and under torch.compile (Inductor), at one K3 TP16 rank
(96 / 16 = 6 heads, latent 512, rope 64) with a context of 4096 rows (the T new ones included).

    python benchmarks/mla_decode.py [--b 1,8,64] [--t 1,8] [--ctx 4096] [--no-inductor]
                                    [--path mma|fma|both] [--out dir|r.json]
    python benchmarks/mla_decode.py --sweep [--b 1,8,64] [--t 1,8] [--path ...]  # split counts
    python benchmarks/mla_decode.py --q-absorb [--b 1,8,64] [--out dir]  # k3::mla_q_absorb

Each side is captured into one CUDA graph (benchmarks/graph_timing.py). The kernel's calls cycle
through a pool of cache slots holding >= 2 x 60 MB, each call on the next B slots, so the L2 does
not serve the cache rows (each of the 24 MLA layers reads its own cache once per step). The
references are captured with at most REF_CALLS calls, so at small B their rows may partly come
from the L2: their times are then optimistic. The cache has exactly `ctx` rows per slot, so the
reference's gather of whole slots reads no row the kernel does not.
bytes = cache rows read (ctx - T old rows, 1152 B each) + new rows read and written + q_lat,
q_pe in + o_lat out; the split workspace (L2-resident) is not counted. "% copy" compares
bytes / time with a 4 GiB device-to-device copy of the same run. `--path` picks the kernel's
compute path (`kernel.MMA`): tensor cores (mma, config()'s default), CUDA cores (fma), or both,
one row each (the references are timed once per B, T).

--q-absorb times `k3::mla_q_absorb` at B·T = N rows instead (kernels/mla_q_absorb.py: the GEMM
router's q_b GEMM + the CuTe absorption) against its reference (cuBLAS: F.linear, then the
per-head einsum), each call on the next copy of (W_qb, kv_b) as benchmarks/gemv.py rotates
weights (>= 2 x 60 MB between two reads of one copy); also the absorption alone (the CuTe
kernel on a given q against the reference's einsum). bytes = W_qb + W_UK + cq + q_lat + q_pe.
"""

import argparse
import functools

import torch
from gemv import copy_gbps, weight_copies, write_json
from gemv import graph_us as rotated_us
from graph_timing import graph_us, versus_row
from k3compile.kernels import mla_decode as kernel
from k3compile.kernels import mla_q_absorb as absorb
from k3compile.kernels.common.dsl import bucket, fallback_counts, runtime_refusal

from k3compile.ops.mla_decode import mla_decode_ref
from k3compile.ops.mla_q_absorb import mla_q_absorb_ref

H, C, R = 96 // 16, 512, 64
D, V, Q = 128, 128, 1536  # qk_nope, v_head, q_lora (k3_tp16)
ROW = (C + R) * 2
SCALE = (128 + 64) ** -0.5
L2_BYTES = 60e6
CALLS, REF_CALLS, REPLAYS = 24, 8, 20


def moved_bytes(b: int, t: int, ctx: int) -> int:
    rows = b * ((ctx - t) * ROW + 2 * t * ROW)  # old rows read; new rows read and written
    return rows + b * t * H * (C + R + C) * 2


def make_case(b, t, ctx):
    """Inputs of B requests at position ctx - T, a cache pool of `copies` x B slots."""
    copies = max(2, -(-int(2 * L2_BYTES) // (b * ctx * ROW)) + 1)
    q_lat = torch.randn(b, t, H, C, device="cuda").bfloat16()
    q_pe = torch.randn(b, t, H, R, device="cuda").bfloat16()
    ckv = torch.randn(b, t, C + R, device="cuda").bfloat16()
    c_kv, k_pe = ckv[..., :C].contiguous(), ckv[..., C:]
    cache = torch.randn(copies * b, ctx, C + R, device="cuda").bfloat16()
    positions = torch.full((b,), ctx - t, dtype=torch.int64, device="cuda")
    slots = [torch.arange(i * b, (i + 1) * b, device="cuda") for i in range(copies)]

    def args(slot):
        return (q_lat, q_pe, c_kv, k_pe, cache, slot, positions, SCALE)

    return args, slots


def check(args, slots):
    """The kernel ran and agrees with the reference (a benchmark of wrong results is
    worthless), the cache included."""
    a = list(args(slots[0]))
    saved = a[4][slots[0]].clone()
    out = torch.empty_like(a[0])
    got = kernel.mla_decode_cuda(*a, out=out)
    assert got is out, "mla_decode refused the inputs (see the log)"
    got_rows = a[4][slots[0]].clone()
    a[4][slots[0]] = saved
    ref = mla_decode_ref(*a)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 6e-3, f"kernel disagrees with the reference: {err:.2e}"
    assert torch.equal(got_rows, a[4][slots[0]]), "the kernel's cache differs"


def timed(fn, args, slots, calls=None):
    """µs per call; by default one call per cache copy (at least CALLS)."""
    calls = calls or max(CALLS, len(slots))
    return graph_us([functools.partial(fn, *args(slots[i % len(slots)])) for i in range(calls)],
                    [functools.partial(fn, *args(s)) for s in slots[:2]], REPLAYS)


def run(bs, ts, ctx, gbps, paths, inductor=True):
    rows = []
    torch._dynamo.config.cache_size_limit = 64
    compiled_ref = torch.compile(mla_decode_ref, dynamic=False)
    nan = float("nan")
    for t in ts:
        for b in bs:
            args, slots = make_case(b, t, ctx)
            refs = {"eager": timed(mla_decode_ref, args, slots, REF_CALLS),
                    "inductor": timed(compiled_ref, args, slots, REF_CALLS) if inductor else nan}
            for path in paths:
                kernel.MMA = path == "mma"
                check(args, slots)
                us = {"kernel": timed(kernel.mla_decode_cuda, args, slots), **refs}
                cfg = kernel.config(t, H, C, R)
                n_splits = kernel.splits(b, t, H, ctx)
                rows.append(versus_row(us, moved_bytes(b, t, ctx), gbps,
                                       f"{path}: {cfg} splits {n_splits}", B=b, T=t, ctx=ctx,
                                       path=path, config=str(cfg), splits=n_splits))
            del args, slots
            torch.cuda.empty_cache()
    return rows


def sweep(bs, ts, ctx, paths):
    """The kernel at split counts 1, 2, 4, ..., MAX_SPLITS for each (B, T) (tunes
    `kernel.splits`)."""
    default = kernel.splits
    rows = []
    try:
        for path, t in ((p, t) for p in paths for t in ts):
            kernel.MMA = path == "mma"
            for b in bs:
                args, slots = make_case(b, t, ctx)
                chosen = default(b, t, H, ctx)
                results = {}
                n = 1
                while n <= kernel.MAX_SPLITS:
                    kernel.splits = lambda *_, n=n: n
                    check(args, slots)
                    results[n] = timed(kernel.mla_decode_cuda, args, slots)
                    n *= 2
                kernel.splits = default
                results.setdefault(chosen, timed(kernel.mla_decode_cuda, args, slots))
                best = min(results, key=results.get)
                rows.append({"B": b, "T": t, "ctx": ctx, "path": path, "default": chosen,
                             "best": best,
                             "us": {str(k): round(v, 2) for k, v in sorted(results.items())}})
                print(f"{path} B={b:2d} T={t}  default {chosen} splits {results[chosen]:.2f} us  best "
                      f"{best} {results[best]:.2f} us | " + "  ".join(
                          f"{k}={v:.2f}" for k, v in sorted(results.items())), flush=True)
                del args, slots
                torch.cuda.empty_cache()
    finally:
        kernel.splits = default
    return rows


def q_absorb_weights():
    """Copies of (W_qb, W_UK), as many as W_qb alone needs to pass the L2 (>= 2 x 60 MB), W_UK
    a view of each copy of kv_b's weight as in the model."""
    kvb = (torch.randn(H * (D + V), C, device="cuda") / C ** 0.5).bfloat16()
    return [(w, (kvb.clone() if i else kvb).view(H, D + V, C)[:, :D])
            for i, w in enumerate(weight_copies(H * (D + R), Q))]


def q_absorb(ns, gbps):
    """k3::mla_q_absorb at N rows: the kernel path against the reference (cuBLAS)."""
    weights = q_absorb_weights()
    return [q_absorb_row(n, weights, gbps) for n in ns]


def q_absorb_row(n, weights, gbps):
    cq = torch.randn(n, 1, Q, device="cuda").bfloat16()  # the op's [B, T, Q]
    before = dict(fallback_counts())
    got = absorb.mla_q_absorb_cuda(cq, *weights[0])
    assert fallback_counts() == before, "mla_q_absorb refused the inputs (see the log)"
    for g, r in zip(got, mla_q_absorb_ref(cq, *weights[0])):
        err = ((g.float() - r.float()).norm() / r.float().norm()).item()
        assert err < 1e-2, f"the kernel path disagrees with the reference: {err:.2e}"
    q = torch.nn.functional.linear(cq.view(n, Q), weights[0][0])
    q_nope = q.view(n, H, D + R)[..., :D]
    outs = (torch.empty(n, H * C, device="cuda").bfloat16(),
            torch.empty(n, H * R, device="cuda").bfloat16())
    b = bucket(n)
    kern = absorb.KERNEL.compiled(H, D, R, C, b, absorb.config(D, b), rows=b)
    us = {"kernel": rotated_us(lambda w: absorb.mla_q_absorb_cuda(cq, *w), weights),
          "reference": rotated_us(lambda w: mla_q_absorb_ref(cq, *w), weights),
          "absorb": rotated_us(lambda w: kern(q, w[1], *outs), weights),
          "einsum": rotated_us(lambda w: torch.einsum("nhd,hdc->nhc", q_nope, w[1]), weights)}
    moved = 2 * (H * (D + R) * Q + H * D * C + n * (Q + H * (C + R)))
    row = {"N": n, "config": str(absorb.config(D, b)), "bytes": moved,
           **{f"{k}_us": round(v, 2) for k, v in us.items()},
           "kernel_pct_copy": round(100 * moved / us["kernel"] / 1e3 / gbps, 1),
           "speedup": round(us["reference"] / us["kernel"], 2)}
    print(f"N={n:2d}  kernel path {us['kernel']:6.2f} us ({row['kernel_pct_copy']}% copy)  "
          f"reference {us['reference']:6.2f} us  x{row['speedup']:.2f}  |  absorb alone "
          f"{us['absorb']:6.2f} us, einsum {us['einsum']:6.2f} us  {row['config']}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", default="1,8,64")
    ap.add_argument("--t", default="1,8")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true", help="time every split count instead")
    ap.add_argument("--q-absorb", action="store_true",
                    help="time k3::mla_q_absorb at N = B rows instead")
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile (slow)")
    ap.add_argument("--path", choices=("mma", "fma", "both"), default="both",
                    help="the kernel's compute path: tensor cores, CUDA cores, or both")
    ap.add_argument("--out")
    opts = ap.parse_args()
    assert torch.cuda.is_available() and not runtime_refusal(), runtime_refusal() or "no GPU"
    torch.manual_seed(0)
    bs = [int(b) for b in opts.b.split(",")]
    ts = [int(t) for t in opts.t.split(",")]
    gbps = copy_gbps()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"4 GiB device copy: {gbps:.0f} GB/s (read + write)", flush=True)
    if opts.q_absorb:
        return write_json(opts.out, "mla_q_absorb", q_absorb(bs, gbps), gbps)
    paths = ("mma", "fma") if opts.path == "both" else (opts.path,)
    rows = sweep(bs, ts, opts.ctx, paths) if opts.sweep else \
        run(bs, ts, opts.ctx, gbps, paths, not opts.no_inductor)
    write_json(opts.out, "mla_decode_sweep" if opts.sweep else "mla_decode", rows, gbps, heads=H, latent=C, rope=R,
               sweep=opts.sweep)
    if not opts.sweep:
        table(rows)


def table(rows) -> None:
    """`run`'s rows as a markdown table, one line per B, T and path."""
    print("\n| B | T | path | kernel µs | % copy | Inductor µs | eager µs | vs Inductor | splits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['T']} | {r['path']} | {r['kernel_us']:.2f} | "
              f"{r['kernel_pct_copy']} | {r['inductor_us']:.2f} | {r['eager_us']:.2f} | "
              f"x{r['vs_inductor']:.2f} | {r['splits']} |")


if __name__ == "__main__":
    main()
