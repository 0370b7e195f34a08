"""`K3_KERNELS_EXTRA` / `K3_KERNELS_SKIP`: kernels registered or set aside for one run (CPU)."""

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


def test_skipped_kernels_from_the_environment(monkeypatch):
    """K3_KERNELS_SKIP sets a registered kernel aside: register_all leaves it out (so cuda_ops
    and the GPU deferral do too); an unknown name is an error, not a silent no-op."""
    monkeypatch.delenv("K3_KERNELS_EXTRA", raising=False)
    monkeypatch.delenv("K3_KERNELS_SKIP", raising=False)
    assert kernels.skipped_kernels() == ()
    monkeypatch.setenv("K3_KERNELS_SKIP", "moe_route,situ")
    assert kernels.skipped_kernels() == ("moe_route", "situ")
    monkeypatch.setattr(kernels, "_registered", [])
    monkeypatch.setattr("k3compile.kernels.common.dsl.have_dsl", lambda: True)
    imported = []
    monkeypatch.setattr(kernels.importlib, "import_module",
                        lambda name: imported.append(name.rsplit(".", 1)[-1]) or _Stub())
    assert kernels.register_all() == [k for k in kernels.KERNELS if k not in ("moe_route", "situ")]
    assert "moe_route" not in imported and "situ" not in imported
    monkeypatch.setenv("K3_KERNELS_SKIP", "moe_rout")
    with pytest.raises(ValueError, match="K3_KERNELS_SKIP"):
        kernels.skipped_kernels()


class _Stub:
    @staticmethod
    def register():
        pass
