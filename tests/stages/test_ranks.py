"""Stage `ranks`: under tensor parallelism each rank's compiled graph is fingerprinted and the
fingerprints are all-gathered over the graph's TP group; ranks that compiled different graphs
fail together, with a diff. Two gloo processes on CPU, hand-built graphs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import fx

from k3compile import settings
from k3compile.rewrite import inductor
from k3compile.stages.ranks import RanksDiffer, check_ranks, summary
from tests import gloo

_c10d = torch.ops._c10d_functional


def _step(extra: bool):
    def step(x, w):
        h = _c10d.wait_tensor(_c10d.all_reduce(x @ w.t(), "sum", "0"))
        return (h.relu() if extra else h) * 2

    return step


def _graph(extra: bool, group: str = "0"):
    gm = inductor.fwd_only_fake(_step(extra), [torch.randn(2, 8), torch.randn(4, 8)])
    for node in gm.graph.nodes:  # name the process group the test initialised
        if node.target is _c10d.all_reduce.default:
            node.args = (*node.args[:2], group)
    return gm.graph


def test_summary_names_nodes_by_position_and_masks_group_names():
    a, b = summary(_graph(False, "groupA"), 4), summary(_graph(False, "groupB"), 4)
    assert a == b  # the same program under other group names
    assert a[0] == "bucket 4" and any("all_reduce" in line and "<group>" in line for line in a)
    assert summary(_graph(True), 4) != summary(_graph(False), 4)


def test_summary_masks_the_device_index():
    """Each rank builds its constants on its own GPU (cuda:0, cuda:1): not a difference."""
    def graph(index):
        g = fx.Graph()
        g.output(g.call_function(torch.ops.aten.full.default, ([4], -1.0), {
            "device": torch.device("cuda", index), "dtype": torch.float32}))
        return g

    assert summary(graph(0), 1) == summary(graph(1), 1)
    assert any("device(cuda)" in line for line in summary(graph(0), 1))


def test_no_collective_no_check():
    graph = inductor.fwd_only_fake(lambda x: x * 2, [torch.randn(2)]).graph
    assert check_ranks(graph, 1) is None


def _worker(rank: int, out_dir: str, differ: bool, pdl_differs: bool = False):
    graph = _graph(extra=differ and rank == 1, group=dist.group.WORLD.group_name)
    if pdl_differs and rank == 1:  # e.g. K3_PDL set on one rank's launcher only
        settings.KERNELS.pdl = not settings.KERNELS.pdl
    try:
        result = ("ok", check_ranks(graph, 4))
    except RanksDiffer as e:
        result = ("differ", str(e))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("differ", [False, True])
def test_ranks_agree_or_fail_together(tmp_path, differ):
    gloo.spawn(_worker, str(tmp_path), differ)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    if not differ:
        assert results[0][0] == results[1][0] == "ok"
        assert results[0][1] == results[1][1] and len(results[0][1]) == 16
    else:
        for kind, text in results:  # both ranks raise, and say where the graphs part
            assert kind == "differ", text
            assert "rank 0" in text and "rank 1" in text and "relu" in text, text


def test_summary_holds_the_kernel_settings(monkeypatch):
    """The process's kernel switches are part of what ranks must agree on."""
    lines = summary(_graph(False), 4)
    assert any(line.startswith("gemm_tc_table ") and "None" not in line for line in lines)
    monkeypatch.setattr(settings.KERNELS, "pdl", not settings.KERNELS.pdl)
    assert summary(_graph(False), 4) != lines
    monkeypatch.setattr(settings.KERNELS, "pdl", not settings.KERNELS.pdl)
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset({"split"}))
    assert summary(_graph(False), 4) != lines


@pytest.mark.slow
def test_ranks_with_different_kernel_switches_fail_together(tmp_path):
    gloo.spawn(_worker, str(tmp_path), False, True)
    for kind, text in (torch.load(tmp_path / f"rank{r}.pt") for r in range(2)):
        assert kind == "differ" and "pdl" in text, text
