"""`K3_KERNELS_EXTRA`: kernels awaiting their GPU tests can be registered for one run (CPU)."""

import pytest

from k3compile import kernels


def test_extra_kernels_from_the_environment(monkeypatch):
    monkeypatch.delenv("K3_KERNELS_EXTRA", raising=False)
    assert kernels.extra_kernels() == ()
    monkeypatch.setenv("K3_KERNELS_EXTRA", "situ,gemv")  # situ is in KERNELS already
    assert kernels.extra_kernels() == ("gemv",)
    monkeypatch.setenv("K3_KERNELS_EXTRA", "gemv,no_such_kernel")
    with pytest.raises(ValueError, match="no_such_kernel"):
        kernels.extra_kernels()
