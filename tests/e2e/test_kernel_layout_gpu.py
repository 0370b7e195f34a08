"""Stage `kernel_layout` on the GPU: a Flax-style MLP's [in, out] kernels, re-laid by the first call
and packed by the recompile, reach the CUDA kernels of `k3.situ_gate_up` and `k3.linear` as
contiguous [N, K] rows (no kernel refuses them: no reference fallback is counted), the step replays
a CUDA graph, and an in-place update after the compile is seen by the replay."""

from __future__ import annotations

import pytest
import torch
from k3compile.kernels.common.dsl import fallback_counts, reset_fallback_counts

import k3compile.backend as k3be
from k3compile.stages import pack as packing
from tests.conftest import TOL, rel_err
from tests.stages.test_kernel_layout import FlaxMLP, packs_after_the_re_lay

pytestmark = pytest.mark.gpu


def _fused(compiled) -> dict:
    (records,) = compiled.observer.records.values()
    return {str(op): n for op, n in records[-1].ops_after.items() if str(op).startswith("k3.")}


@pytest.mark.parametrize("rows", [1, 4])
def test_flax_kernels_reach_the_kernels_contiguous(rows):
    torch._dynamo.reset()
    reset_fallback_counts()
    model = FlaxMLP(d=512, f=1024, dtype=torch.bfloat16).cuda()
    eager = FlaxMLP(d=512, f=1024, dtype=torch.bfloat16).cuda()
    step = torch.compile(model, backend="k3", fullgraph=True, options={"buckets": (rows,)})
    x = torch.randn(rows, 512, dtype=torch.bfloat16, device="cuda")
    compiles = len(k3be._compiled)
    with torch.no_grad():
        for _ in range(4):  # the second call compiles again (the first re-laid the kernels)
            assert rel_err(step(x), eager(x)) <= TOL["diffsuite_bf16"]
        assert all(w.t().is_contiguous() for w in (model.gate, model.up, model.down))
        packs_after_the_re_lay(compiles)
        assert packing.adjacent([model.gate.t(), model.up.t()])
        fused = _fused(k3be.last_compiled())
        assert fused.get("k3.situ_gate_up") == 1 and fused.get("k3.linear") == 1, fused
        (bucket,) = k3be.last_compiled().buckets.values()
        assert bucket.graph is not None, "the bucket was not captured in a CUDA graph"
        new = FlaxMLP(d=512, f=1024, dtype=torch.bfloat16, seed=1).cuda().state_dict()
        model.load_state_dict(new)
        eager.load_state_dict(new)
        assert rel_err(step(x), eager(x)) <= TOL["diffsuite_bf16"]
    refused = {k: n for k, n in fallback_counts().items() if k[0] in ("situ_gate_up", "linear")}
    assert not refused, refused
