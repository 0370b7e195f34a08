"""`K3_KERNELS_EXTRA` / `K3_KERNELS_SKIP` (settings.KERNELS.extra / .skip): kernels registered or
set aside for one run (CPU)."""

import pytest

from k3compile import kernels, settings


def test_extra_kernels_from_the_settings(monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "extra", ())
    assert kernels.extra_kernels() == ()
    monkeypatch.setattr(settings.KERNELS, "extra", ("situ_gate_up", "mla_decode"))
    assert kernels.extra_kernels() == ("mla_decode",)  # situ_gate_up is in KERNELS already
    monkeypatch.setattr(settings.KERNELS, "extra", ("mla_decode", "no_such_kernel"))
    with pytest.raises(ValueError, match="no_such_kernel"):
        kernels.extra_kernels()


def test_skipped_kernels_from_the_settings(monkeypatch):
    """K3_KERNELS_SKIP sets a registered kernel aside: register_all leaves it out (so cuda_ops
    and the GPU deferral do too); an unknown name is an error, not a silent no-op."""
    monkeypatch.setattr(settings.KERNELS, "extra", ())
    monkeypatch.setattr(settings.KERNELS, "skip", ())
    assert kernels.skipped_kernels() == ()
    monkeypatch.setattr(settings.KERNELS, "skip", ("moe_route", "situ_gate_up"))
    assert kernels.skipped_kernels() == ("moe_route", "situ_gate_up")
    monkeypatch.setattr(kernels, "_registered", [])
    monkeypatch.setattr("k3compile.kernels.common.dsl.have_dsl", lambda: True)
    imported = []
    monkeypatch.setattr(kernels.importlib, "import_module",
                        lambda name: imported.append(name.rsplit(".", 1)[-1]) or _Stub())
    assert kernels.register_all() == [k for k in kernels.KERNELS
                                      if k not in ("moe_route", "situ_gate_up")]
    assert "moe_route" not in imported and "situ_gate_up" not in imported
    monkeypatch.setattr(settings.KERNELS, "skip", ("moe_rout",))
    with pytest.raises(ValueError, match="K3_KERNELS_SKIP"):
        kernels.skipped_kernels()


class _Stub:
    @staticmethod
    def register():
        pass
