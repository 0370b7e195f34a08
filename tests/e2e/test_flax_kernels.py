"""spell9's Flax kernels [in, out] after stage `kernel_layout` (tests/models/spell9_k3.py): the
compiled step re-lays them once (the first call), compiles again on Dynamo's stride guards, and
from then on every in-place update of a kernel (`copy_`, `load_state_dict`, `.data.copy_`),
fused into a group or not, is what the step computes with, with no further compile. Slow: two
compiles of the 4-layer tiny spelling (CPU, executor aten)."""

from __future__ import annotations

import pytest
import torch

import k3compile.backend as k3be
from k3compile.stages import pack as packing
from tests.conftest import TOL
from tests.models.spell9_k3 import from_builtin
from tests.spellings import foreign

# a KDA in-projection (linear_concat), the dense MLP's gate (situ_gate_up), an MLA q_a
# (linear_concat), the MLA kv_b (read by einsums: W_UK, W_UV), the lm head (linear)
KERNELS = ("layers.1.attn.wq.kernel", "layers.0.ffn.gate.kernel", "layers.2.attn.wq_a.kernel",
           "layers.2.attn.wkv_b.kernel", "lm_head.kernel")


@pytest.mark.slow
def test_spell9_kernel_updates_reach_the_step():
    builtin = foreign.builtin(torch.float32)
    model, eager = from_builtin(builtin), from_builtin(builtin)
    step = foreign.compile_k3(model)
    assert foreign.steps(step, eager, n=2) <= TOL["aten_cpu"]  # re-laid, compiled again
    params = dict(model.params.named_parameters())
    assert all(params[k].t().is_contiguous() for k in KERNELS)
    assert packing.adjacent([params[f"layers.1.attn.w{m}.kernel"].t() for m in "qkv"]), \
        "KDA's q|k|v not packed as [out, in] rows"
    compiles = len(k3be._compiled)
    gen = torch.Generator().manual_seed(3)
    theirs = dict(eager.params.named_parameters())
    with torch.no_grad():
        for i, name in enumerate(KERNELS):
            new = torch.randn(params[name].shape, generator=gen) * params[name].std()
            if i % 3 == 0:
                params[name].copy_(new)
            elif i % 3 == 1:
                params[name].data.copy_(new)
            else:
                model.params.load_state_dict({name: new}, strict=False)
            theirs[name].copy_(new)
    assert foreign.steps(step, eager, n=2) <= TOL["aten_cpu"]
    assert len(k3be._compiled) == compiles, "an in-place update compiled the step again"
    assert all(params[k].t().is_contiguous() for k in KERNELS)
