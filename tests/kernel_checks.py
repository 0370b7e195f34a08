"""Checks shared by the kernel tests; their tolerances are the one table's (tests/conftest.py:
bf16 outputs may differ from a float64 model of the same math by one bf16 rounding, 2^-8
relative, in a few elements; fp32 router weights by a few ulps, the exp approximation)."""

import contextlib

import pytest
import torch

from tests.conftest import TOL

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


def assert_cuda_op_equals_cpu(registered, op: str, args, states, flags=(), steps: int = 2,
                              tol: float = 2e-2) -> None:
    """k3::`op`'s CUDA kernel against its CPU reference, outputs and the mutated `states` (indices
    into args), over `steps` calls on the carried states. `registered` is the `cuda_kernels`
    fixture's list: without `register_all` a CUDA call runs the torch reference, uncounted, and
    the comparison would test nothing (sessions 23-28's KDA variant tests did that); a call that
    falls back to the reference fails too."""
    assert op in registered, f"no CUDA kernel registered for k3::{op}"
    fn = getattr(torch.ops.k3, op)
    cpu = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    for _ in range(steps):
        want = fn(*cpu, *flags)
        with no_fallback():
            got = fn(*cuda, *flags)
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
        for i in states:
            torch.testing.assert_close(cuda[i].cpu(), cpu[i], rtol=tol, atol=tol)


def kda_kernel_inputs(B, T, time_major=False, S=5):
    """k3::kda_decode's inputs at K3's head dim (bf16 activations, 2 heads, 4 taps), the conv
    state channel-major or time-major: the op's arguments up to its flags (one conv state
    buffer: None for the k and v conv states)."""
    from k3compile.kernels import kda_decode as kernel

    torch.manual_seed(0)
    H, K, taps = 2, kernel.HEAD_DIM, 4
    W = H * K
    bf = torch.bfloat16
    conv = torch.randn(S, taps - 1, 3 * W, dtype=bf) if time_major else \
        torch.randn(S, 3 * W, taps - 1, dtype=bf)
    return [*(torch.randn(B, T, W, dtype=bf) for _ in range(5)), torch.randn(B, T, H, dtype=bf),
            conv, torch.randn(S, H, K, K) * 0.1, torch.tensor([4, 0, 2][:B]),
            *(torch.randn(W, 1, taps, dtype=bf) for _ in range(3)),
            torch.randn(H, dtype=bf), torch.randn(W, dtype=bf), torch.randn(K, dtype=bf),
            -5.0, 1e-6, K**-0.5, 1e-5, None, None]


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
