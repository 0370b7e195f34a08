"""Host-side plumbing shared by the kernels (pure Python; `cutlass` is imported only on use).

* `have_dsl()` / `have_tvm_ffi()`: what this machine can do. Kernels compile with the DSL alone;
  launching them from torch goes through TVM-FFI (`apache-tvm-ffi`), whose ~8 us host path takes
  torch tensors directly and checks them against the compiled signature.
* `bucket(n)`: the batch bucket (1, 2, 4, ..., 64) whose launch config a row count uses.
* `CompileCache`: `cute.compile` is slow and not thread-safe, so every kernel keeps one
  in-process cache keyed by scalars (dtype, sizes, config), through `launch.Kernel`; below it
  `disk_cache` keeps the compiled kernels across processes.
* `compile_kernel(host, *args, arch=)`: `cute.compile` with `compile_options(arch)`.
* `watch_builds(listener)`: tells `listener(name, seconds)` of every `cute.compile` while open
  (the backend's progress display counts kernel builds so; this layer knows nothing of it).
* `fallback(op, reason)`: the one place that logs why a CUDA call went to the torch reference
  (`launch.Kernel.run` calls it) and counts it (`fallback_counts()`, shown by `summary()`).
* `pdl_enabled(rows)` (settings.KERNELS.pdl / .pdl_max_rows), `pdl_launch_dependents(on)`,
  `pdl_wait(on)`: programmatic dependent launch between our kernels (below).
* `flat_rows(fn)`, `on_stream(fn)`: what wraps a kernel function into an op's CUDA implementation
  (`register_kernel("k3::op", "cuda", on_stream(flat_rows(op_cuda)))`): [B, T, D] activations as
  rows, and the op's `stream` argument (k3compile.ops.side_streams).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator

import torch

from k3compile.ops.side_streams import on_stream  # noqa: F401  (re-exported: the kernels' wrappers)
from k3compile.settings import KERNELS

log = logging.getLogger("k3compile.kernels")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WARP = 32

# Programmatic dependent launch (PDL): a kernel launched with it may start while the previous
# kernel in the stream is still running; `griddepcontrol.wait` then blocks until that kernel has
# completed and its writes are visible. So a decode step's weight streams start during the small
# kernels before them, and launch gaps hide. The rule every kernel with PDL keeps: weights (graph
# inputs nothing writes during a step) may load before `pdl_wait`; activations, states and every
# store only after it, and every CTA waits before it exits (so a later kernel's wait covers the
# earlier kernels too). Each kernel compiles it in as a constant (`pdl` in its compile key: both
# builds coexist; without it the build is the plain one). On by default since the H200 yardstick
# of 2026-11-29 (B1 118.4 -> 106.1 us per layer), for launches of at most PDL_MAX_ROWS rows
# (their bucket): at B64 it cost time in every A/B (634 and 645 vs 624; 640.9 vs 609.8 in
# session 6), at B8 it was not decided. Since session 33 (H100, three machine starts) up to 16 rows,
# with gemm_tc's trigger after its K loops for weights of >= 20 MB (K3_GEMM_TC_LATE_TRIGGER):
# B8 -4 to -7%, B16 -3 to -5%, B64 +3% (so not there). K3_PDL=0 turns it off for the
# process, K3_PDL_MAX_ROWS=64 on at every bucket.


@functools.cache
def have_dsl() -> bool:
    try:
        import cutlass.cute  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # also a broken CUDA-library install
        return False
    return True


@functools.cache
def have_tvm_ffi() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def pdl_enabled(rows: int = 1) -> bool:
    """Whether a kernel launched for `rows` rows (its bucket) compiles and launches with PDL now
    (read at every call: tests flip `settings.KERNELS.pdl` and `.pdl_max_rows`). Kernels with and without PDL mix
    safely in one stream: a PDL launch waits for its predecessor either way."""
    return KERNELS.pdl and rows <= KERNELS.pdl_max_rows


def pdl_launch_dependents(on: bool) -> None:
    """Device code: the next kernel in the stream may start launching (nothing without PDL). A
    hint only; its CTAs take SM slots once every CTA of this grid has issued it or exited."""
    if on:
        from cutlass import cute

        cute.arch.griddepcontrol_launch_dependents()


def pdl_wait(on: bool) -> None:
    """Device code: wait until the previous kernel has completed and flushed (nothing without
    PDL). Every thread that reads activations or stores anything executes it first."""
    if on:
        from cutlass import cute

        cute.arch.griddepcontrol_wait()


def bucket(n_rows: int) -> int:
    """Smallest bucket holding n_rows; rows beyond the last bucket use its config."""
    return next((b for b in BUCKETS if n_rows <= b), BUCKETS[-1])


def pick_threads(n_vec: int, max_vec_per_thread: int, max_threads: int = 1024) -> tuple[int, int]:
    """(threads, vectors per thread) for one row of n_vec vectors: whole warps, at most
    max_vec_per_thread vectors each; an exact split (no predicates) is preferred when one exists."""
    for v in range(max_vec_per_thread, 0, -1):
        t = n_vec // v
        if n_vec % v == 0 and t % WARP == 0 and t <= max_threads:
            return t, v
    t = -(-n_vec // max_vec_per_thread)
    t = min(max_threads, max(WARP, -(-t // WARP) * WARP))
    return t, -(-n_vec // t)


class CompileCache:
    """key (scalars only) -> compiled kernel. One lock: cute.compile is not thread-safe."""

    _lock = threading.Lock()

    def __init__(self, name: str):
        self.name = name
        self._entries: dict[Hashable, object] = {}

    def get(self, key: Hashable, build: Callable[[], object]):
        entry = self._entries.get(key)
        if entry is None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is None:
                    log.debug("compiling %s %s", self.name, key)
                    entry = self._entries[key] = build()
        return entry

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


BuildListener = Callable[[str, float], None]
_build_listeners: list[BuildListener] = []


@contextlib.contextmanager
def watch_builds(listener: BuildListener) -> Iterator[BuildListener]:
    """Call `listener(kernel name, seconds)` after every kernel build (`compile_kernel`) of this
    process while the block is open."""
    _build_listeners.append(listener)
    try:
        yield listener
    finally:
        _build_listeners.remove(listener)


def compile_kernel(host, *args, arch: str | None = None, dump_dir: str | None = None):
    """cute.compile with the options every kernel uses. `arch` (e.g. "sm_90a") overrides the
    target, as CUTE_DSL_ARCH does; with neither, a machine without a GPU silently targets sm_100a.
    `dump_dir` keeps the cubin and the PTX there (see `cubin_of`, `ptx_of`); nothing is written
    otherwise."""
    from cutlass import cute

    t0 = time.perf_counter()
    compiled = cute.compile(host, *args, options=compile_options(arch, dump_dir))
    name = getattr(host, "__name__", None) or type(host).__name__
    for listener in _build_listeners:
        listener(name, time.perf_counter() - t0)
    return compiled


def compile_options(arch: str | None = None, dump_dir: str | None = None) -> str:
    """The `cute.compile` options of every kernel (part of the disk cache's key)."""
    options = ["--enable-tvm-ffi"] if have_tvm_ffi() else []
    if arch:
        options.append(f"--gpu-arch={arch}")
    if dump_dir:
        options += ["--keep-cubin", "--keep-ptx", f"--dump-dir={dump_dir}"]
    return " ".join(options)


def fake_stream():
    from cutlass.cute.runtime import make_fake_stream

    return make_fake_stream(use_tvm_ffi_env_stream=have_tvm_ffi())


def fake_rows(dtype, n_rows, dim: int, row_stride=None):
    """Compile-time stand-in for an [n_rows, dim] tensor: last dim contiguous, 16-byte-aligned base,
    row stride `row_stride` (an int) or a runtime value divisible by 16 bytes (None)."""
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_tensor

    if row_stride is None:
        row_stride = cute.sym_int64(divisibility=128 // dtype.width)
    return make_fake_tensor(dtype, (n_rows, dim), stride=(row_stride, 1), assumed_align=16)


def fake_vector(dtype, dim: int):
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, (dim,), stride=(1,), assumed_align=16)


def cubin_of(compiled) -> bytes | None:
    """The device binary of a compile made with a `dump_dir`."""
    cubin = getattr(getattr(compiled, "artifacts", None), "CUBIN", None)
    return cubin.encode("latin-1") if isinstance(cubin, str) else cubin


def ptx_of(compiled) -> str | None:
    """The PTX of a compile made with a `dump_dir`."""
    return getattr(getattr(compiled, "artifacts", None), "PTX", None)


_fallbacks: Counter[tuple[str, str]] = Counter()  # (op, reason) -> calls that ran the reference


def fallback(op: str, reason: str) -> None:
    """Count a CUDA call of `op` that runs the torch reference instead, and log it (a warning
    once per distinct reason, debug after)."""
    _fallbacks[op, reason] += 1
    if _fallbacks[op, reason] == 1:
        log.warning("k3::%s: CuTe kernel refused (%s); running the torch reference", op, reason)
    else:
        log.debug("k3::%s: fallback (%s)", op, reason)


def fallback_counts() -> dict[tuple[str, str], int]:
    """(op, reason) -> how many calls of this process ran the torch reference for that reason.
    Counted where the choice is made, in Python: a CUDA-graph replay repeats its capture's
    launches without passing here, so a captured fallback counts once per capture."""
    return dict(_fallbacks)


def reset_fallback_counts() -> None:
    """Forget the counts (and log the next fallback of each reason as a warning again)."""
    _fallbacks.clear()


def runtime_refusal() -> str | None:
    """Why no kernel can launch on this machine at all, or None."""
    if not have_dsl():
        return "nvidia-cutlass-dsl is not importable"
    if not have_tvm_ffi():
        return "apache-tvm-ffi is not installed (kernels launch through TVM-FFI)"
    if not have_cuda():
        return "no CUDA device"  # the DSL and TVM-FFI alone compile and export (CI's CPU)
    return None


@functools.cache
def have_cuda() -> bool:
    return torch.cuda.is_available()


def aligned16(*tensors) -> bool:
    return unaligned16(*tensors) is None


def unaligned16(*tensors) -> str | None:
    """"data not 16-byte aligned", naming the first such tensor (its position among `tensors`,
    dtype, shape, strides and the start's offset from 16 bytes), or None where all are aligned:
    the reason a fallback logs, so the log says which tensor of which call."""
    for i, t in enumerate(tensors):
        if t.data_ptr() % 16:
            return (f"data not 16-byte aligned: tensor {i} {t.dtype} {tuple(t.shape)} "
                    f"strides {t.stride()} starts {t.data_ptr() % 16} B past 16")
    return None


def rows_ok(t, dim: int, dtype) -> str | None:
    """Refusal reason for a row tensor the kernels read as [rows, dim] with a free row stride.
    Metadata only (fake tensors work); data alignment is checked at launch (`aligned16`)."""
    if t.dtype != dtype:
        return f"dtype {t.dtype} (want {dtype})"
    if t.dim() != 2 or t.shape[-1] != dim:
        return f"shape {tuple(t.shape)} (want [N, {dim}])"
    if t.stride(-1) != 1 or t.stride(0) % (16 // t.element_size()) != 0:
        return f"strides {t.stride()} (last dim contiguous, rows 16-byte aligned)"
    return None


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Per-kernel registers and stack frame (spills, local arrays) read from a cubin's .nv.info.

    The attributes are (format, id, payload); id 0x2f = register count, 0x11 = frame bytes, each
    payload (symbol index, value). Returns the maxima over the kernels in the cubin."""
    import struct

    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
               for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {"regs": 0, "frame": 0}
    for name_off, _, _, _, off, size, *_ in headers:
        name = cubin[names_at + name_off:cubin.index(b"\0", names_at + name_off)]
        if name != b".nv.info":
            continue
        i = off
        while i < off + size:
            fmt, attr = cubin[i], cubin[i + 1]
            if fmt == 4:  # 2-byte length + payload
                n = struct.unpack_from("<H", cubin, i + 2)[0]
                key = {0x2F: "regs", 0x11: "frame"}.get(attr)
                if key and n == 8:
                    out[key] = max(out[key], struct.unpack_from("<I", cubin, i + 8)[0])
                i += 4 + n
            else:
                i += 4 if fmt == 3 else 2
    return out


def _flatten(t, lead: list):
    if isinstance(t, torch.Tensor) and t.dim() > 2:
        lead.append(t.shape[:-1])
        return t.reshape(-1, t.shape[-1])
    if isinstance(t, (list, tuple)):
        return type(t)(_flatten(x, lead) for x in t)
    return t


def flat_rows(fn):
    """Kernels take rows [N, D]; the model hands activations as [B, T, D]. Flatten every tensor
    argument of rank > 2 to rows (a view) and give the outputs the callers' leading dims back."""

    def unflatten(o, lead):
        if isinstance(o, torch.Tensor) and o.dim() == 2:
            return o.view(*lead, o.shape[-1])
        return o

    @functools.wraps(fn)
    def wrapper(*args):
        leads: list = []
        out = fn(*(_flatten(a, leads) for a in args))
        if not leads:
            return out
        lead = leads[0]
        if isinstance(out, tuple):
            return tuple(unflatten(o, lead) for o in out)
        return unflatten(out, lead)

    return wrapper


def flat_refusal(refusal):
    """A row kernel's refusal for its op's arguments (tensors or metas): [B, T, D] as the rows
    `flat_rows` hands the kernel. For the op registry."""

    @functools.wraps(refusal)
    def wrapper(*args):
        return refusal(*(_flatten(a, []) for a in args))

    return wrapper
