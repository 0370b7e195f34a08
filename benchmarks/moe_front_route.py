"""k3::moe_front_route (one launch: split gemv + last-CTA routing) against the two launches it
replaces (moe_front's split gemv, then moe_route), at one K3 TP16 rank's router (896 x 7168,
top-8) and latent down (3584 x 7168), CUDA graphs.

    python benchmarks/moe_front_route.py [--rows 1,8] [--top-k 8]

Each call reads the next of several [W_r; W_d] copies (>= 2 x 60 MB between two reads of one
copy: the L2 does not serve the weights); time per call = median graph replay / calls
(graph_timing.graph_us), with PDL as the settings have it. Before timing, the fused outputs are
checked against the two launches (ids equal, weights and z bit-equal).
"""

import argparse

import torch
from graph_timing import graph_us
from k3compile.kernels import moe_front_route, moe_route
from k3compile.kernels.common import gemv
from k3compile.kernels.moe_front import moe_front_cuda

from k3compile.settings import KERNELS

E, L, D = 896, 3584, 7168
CALLS, REPLAYS, L2_BYTES = 24, 30, 60e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    KERNELS.gemv_fused = KERNELS.gemv_fused | {"split"}  # the two-launch side: gemv's split front
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = int(2 * L2_BYTES // ((E + L) * D * 2)) + 2
    packed = [torch.randn(E + L, D, generator=gen, device="cuda").bfloat16() / 64
              for _ in range(copies)]
    weights = [(w[:E], w[E:]) for w in packed]
    bias = torch.randn(E, generator=gen, device="cuda") * 0.1
    top_k = args.top_k
    print(f"{torch.cuda.get_device_name()}  pdl {KERNELS.pdl} (rows <= {KERNELS.pdl_max_rows})")
    for n in (int(r) for r in args.rows.split(",")):
        x = torch.randn(n, D, generator=gen, device="cuda").bfloat16()

        def fused(i, x=x):
            return moe_front_route.moe_front_route_cuda(x, *weights[i % copies], bias, top_k, 2.5)

        def split(i, x=x):  # the same gemv, then moe_route: two launches
            logits, z = gemv.gemv_split_cuda(x, packed[i % copies], E)
            return (*moe_route.moe_route_cuda(logits, bias, top_k, 2.5), z)

        def now(i, x=x):  # what runs today: moe_front (split gemv at 1 row, else router.linear x 2)
            logits, z = moe_front_cuda(x, *weights[i % copies])
            return (*moe_route.moe_route_cuda(logits, bias, top_k, 2.5), z)

        got, want = fused(0), split(0)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"fused != split at {n} rows"
        us = {}
        for name, fn in (("fused", fused), ("split+route", split), ("front+route", now)):
            calls = [lambda i=i, fn=fn: fn(i) for i in range(CALLS)]
            us[name] = graph_us(calls, calls[:copies], REPLAYS)
        cfg = gemv.config(E + L, D, gemv.bucket(n), gemv.Fusion(split=E))
        print(f"N={n}  " + "  ".join(f"{name} {t:6.2f} us" for name, t in us.items())
              + f"  saved vs split+route {us['split+route'] - us['fused']:+6.2f} us  "
              f"(gemv {cfg})", flush=True)


if __name__ == "__main__":
    main()
