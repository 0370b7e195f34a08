"""CUDA-graph replay timing shared by the kernel benchmarks (scripts in this folder)."""

import statistics
from collections.abc import Callable, Sequence

import torch


def graph_us(calls: Sequence[Callable[[], object]], warmup: Sequence[Callable[[], object]],
             replays: int, warm_replays: int = 1) -> float:
    """Median µs per call: `warmup` runs on a side stream (autotuning, workspaces), `calls` are
    captured in order into one CUDA graph, which is replayed `warm_replays` times untimed and
    `replays` times timed (graph time / len(calls), so the gaps between kernels count)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in warmup:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(warm_replays):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)
