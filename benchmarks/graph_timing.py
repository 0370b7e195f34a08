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


def versus_row(us: dict[str, float], moved: int, gbps: float, label: str, **fields) -> dict:
    """One benchmark row of a kernel against its eager and torch.compile references: `us` holds
    the µs of "kernel", "eager" and "inductor" (NaN: not run), `moved` the bytes the kernel must
    touch, `gbps` the copy bandwidth; printed as one line ending in `label`."""
    row = {**fields, "bytes": moved, **{f"{k}_us": round(v, 2) for k, v in us.items()},
           "kernel_GBps": round(moved / us["kernel"] / 1e3),
           "vs_inductor": round(us["inductor"] / us["kernel"], 2),
           "vs_eager": round(us["eager"] / us["kernel"], 2)}
    row["kernel_pct_copy"] = round(100 * row["kernel_GBps"] / gbps, 1)
    print(f"B={row['B']:2d} T={row['T']}  kernel {us['kernel']:7.2f} us {row['kernel_GBps']:5d} "
          f"GB/s {row['kernel_pct_copy']:5.1f}%  inductor {us['inductor']:8.2f} us "
          f"(x{row['vs_inductor']:.2f})  eager {us['eager']:8.2f} us (x{row['vs_eager']:.2f})  "
          f"{label}", flush=True)
    return row


def versus_table(rows) -> None:
    """The `versus_row` rows as a markdown table (per B and T)."""
    print("\n| B | T | kernel µs | GB/s | % copy | Inductor µs | eager µs | vs Inductor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['T']} | {r['kernel_us']:.2f} | {r['kernel_GBps']} | "
              f"{r['kernel_pct_copy']} | {r['inductor_us']:.2f} | {r['eager_us']:.2f} | "
              f"x{r['vs_inductor']:.2f} |")
