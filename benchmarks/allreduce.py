"""The attention output's all-reduce at TP = W, and the fused op it feeds, per batch bucket:

    python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/allreduce.py --out OUT

Per bucket (N rows of 7168 bf16: 14 KB .. 0.9 MB), CUDA-graph replay medians (µs per call) of

* the all-reduce alone by algorithm: NCCL, one-shot and two-shot over symmetric memory
  (kernels/common/collective.py), each checked against the exact sum first;
* the fused op `k3.allreduce_attn_res_mix_norm` (8 blocks + prefix, the post-attention mix +
  RMSNorm) with each algorithm forced, against the unfused torch path (NCCL all-reduce + the
  reference mix + norm ops), checked against the reference;
* the algorithm the policy picks (`collective.algorithm`) for each size.

Ranks start each timed replay together (barrier + synchronize). Rank 0 writes allreduce.json and
prints the table; every rank asserts its results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

for _key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_key, "0" if _key == "NCCL_NVLS_ENABLE" else "1")

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import graph_us

HIDDEN, BLOCKS, EPS = 7168, 8, 1e-5
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _rand(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


def _timed(fn, replays):
    dist.barrier()
    torch.cuda.synchronize()
    return graph_us([fn] * 4, [fn] * 3, replays)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--buckets", default=",".join(map(str, BUCKETS)))
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args(argv)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD.group_name

    from k3compile.kernels import register_all
    from k3compile.kernels.common import collective

    import k3compile.ops  # noqa: F401
    from k3compile.ops.attn_res_mix_norm import attn_res_mix_norm_ref

    register_all()
    gen = torch.Generator(device="cuda").manual_seed(1234)  # the same shared inputs on all ranks
    rows = []
    for n in map(int, args.buckets.split(",")):
        # partials: rank r holds parts[r]; their exact sum is known to every rank
        parts = [_rand(gen, n, HIDDEN) for _ in range(world)]
        mine = parts[rank].clone()
        exact = torch.stack([p.float() for p in parts]).sum(0)
        prefix, blocks = _rand(gen, n, HIDDEN), [_rand(gen, n, HIDDEN) for _ in range(BLOCKS)]
        wn, wp = _rand(gen, HIDDEN), _rand(gen, 1, HIDDEN, scale=HIDDEN ** -0.5)
        wnorm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")).bfloat16()
        want = attn_res_mix_norm_ref(prefix, exact.bfloat16(), blocks, wn, wp, wnorm, EPS, EPS)
        row = {"rows": n, "bytes": n * HIDDEN * 2,
               "policy": collective.algorithm(n * HIDDEN * 2, world)}
        for algo in collective.ALGORITHMS:
            os.environ["K3_ALLREDUCE"] = algo
            got = collective.all_reduce(mine, group, world)
            err = ((got.float() - exact).abs().max() / exact.abs().max()).item()
            assert err < 1e-2, f"{algo} at {n} rows: max error {err:.3g} vs the exact sum"
            row[f"{algo}_us"] = round(_timed(lambda: collective.all_reduce(mine, group, world),
                                             args.replays), 2)

            def fused():
                return torch.ops.k3.allreduce_attn_res_mix_norm(
                    mine, prefix, blocks, wn, wp, wnorm, EPS, EPS, group)

            out = fused()
            for g, r in zip(out, want):
                rel = ((g.float() - r.float()).norm() / r.float().norm()).item()
                assert rel < 2e-2, f"fused op with {algo} at {n} rows: rel error {rel:.3g}"
            row[f"fused_{algo}_us"] = round(_timed(fused, args.replays), 2)
        os.environ.pop("K3_ALLREDUCE")
        c10d = torch.ops._c10d_functional

        def unfused():
            a = c10d.wait_tensor(c10d.all_reduce(mine, "sum", group))
            return attn_res_mix_norm_ref(prefix, a, blocks, wn, wp, wnorm, EPS, EPS)

        row["unfused_torch_us"] = round(_timed(unfused, args.replays), 2)
        rows.append(row)

    if rank == 0:
        head = ("rows", "bytes", "policy", "nccl_us", "one_shot_us", "two_shot_us",
                "fused_nccl_us", "fused_one_shot_us", "fused_two_shot_us", "unfused_torch_us")
        print(f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}")
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(str(r[h]) for h in head) + " |")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "allreduce.json").write_text(json.dumps(
            {"world": world, "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
