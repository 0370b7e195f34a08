"""One rank of tests/kernels/test_collective.py, launched by torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/kernels/collective_worker.py OUT

Per size (1, 8, 64 rows of 7168) and all-reduce algorithm: the all-reduce alone and the fused
`k3.allreduce_attn_res_mix_norm` (and its `scores_fp32` variant), run eagerly, captured in a CUDA
graph, then replayed twice on fresh inputs copied into the captured buffers; writes OUT/rank{r}.pt
with each case's errors (all-reduce vs the exact sum, fused op vs its reference, the variant vs
its reference on the step's own all-reduced sum) and exits without tearing the process
group down (see the end of `main`). A rank still waiting after 120 s dumps
its stack to stderr (the test gives up at 150 s); each case prints a line as it passes.
"""

import faulthandler
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

HIDDEN, BLOCKS, EPS = 7168, 8, 1e-5


def main(out_dir: str):
    faulthandler.dump_traceback_later(100)
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    print(f"rank {rank}: process group up", flush=True)
    errors = {}
    try:
        from k3compile.kernels import register_all
        from k3compile.kernels.common import collective

        import k3compile.ops  # noqa: F401
        from k3compile.ops.attn_res_mix_norm import attn_res_mix_norm_ref

        register_all()
        group = dist.group.WORLD.group_name
        gen = torch.Generator(device="cuda").manual_seed(7)  # same draws on both ranks

        def draw(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

        for n in (1, 8, 64):
            wn, wp = draw(HIDDEN), draw(1, HIDDEN, scale=HIDDEN ** -0.5)
            wnorm = (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device="cuda")).bfloat16()
            static = [draw(n, HIDDEN), draw(n, HIDDEN)] + [draw(n, HIDDEN) for _ in range(BLOCKS)]
            for algo in collective.ALGORITHMS:
                os.environ["K3_ALLREDUCE"] = algo

                def step(static=static, wn=wn, wp=wp, wnorm=wnorm):  # this size's buffers
                    partial, prefix, *blocks = static
                    return (collective.all_reduce(partial, group, world),
                            *torch.ops.k3.allreduce_attn_res_mix_norm(
                                partial, prefix, blocks, wn, wp, wnorm, EPS, EPS, group),
                            *torch.ops.k3.allreduce_attn_res_mix_norm(
                                partial, prefix, blocks, wn, wp, wnorm, EPS, EPS, group, True))

                # eager first (buffers, kernels compiled) on a side stream, then both ranks
                # capture together: the benchmarks' recipe (graph_timing.graph_us), which runs
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    step()
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                dist.barrier()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = step()
                for trial in range(2):  # fresh inputs into the static buffers, then replay
                    parts = [draw(n, HIDDEN) for _ in range(world)]
                    prefix, blocks = draw(n, HIDDEN), [draw(n, HIDDEN) for _ in range(BLOCKS)]
                    for dst, src in zip(static, [parts[rank], prefix, *blocks]):
                        dst.copy_(src)
                    graph.replay()
                    exact = torch.stack([p.float() for p in parts]).sum(0)
                    want = attn_res_mix_norm_ref(prefix, exact.bfloat16(), blocks, wn, wp, wnorm,
                                                 EPS, EPS)
                    want32 = attn_res_mix_norm_ref(prefix, outs[0], blocks, wn, wp, wnorm, EPS,
                                                   EPS, True)
                    summed = ((outs[0].float() - exact).abs().max() / exact.abs().max()).item()
                    fused, fused32 = (max(((g.float() - r.float()).norm() / r.float().norm()
                                           ).item() for g, r in zip(got, ref))
                                      for got, ref in ((outs[1:3], want), (outs[3:], want32)))
                    errors[f"{algo} n={n} trial {trial}"] = (summed, fused, fused32)
                    print(f"rank {rank}: {algo} n={n} trial {trial}: {summed:.3g} {fused:.3g} "
                          f"{fused32:.3g}", flush=True)
        os.environ.pop("K3_ALLREDUCE", None)
        code = 0
    except BaseException:  # noqa: BLE001 (reported, then the exit code says it)
        traceback.print_exc()
        code = 1
    torch.save(errors, os.path.join(out_dir, f"rank{rank}.pt"))
    faulthandler.cancel_dump_traceback_later()
    print(f"rank {rank}: done ({len(errors)} cases)", flush=True)
    sys.stderr.flush()
    # no destroy_process_group: on the H200 x2 (torch 2.11, session 6) every case passed and then
    # both ranks hung in the teardown after the captured one-shot / two-shot graphs until the
    # test's timeout; the errors are saved, so the process ends here
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1])
