"""`K3_KERNELS_EXTRA` / `K3_KERNELS_SKIP` (settings.KERNELS.extra / .skip): kernels registered or
set aside for one run (CPU)."""

import pytest

from k3compile import kernels, settings


def test_extra_kernels_from_the_settings(monkeypatch):
    monkeypatch.setattr(settings.KERNELS, "extra", ())
    assert kernels.extra_kernels() == ()
    monkeypatch.setattr(settings.KERNELS, "extra", ("situ_gate_up", "mla_q_absorb"))
    assert kernels.extra_kernels() == ("mla_q_absorb",)  # situ_gate_up is in KERNELS already
    monkeypatch.setattr(settings.KERNELS, "extra", ("mla_q_absorb", "no_such_kernel"))
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


def _meta(*shape, dtype=None):
    import torch

    return torch.empty(shape, dtype=dtype or torch.bfloat16, device="meta")


def test_register_all_fills_the_op_registry(monkeypatch):
    """Every kernel module registers its op (and its limits) in the op registry; the natives
    register without a kernel; cuda_ops() is the registry's."""
    pytest.importorskip("cutlass")
    from k3compile.ops import registry

    monkeypatch.setattr(settings.KERNELS, "extra", ())
    monkeypatch.setattr(settings.KERNELS, "skip", ())
    kernels.register_all()
    ops = kernels.cuda_ops()
    assert ops == registry.cuda_ops()
    assert set(kernels.KERNELS) | set(kernels.NATIVE) <= ops
    assert all(registry.entry(op).native for op in kernels.NATIVE)
    assert registry.kernel_refusal("no_such_op") is not None


def test_registered_refusals_take_metas(monkeypatch):
    """The limits a pattern asks for through the registry, on tensor metas: mla_uv_gate's gate
    variant (one row, K3_GEMV_FUSED "gate") and moe_experts' intermediate size."""
    import torch

    pytest.importorskip("cutlass")
    from k3compile.ops import registry

    kernels.register_all()
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset({"gate"}))
    o_lat, w_uv, g = _meta(1, 1, 6, 512), _meta(6, 128, 512), _meta(1, 1, 768)
    assert registry.kernel_refusal("mla_uv_gate", o_lat, w_uv, g) is None
    assert "3 rows" in registry.kernel_refusal("mla_uv_gate", _meta(3, 1, 6, 512), w_uv,
                                               _meta(3, 1, 768))
    monkeypatch.setattr(settings.KERNELS, "gemv_fused", frozenset())
    assert "off" in registry.kernel_refusal("mla_uv_gate", o_lat, w_uv, g)

    u8 = torch.uint8
    n, k, e, latent = 2, 4, 8, 3584

    def experts(inter):
        return (_meta(n, latent), _meta(n, k, dtype=torch.int64), _meta(n, k, dtype=torch.float32),
                _meta(e, inter, latent // 2, dtype=u8), _meta(e, inter, latent // 32, dtype=u8),
                _meta(e, inter, latent // 2, dtype=u8), _meta(e, inter, latent // 32, dtype=u8),
                _meta(e, latent, inter // 2, dtype=u8), _meta(e, latent, inter // 32, dtype=u8))

    assert registry.kernel_refusal("moe_experts", *experts(192)) is None
    assert "intermediate" in registry.kernel_refusal("moe_experts", *experts(4096))
    assert registry.kernel_refusal("rms_norm", _meta(2, 3, 7168), _meta(7168), 1e-5) is None
