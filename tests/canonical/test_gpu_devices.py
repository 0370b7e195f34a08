"""The rules prove a region on small values on the CPU whatever device a GPU graph names: its
factory ops (arange, zeros, full, `_to_copy`) carry `device=cuda`, and run as written the proof
mixes devices, raises, and the site is left unfused on GPU graphs only (session 26: spell6's
experts under rule expert_rows on an H100). Here a CPU graph's factory ops are renamed to cuda
(this CPU build cannot make a CUDA tensor: a proof that ran one would raise)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from k3compile.canonical import expert_rows
from k3compile.canonical.region import call_on_cpu

from .rule_checks import targets, trace
from .test_expert_rows import SPELLINGS
from .test_expert_slots import _inputs

aten = torch.ops.aten
CUDA = torch.device("cuda")


def name_device(graph: fx.Graph, device: torch.device) -> int:
    """Every node's `device` keyword set to `device`; how many nodes have one."""
    named = [n for n in graph.nodes if "device" in n.kwargs]
    for n in named:
        n.kwargs = {**n.kwargs, "device": device}
    return len(named)


def test_call_on_cpu_runs_factories_and_copies_that_name_cuda_on_the_cpu():
    x = torch.arange(6.0)
    assert torch.equal(call_on_cpu(aten.arange.start, (0, 6), {"device": CUDA}), torch.arange(6))
    assert torch.equal(call_on_cpu(aten.zeros.default, ([2, 3],), {"device": CUDA}),
                       torch.zeros(2, 3))
    got = call_on_cpu(aten._to_copy.default, (x,), {"dtype": torch.float64, "device": CUDA})
    assert got.device.type == "cpu" and torch.equal(got, x.double())


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_expert_rows_proves_a_gpu_graphs_pair_rows(spelling):
    fn, args = SPELLINGS[spelling], _inputs(1, torch.float32)
    gm = trace(fn, args)
    assert name_device(gm.graph, CUDA)  # the finalize's zeros and token index
    n = expert_rows.RULE.apply(gm.graph)
    name_device(gm.graph, torch.device("cpu"))
    gm.recompile()
    assert n == 1 and "aten.index_put.default" not in targets(gm)
    got, want = (torch.utils._pytree.tree_leaves(t)[0] for t in (gm(*args), fn(*args)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))
