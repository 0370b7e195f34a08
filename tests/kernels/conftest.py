"""Fixtures of the kernel tests: GPU gating and kernel registration, fresh random inputs."""

import pytest
import torch


@pytest.fixture(scope="session")
def cuda_kernels():
    """Skip without a GPU or a DSL that can launch; otherwise register every kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from k3compile.kernels import register_all
    from k3compile.kernels.common.dsl import runtime_refusal

    if reason := runtime_refusal():
        pytest.skip(reason)
    return register_all()


@pytest.fixture
def gen():
    """Fresh random inputs every run; the seed is printed (shown when a test fails)."""
    seed = int(torch.randint(1 << 30, ()).item())
    print(f"seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)
