"""Shared helpers for the model tests: the tolerance table and a relative-error check.

Errors are measured as max|actual - expected| / max|expected| over the whole tensor, so one
number covers tensors whose entries span several orders of magnitude (KDA per-head outputs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `import naive_k3` from the test modules

# Relative tolerance against the float64 naive implementation.
TOL = {
    # one block, same inputs: fp32 rounding only
    "float32": 1e-4,
    # whole model over several steps: rounding compounds through 6 layers and the states; the model
    # against itself in float64 differs by ~5e-5 (KDA per-head outputs cancel)
    "float32_decode": 5e-4,
    # bf16 activations and GEMMs against exact math on the same (bf16) weights
    "bfloat16": 3e-2,
    "bfloat16_decode": 8e-2,
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.to(torch.float64)
    diff = (actual.to(torch.float64) - expected).abs().max()
    return float(diff / expected.abs().max().clamp_min(1e-30))


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = ""):
    shapes = f"{tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.shape == expected.shape, f"{what}: shape {shapes}"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tests run thousands of tiny ops; intra-op threads only add barrier waits, which grow
    to milliseconds when other jobs share the 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
