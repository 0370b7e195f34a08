"""The model tests' relative-error check (tolerances: the one table in tests/conftest.py).

Errors are measured as max|actual - expected| / max|expected| over the whole tensor, so one
number covers tensors whose entries span several orders of magnitude (KDA per-head outputs).
"""

from __future__ import annotations

import torch

from tests.conftest import TOL  # noqa: F401  (re-exported to the model tests)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.to(torch.float64)
    diff = (actual.to(torch.float64) - expected).abs().max()
    return float(diff / expected.abs().max().clamp_min(1e-30))


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = ""):
    shapes = f"{tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.shape == expected.shape, f"{what}: shape {shapes}"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"
