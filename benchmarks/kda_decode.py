"""The fused KDA decode step (kernels/kda_decode.py) against its torch reference, eager and under
torch.compile (Inductor), at one K3 TP16 rank (6 heads of 128, conv taps 4).

    python benchmarks/kda_decode.py [--b 1,8,64] [--t 1,8] [--no-inductor] [--out dir|r.json]
    python benchmarks/kda_decode.py --sweep [--b 1,8,64] [--t 1,8]   # every kernel Config
    python benchmarks/kda_decode.py --norm-fp32 ...   # the norm_fp32 build (fla's gated norm)

Each side is captured into one CUDA graph (benchmarks/graph_timing.py). The kernel's calls cycle
through a pool of state slots holding >= 2 x 60 MB of recurrent + conv state, each call on the
next B slots, so the L2 does not serve the state (in a decode step each of the 69 KDA layers
reads its own state once). The references are captured with at most REF_CALLS calls (eager is
~10 launches per token and op), so at small B their state may partly come from the L2: their
times are then optimistic. Activations are L2-resident (the in-projection just wrote them).
bytes = recurrent state read + write (fp32) + conv state read + write + activations in and out +
weights; "% copy" compares bytes / time with a 4 GiB device-to-device copy of the same run.
"""

import argparse
import functools

import torch
from gemv import copy_gbps, write_json
from graph_timing import graph_us, versus_row, versus_table
from k3compile.kernels import kda_decode as kernel
from k3compile.kernels.common.dsl import runtime_refusal

from k3compile.ops.kda_decode import KDAVariant, kda_decode_ref

H, K, TAPS = 96 // 16, 128, 4
W = H * K
L2_BYTES = 60e6
CALLS, REF_CALLS, REPLAYS = 24, 16, 20
SCALARS = (-5.0, 1e-6, K**-0.5, 1e-5)


def state_bytes(b: int) -> int:
    return b * (H * K * K * 4 + 3 * W * (TAPS - 1) * 2)


def moved_bytes(b: int, t: int) -> int:
    acts = b * t * (6 * W + H) * 2  # q, k, v, g, graw, b in; out
    weights = 3 * W * TAPS * 2 + W * 4 + H * 4 + K * 2
    return 2 * state_bytes(b) + acts + weights


