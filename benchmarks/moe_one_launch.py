"""k3::moe_experts in one launch (K3_KERNELS_EXTRA=moe_one_launch: FC1 and FC2 items of one
ticketed grid) against the two launches it replaces (FC1 + SiTU, then FC2 + finalize with PDL),
at one K3 TP16 rank (896 experts, L 3584, I 192), CUDA graphs.

    python benchmarks/moe_one_launch.py [--rows 1,2,8] [--top-k 16] [--blocks fc1,fc2]
                                        [--out DIR or r.json]

Every call has its own rows and routing (benchmarks/moe_experts.py's `make_calls`: at one row a
shuffled cycle over all 896 experts, above it uniform top-k draws), so ~1 GB of experts
rotate and the L2 (60 MB) does not serve a call from an earlier one. Time per call = median
graph replay / calls (graph_timing.graph_us), with PDL as the settings have it. Before timing,
each one launch's output is checked bit for bit against the two launches. `saved` = two - one
(µs per call) for the default block size (moe_one_launch.configs' `block`, "fc1"), `saved_fc2`
for FC2's where --blocks asks for it (at top-16: FC1 with 8 warps, FC2 with its 16 rows); the
JSON is rewritten after every row.
"""

import argparse
import functools
import json
from pathlib import Path

import torch
from graph_timing import graph_us
from k3compile.kernels import moe_experts, moe_one_launch
from moe_experts import BETA, LATENT, LINEAR_BETA, make_calls, make_experts

from k3compile.settings import KERNELS

REPLAYS = 20


def time_fn(fn, calls, experts) -> float:
    outs = [torch.empty_like(z) for z, _, _ in calls]
    steps = [functools.partial(fn, *call, *experts, BETA, LINEAR_BETA, out=out)
             for call, out in zip(calls, outs)]
    return graph_us(steps, steps[:2], REPLAYS)


def one_launch(block: str):
    moe_one_launch.TAKEN_ROWS = moe_one_launch.MAX_ROWS  # time what is asked for
    return functools.partial(moe_one_launch.moe_one_launch_cuda, block=block)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1",
                    help="rows above moe_one_launch.TAKEN_ROWS (1: slower than two launches "
                         "on the H200) are timed with TAKEN_ROWS raised to them")
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--blocks", default="fc1,fc2")
    ap.add_argument("--out")
    opts = ap.parse_args()
    from k3compile.kernels.common.dsl import runtime_refusal

    assert torch.cuda.is_available() and not runtime_refusal(), runtime_refusal() or "no GPU"
    torch.manual_seed(0)
    out = Path(opts.out) if opts.out else None
    if out is not None and out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "moe_one_launch.json"
    experts = make_experts()
    inter, blocks = experts[0].shape[1], opts.blocks.split(",")
    rows = []
    print(f"{torch.cuda.get_device_name()}  pdl {KERNELS.pdl} (rows <= {KERNELS.pdl_max_rows})"
          f"  top-{opts.top_k}")
    for n in (int(r) for r in opts.rows.split(",")):
        if why := moe_one_launch.refusal(n, LATENT, inter, opts.top_k):
            print(f"N={n}: skipped ({why})")
            continue
        calls = make_calls(n, opts.top_k)
        z, ids, w = calls[0]
        two = moe_experts.moe_experts_cuda(z, ids, w, *experts, BETA, LINEAR_BETA)
        for block in blocks:
            one = one_launch(block)(z, ids, w, *experts, BETA, LINEAR_BETA)
            assert torch.equal(one, two), f"one launch ({block}) != two launches at {n} rows"
        us = {"two": time_fn(moe_experts.moe_experts_cuda, calls, experts)}
        us.update({block: time_fn(one_launch(block), calls, experts) for block in blocks})
        row = {"rows": n, "top_k": opts.top_k, "two_us": round(us["two"], 2),
               "pdl": KERNELS.pdl and n <= KERNELS.pdl_max_rows}
        for block in blocks:
            suffix = "" if block == "fc1" else f"_{block}"
            row[f"one{suffix}_us"] = round(us[block], 2)
            row[f"saved{suffix}"] = round(us["two"] - us[block], 2)
            row[f"configs{suffix}"] = [str(c) for c in moe_one_launch.configs(
                LATENT, inter, opts.top_k, n, block)]
        rows.append(row)
        print(f"N={n}  two {us['two']:7.2f} us  " + "  ".join(
            f"one[{b}] {us[b]:7.2f} us (saved {us['two'] - us[b]:+6.2f})" for b in blocks),
            flush=True)
        if out is not None:
            out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
