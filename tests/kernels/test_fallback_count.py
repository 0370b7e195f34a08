"""The run-time count of reference fallbacks (kernels/common/dsl.py `fallback_counts`) and its
line in `K3Compiled.summary()` (CPU): a kernel's CUDA implementation called where it cannot
launch (no DSL, CPU tensors) runs the reference, counted per (op, reason), and returns the
reference's values."""

import pytest
import torch
from k3compile.kernels.common import dsl
from k3compile.kernels.rms_norm import rms_norm_cuda

import k3compile.backend as be
from k3compile.ops.rms_norm import rms_norm_ref


@pytest.fixture
def counts():
    dsl.reset_fallback_counts()
    yield
    dsl.reset_fallback_counts()


def _refused_calls(n):
    """n calls of the rms_norm kernel's CUDA path that refuse on this machine; each must equal
    the reference."""
    x, w = torch.randn(3, 64).bfloat16(), (1 + torch.randn(64) * 0.1).bfloat16()
    for _ in range(n):
        assert torch.equal(rms_norm_cuda(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    return dsl.runtime_refusal() or "data not 16-byte aligned"


@pytest.mark.usefixtures("counts")
def test_each_refused_call_is_counted_by_op_and_reason():
    if dsl.runtime_refusal() is None:
        pytest.skip("the DSL can launch here: CPU tensors would be refused for another reason")
    reason = _refused_calls(3)
    dsl.fallback("gemv_norm", "K 20000 > 16384; two launches")
    assert dsl.fallback_counts() == {("rms_norm", reason): 3,
                                     ("gemv_norm", "K 20000 > 16384; two launches"): 1}
    dsl.reset_fallback_counts()
    assert dsl.fallback_counts() == {}


@pytest.mark.usefixtures("counts")
def test_summary_shows_the_fallbacks():
    if dsl.runtime_refusal() is None:
        pytest.skip("the DSL can launch here: CPU tensors would be refused for another reason")
    step = torch.compile(lambda x: torch.relu(x) * 2, backend="k3", fullgraph=True,
                         options={"executor": "aten"})
    x = torch.randn(4, 8)
    torch.testing.assert_close(step(x), torch.relu(x) * 2, rtol=0, atol=0)
    compiled = be.last_compiled()
    assert "reference fallbacks" not in compiled.summary()
    reason = _refused_calls(2)
    assert f"reference fallbacks: rms_norm ({reason}) x 2" in compiled.summary()


def test_an_unaligned_tensor_is_named_in_the_reason():
    """The reason a fallback logs says which tensor of the call is unaligned (issue 18: one gemv
    of the second spelling fell back on the H200 with only "data not 16-byte aligned")."""
    x = torch.zeros(64, dtype=torch.bfloat16)
    base = x.data_ptr() % 16 // 2  # elements the allocation already sits past 16 bytes (0 on CPU)
    aligned = x[(8 - base) % 8:][:56]
    assert dsl.unaligned16(aligned, aligned[8:]) is None
    assert dsl.unaligned16(aligned, aligned[4:].view(-1, 4)) == (
        "data not 16-byte aligned: tensor 1 torch.bfloat16 (13, 4) strides (4, 1) starts 8 B "
        "past 16")
