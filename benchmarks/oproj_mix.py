"""k3::oproj_attn_res_mix_norm in one launch (K3_KERNELS_EXTRA=oproj_mix: the o_proj gemv whose
last CTA runs the mix + RMSNorm) against the two launches it replaces (the same gemv, then the
attn_res_mix_norm kernel), at one K3 TP16 rank's o_proj (7168 x 768) and the post-attention mix
of 9 sources (8 blocks + prefix), CUDA graphs.

    python benchmarks/oproj_mix.py [--rows 1,2,4,8] [--blocks 8]

The one launch runs at every row count asked for (MAX_ROWS lifted for the benchmark). Each call
reads the next of several W_o copies (>= 2 x 60 MB between two reads of one copy) and its own
block bank: the L2 serves neither from an earlier call; time per call = median graph replay / calls
(graph_timing.graph_us), with PDL as the settings have it. Before timing, the one launch's
outputs are checked bit for bit against the two launches. The difference `two - fused` is what
the last CTA's serial mix leaves of the launch boundary it removes: where it is <= 0, MAX_ROWS
must stay below that row count.
"""

import argparse
import math

import torch
from graph_timing import graph_us
from k3compile.kernels import oproj_attn_res_mix_norm as kernel
from k3compile.kernels.attn_res_mix_norm import attn_res_mix_norm_cuda
from k3compile.kernels.common import gemv

from k3compile.ops.attn_res_mix_norm import mix_norm_after
from k3compile.settings import KERNELS

D, K, EPS = 7168, 768, 1e-5
CALLS, REPLAYS, L2_BYTES = 24, 30, 60e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    kernel.MAX_ROWS = 16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    copies = int(2 * L2_BYTES // (D * K * 2)) + 2
    w_o = [(randn(D, K) / math.sqrt(K)).bfloat16() for _ in range(copies)]
    weights = [(1 + randn(D, scale=0.2)).bfloat16(), randn(1, D, scale=3 / math.sqrt(D)).bfloat16(),
               (1 + randn(D, scale=0.2)).bfloat16()]
    print(f"{torch.cuda.get_device_name()}  pdl {KERNELS.pdl} (rows <= {KERNELS.pdl_max_rows})"
          f"  sources {args.blocks + 1}")
    for n in (int(r) for r in args.rows.split(",")):
        o, prefix = randn(n, K).bfloat16(), randn(n, D, scale=2.0).bfloat16()
        banks = [randn(n, 8, D).bfloat16() for _ in range(CALLS)]  # one per call in a graph
        blocks = [[bank[:, j] for j in range(args.blocks)] for bank in banks]

        def fused(i, o=o, prefix=prefix, blocks=blocks):
            return kernel.oproj_mix_cuda(o, w_o[i % copies], prefix, blocks[i % len(blocks)],
                                         *weights, EPS, EPS)

        def two(i, o=o, prefix=prefix, blocks=blocks):
            a = gemv.gemv_cuda(o, w_o[i % copies])
            return mix_norm_after(a, prefix, blocks[i % len(blocks)], *weights, EPS, EPS,
                                  mix_norm=attn_res_mix_norm_cuda)

        def gemv_only(i, o=o):
            return gemv.gemv_cuda(o, w_o[i % copies])

        got, want = fused(0), two(0)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"fused != two at {n} rows"
        us = {}
        for name, fn in (("fused", fused), ("two", two), ("gemv", gemv_only)):
            calls = [lambda i=i, fn=fn: fn(i) for i in range(CALLS)]
            us[name] = graph_us(calls, calls[:max(copies, len(blocks))], REPLAYS)
        cfgs = kernel.configs(D, K, gemv.bucket(n), args.blocks, True)
        print(f"N={n}  " + "  ".join(f"{name} {t:6.2f} us" for name, t in us.items())
              + f"  saved {us['two'] - us['fused']:+6.2f} us  tail {us['fused'] - us['gemv']:+6.2f}"
              f" us  (gemv {cfgs[0]}, mix {cfgs[1]})", flush=True)


if __name__ == "__main__":
    main()
