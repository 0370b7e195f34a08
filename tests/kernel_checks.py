"""Checks shared by the kernel tests; their tolerances are the one table's (tests/conftest.py:
bf16 outputs may differ from a float64 model of the same math by one bf16 rounding, 2^-8
relative, in a few elements; fp32 router weights by a few ulps, the exp approximation)."""

import contextlib

import pytest
import torch

from tests.conftest import TOL  # noqa: F401  (re-exported to the kernel tests)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poisoned(*shape, dtype=torch.bfloat16):
    """An output buffer the kernel must overwrite entirely (NaN, or -1 for integers)."""
    fill = -1 if not dtype.is_floating_point else float("nan")
    return torch.full(shape, fill, dtype=dtype, device="cuda")


def assert_written(*outs):
    for t in outs:
        bad = t.isnan() if t.dtype.is_floating_point else t < 0
        assert not bad.any(), f"{int(bad.sum())} of {t.numel()} elements not written"


@contextlib.contextmanager
def no_fallback():
    """Every kernel called inside launches: no call runs its torch reference (fallback count)."""
    from k3compile.kernels.common import dsl

    before = dsl.fallback_counts()
    yield
    assert dsl.fallback_counts() == before, "a kernel fell back to its reference"


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with a last-dim stride of 2: a layout the references take and the kernels
    refuse."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def assert_refused(refusal, args, i, value, words: str) -> None:
    """`refusal(*args)` with argument i replaced by `value` gives a reason containing `words`."""
    bad = list(args)
    bad[i] = value
    why = refusal(*bad)
    assert why and words in why, why


def check_extra_replaces(monkeypatch, extra: str, op, one_fn, two_fn, restore) -> None:
    """K3_KERNELS_EXTRA=`extra` names a kernel module whose register() makes `one_fn` the CUDA
    implementation of `op` in place of `two_fn`; `restore()` (the base module's register())
    puts `two_fn` back."""
    import importlib
    import inspect

    from k3compile import kernels, settings

    def impls():  # the functions torch's and our wrappers hold (closures, __wrapped__)
        found, todo = [], [op._backend_fns["cuda"]]
        while todo:
            fn = todo.pop()
            if fn in found:
                continue
            found.append(fn)
            todo += [c.cell_contents for c in getattr(fn, "__closure__", None) or ()
                     if inspect.isfunction(c.cell_contents)]
            todo += [fn.__wrapped__] if hasattr(fn, "__wrapped__") else []
        return found

    monkeypatch.setattr(settings.KERNELS, "extra", (extra,))
    assert kernels.extra_kernels() == (extra,)
    try:
        importlib.import_module(f"k3compile.kernels.{extra}").register()
        assert one_fn in impls()
    finally:
        restore()
    assert two_fn in impls() and one_fn not in impls()


def on_gpu(test):
    """A GPU test with every kernel registered (the `cuda_kernels` fixture skips without one)."""
    return pytest.mark.gpu(pytest.mark.usefixtures("cuda_kernels")(test))


# ---- the skinny GEMMs (gemv, gemm_tc) ----------------------------------------------------------


def gemm_inputs(gen, m, n, k):
    """x [m, k] and W [n, k] in bf16, W scaled so that the sums stay ~N(0, 1)."""
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).bfloat16()
    return x, w


def gemm_model(x, w, residual=None, out_dtype=torch.bfloat16):
    """x · wᵀ [+ residual] in float64, rounded once."""
    y = x.double() @ w.double().t()
    if residual is not None:
        y = y + residual.double()
    return y.to(out_dtype)


def check_gemm(run, x, w, residual=None, out_dtype=torch.bfloat16, *, fp32_tol, out=None,
               **kw):
    """`run(x, w, residual, out=out, **kw)` wrote every element of a poisoned `out` (it did not
    fall back) and agrees with `gemm_model`: within `fp32_tol` for fp32 output, the bf16
    tolerances otherwise."""
    if out is None:
        out = poisoned(x.shape[0], w.shape[0], dtype=out_dtype)
    y = run(x, w, residual, out=out, **kw)
    assert y is out, "the kernel did not run (fallback)"
    assert_written(out)
    ref = gemm_model(x, w, residual, out_dtype)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, ref, **fp32_tol)
    else:
        torch.testing.assert_close(out.float(), ref.float(), **TOL["bf16"])
        assert rel_err(out, ref) < TOL["bf16_rel_norm"]
    return out
