"""The TP all-reduce behind `k3.allreduce_attn_res_mix_norm` on 2 GPUs (NCCL, one-shot and
two-shot symmetric memory): each algorithm equals the exact sum, the fused op equals its
reference, and both stay right when captured in a CUDA graph and replayed on new inputs."""

from __future__ import annotations

import faulthandler
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp



WORLD, HIDDEN, BLOCKS, EPS = 2, 7168, 8, 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str):
    faulthandler.dump_traceback_later(75)  # a hang shows where each rank waits
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD,
                            device_id=torch.device("cuda", rank))
    errors = {}
    try:
        import k3compile.ops  # noqa: F401
        from k3compile.kernels import register_all
        from k3compile.kernels.common import collective
        from k3compile.ops.attn_res import attn_res_mix_norm_ref

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

                def step():
                    partial, prefix, *blocks = static
                    return (collective.all_reduce(partial, group, WORLD),
                            *torch.ops.k3.allreduce_attn_res_mix_norm(
                                partial, prefix, blocks, wn, wp, wnorm, EPS, EPS, group))

                step()  # eager first: buffers, kernels compiled
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = step()
                for trial in range(2):  # fresh inputs into the static buffers, then replay
                    parts = [draw(n, HIDDEN) for _ in range(WORLD)]
                    prefix, blocks = draw(n, HIDDEN), [draw(n, HIDDEN) for _ in range(BLOCKS)]
                    for dst, src in zip(static, [parts[rank], prefix, *blocks]):
                        dst.copy_(src)
                    graph.replay()
                    exact = torch.stack([p.float() for p in parts]).sum(0)
                    want = attn_res_mix_norm_ref(prefix, exact.bfloat16(), blocks, wn, wp, wnorm,
                                                 EPS, EPS)
                    summed = ((outs[0].float() - exact).abs().max() / exact.abs().max()).item()
                    fused = max(((g.float() - r.float()).norm() / r.float().norm()).item()
                                for g, r in zip(outs[1:], want))
                    errors[f"{algo} n={n} trial {trial}"] = (summed, fused)
        os.environ.pop("K3_ALLREDUCE", None)
    finally:
        torch.save(errors, os.path.join(out_dir, f"rank{rank}.pt"))
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()


@pytest.mark.gpu
def test_allreduce_algorithms_and_fused_op_under_cuda_graphs(tmp_path):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(errors) == 3 * 3 * 2, errors
        for case, (summed, fused) in errors.items():
            assert summed < 1e-2, f"rank {rank} {case}: all-reduce off the exact sum by {summed:.3g}"
            assert fused < 2e-2, f"rank {rank} {case}: fused op off its reference by {fused:.3g}"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_algorithm_by_message_size(world, monkeypatch):
    """CPU: decode's small messages take one-shot, the largest NCCL; K3_ALLREDUCE forces one."""
    from k3compile.kernels.common import collective

    monkeypatch.delenv("K3_ALLREDUCE", raising=False)
    row = HIDDEN * 2
    assert collective.algorithm(row, world) == "one_shot"
    assert collective.algorithm(64 << 20, world) == "nccl"
    assert collective.algorithm(collective.ONE_SHOT_MAX[world] + 1, world) != "one_shot"
    monkeypatch.setenv("K3_ALLREDUCE", "two_shot")
    assert collective.algorithm(row, world) == "two_shot"
    monkeypatch.setenv("K3_ALLREDUCE", "ring")
    with pytest.raises(ValueError, match="K3_ALLREDUCE"):
        collective.algorithm(row, world)