def make_case(b, t, norm_fp32=False):
    """Activations as column slices of one in-projection row, a state pool of `copies` x b slots;
    the op's arguments end with its variant (`norm_fp32`: fla's gated norm, else the default)."""
    copies = max(4, -(-int(2 * L2_BYTES) // state_bytes(b)) + 1)
    row = torch.randn(b, t, 4 * W + K + H, device="cuda").bfloat16()
    q, k, v, g = (row[..., i * W:(i + 1) * W] for i in range(4))
    graw = (torch.randn(b, t, W, device="cuda")).bfloat16()
    conv = torch.randn(copies * b, 3 * W, TAPS - 1, device="cuda").bfloat16()
    state = torch.randn(copies * b, H, K, K, device="cuda") * 0.1
    weights = ([(torch.randn(W, 1, TAPS, device="cuda") * 0.5).bfloat16() for _ in range(3)]
               + [torch.rand(H, device="cuda").mul(15).add(1).log(),
                  torch.randn(W, device="cuda") * 0.5,
                  (1 + 0.1 * torch.randn(K, device="cuda")).bfloat16()])
    slots = [torch.arange(i * b, (i + 1) * b, device="cuda") for i in range(copies)]

    def args(slot):
        return (q, k, v, g, graw, row[..., 4 * W + K:], conv, state, slot, *weights, *SCALARS,
                None, None, "norm_fp32" if norm_fp32 else "")  # one conv state buffer

    return args, slots


def check(args, slots):
    """The kernel ran and agrees with the reference (a benchmark of wrong results is
    worthless); restores the states it touched."""
    a = list(args(slots[0]))
    conv, state = a[6], a[7]
    saved = conv.clone(), state.clone()
    out = torch.empty(*a[0].shape[:2], H, K, device="cuda", dtype=torch.bfloat16)
    got = kernel.kda_decode_cuda(*a, out=out)
    assert got is out, "kda_decode refused the inputs (see the log)"
    got_state = state[slots[0]].clone()
    conv.copy_(saved[0])
    state.copy_(saved[1])
    ref = kda_decode_ref(*a[:-1], KDAVariant.parse(a[-1]))
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    s_err = ((got_state - state[slots[0]]).norm() / state[slots[0]].norm()).item()
    conv.copy_(saved[0])
    state.copy_(saved[1])
    assert err < 1e-2 and s_err < 1e-4, f"kernel disagrees: output {err:.2e}, state {s_err:.2e}"


def timed(fn, args, slots, calls=None):
    """µs per call; by default one call per state copy (at least CALLS)."""
    calls = calls or max(CALLS, len(slots))
    return graph_us([functools.partial(fn, *args(slots[i % len(slots)])) for i in range(calls)],
                    [functools.partial(fn, *args(s)) for s in slots[:2]], REPLAYS)


def run(bs, ts, gbps, inductor=True, norm_fp32=False):
    rows = []
    torch._dynamo.config.cache_size_limit = 64
    compiled_ref = torch.compile(kda_decode_ref, dynamic=False)
    nan = float("nan")
    for t in ts:
        for b in bs:
            args, slots = make_case(b, t, norm_fp32)
            check(args, slots)
            us = {"kernel": timed(kernel.kda_decode_cuda, args, slots),
                  "eager": timed(kda_decode_ref, args, slots, REF_CALLS),
                  "inductor": timed(compiled_ref, args, slots, REF_CALLS) if inductor else nan}
            cfg = str(kernel.config(t, H, TAPS, kernel.bucket(b)))
            rows.append(versus_row(us, moved_bytes(b, t), gbps, cfg, B=b, T=t, config=cfg))
            del args, slots
            torch.cuda.empty_cache()
    return rows


def sweep(bs, ts, norm_fp32=False):
    """Every kernel Config at each (B, T) (tunes `kernel.config`)."""
    default = kernel.config
    rows = []
    try:
        for t in ts:
            for b in bs:
                args, slots = make_case(b, t, norm_fp32)
                results = {}
                for cfg in kernel.configs():
                    kernel.config = lambda *_, cfg=cfg: cfg
                    check(args, slots)
                    results[cfg] = timed(kernel.kda_decode_cuda, args, slots)
                best = min(results, key=results.get)
                chosen = default(t, H, TAPS, kernel.bucket(b))
                rows.append({"B": b, "T": t, "default": str(chosen), "best": str(best),
                             "us": {str(c): round(v, 2) for c, v in results.items()}})
                print(f"B={b:2d} T={t}  default C{chosen.cluster_n}R{chosen.rows_per_thread} "
                      f"{results.get(chosen, float('nan')):.2f} us  best C{best.cluster_n}"
                      f"R{best.rows_per_thread} {results[best]:.2f} us | " + "  ".join(
                          f"C{c.cluster_n}R{c.rows_per_thread}={v:.2f}"
                          for c, v in results.items()), flush=True)
                del args, slots
                torch.cuda.empty_cache()
    finally:
        kernel.config = default
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", default="1,8,64")
    ap.add_argument("--t", default="1,8")
    ap.add_argument("--sweep", action="store_true", help="time every kernel config instead")
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile (slow)")
    ap.add_argument("--norm-fp32", action="store_true", help="the norm_fp32 variant's build")
    ap.add_argument("--out")
    opts = ap.parse_args()
    assert torch.cuda.is_available() and not runtime_refusal(), runtime_refusal() or "no GPU"
    torch.manual_seed(0)
    bs = [int(b) for b in opts.b.split(",")]
    ts = [int(t) for t in opts.t.split(",")]
    gbps = copy_gbps()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"4 GiB device copy: {gbps:.0f} GB/s (read + write)", flush=True)
    rows = (sweep(bs, ts, opts.norm_fp32) if opts.sweep
            else run(bs, ts, gbps, not opts.no_inductor, opts.norm_fp32))
    write_json(opts.out, "kda_decode_sweep" if opts.sweep else "kda_decode", rows, gbps, heads=H,
               sweep=opts.sweep, norm_fp32=opts.norm_fp32)
    if not opts.sweep:
        versus_table(rows)


if __name__ == "__main__":
    main()
