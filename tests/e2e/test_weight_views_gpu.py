"""Stage `weight_views` on the GPU: an FSDP-style MLP whose weights are views of one flat
Parameter reaches the CUDA kernels of `k3.situ_gate_up` and `k3.linear` (no kernel refuses the
views: no reference fallback is counted), the step replays a CUDA graph, and updates of the flat
storage after the compile are seen by the replay: in place (`load_state_dict`) and new memory
(`flat.data = t`, captured again)."""

from __future__ import annotations

import pytest
import torch

import k3compile.backend as k3be
from k3compile.kernels.common.dsl import fallback_counts, reset_fallback_counts
from tests.conftest import TOL, rel_err
from tests.stages.test_weight_views import FlatMLP, _fused

pytestmark = pytest.mark.gpu
D, F = 512, 1024


@pytest.mark.parametrize("rows", [1, 4])
def test_flat_storage_views_reach_the_kernels_and_follow_updates(rows):
    torch._dynamo.reset()
    reset_fallback_counts()
    model = FlatMLP(torch.bfloat16, d=D, f=F).cuda()
    eager = FlatMLP(torch.bfloat16, d=D, f=F).cuda()
    step = torch.compile(model, backend="k3", fullgraph=True, options={"buckets": (rows,)})
    x = torch.randn(rows, D, dtype=torch.bfloat16, device="cuda")
    tol = TOL["diffsuite_bf16"]
    with torch.no_grad():
        for _ in range(3):
            assert rel_err(step(x), eager(x)) <= tol
        fused = _fused(k3be.last_compiled())
        assert fused.get("k3.situ_gate_up") == 1 and fused.get("k3.linear") == 1, fused
        (bucket,) = k3be.last_compiled().buckets.values()
        assert bucket.graph is not None, "the bucket was not captured in a CUDA graph"
        new = FlatMLP(torch.bfloat16, seed=1, d=D, f=F).cuda().state_dict()
        model.load_state_dict(new)
        eager.load_state_dict(new)
        assert rel_err(step(x), eager(x)) <= tol
        fresh = FlatMLP(torch.bfloat16, seed=2, d=D, f=F).flat.detach().cuda()
        model.flat.data, eager.flat.data = fresh, fresh.clone()
        for _ in range(2):
            assert rel_err(step(x), eager(x)) <= tol
    refused = {k: n for k, n in fallback_counts().items() if k[0] in ("situ_gate_up", "linear")}
    assert not refused, refused
