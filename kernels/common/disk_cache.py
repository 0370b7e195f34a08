"""Compiled kernels on disk, so a second process reuses every kernel the first one compiled.

    fetch(op, key, build, arch=, module=)   # a valid entry -> loaded; else build(), then stored
    lookup(op, key, arch=, module=)         # a valid entry -> loaded; else None (nothing built)
    build_seconds(op)                       # what building op's stored kernels took, by key

`cute.compile` keeps nothing on disk: every process paid the whole CuTe DSL compile again (on the
H200, most of the 104 s first compile of the yardstick's B1 bucket). `launch.Kernel.compiled`
asks `fetch` below its in-process cache.

Route: the DSL's own export. With TVM-FFI (how every kernel launches) the in-process compiled
function is already an object file linked by JITLink, whose `__tvm_ffi_<name>` symbol becomes a
`tvm_ffi.Function`; `export_to_c` writes that object (host launch code, launch config, PDL
attribute and the cubin inside, the entry symbol renamed to one per key), and
`cutlass.cute.runtime.load_module` links it again the same way. So the warm process runs the very
binary the cold one built, through public DSL API. The alternatives were weaker: a cubin plus a
launcher of ours (`cuModuleLoadData` + `cuLaunchKernelEx`) would re-implement the DSL's host code
(argument packing, cluster and PDL launch attributes, the TVM-FFI tensor checks) and drift from
it; a pickled JIT function holds an MLIR module and a live execution engine, which do not
pickle. Without TVM-FFI (a CPU machine with the DSL only) the object comes from
`dump_to_object` and loads as a `JitCompiledFunction`: nothing launches that way, but the cache
logic is the same there (CI tests it).

Key (the entry's file name is its sha256): the op and its compile key (scalars, arch, PDL,
build options), the sources of the kernel's module and of every `kernels/` module it imports,
transitively (`source_digest`), the `cute.compile` options, the DSL's distributions and its own
compile-affecting settings (`envar.cache_key_str()`: the target arch, detected or
CUTE_DSL_ARCH, the runtime libraries, line info, ...), the TVM-FFI, torch and CUDA versions and
the host machine. A compile key whose repr is not stable across processes is not stored.

Entry: one file `<K3_CACHE_DIR>/kernels/<op>/<sha256>.k3kernel` = MAGIC, a JSON header line
(format, the full key text, payload size and sha256, the seconds its build took), the object
file. Written to a temporary
file in the same folder and renamed (atomic: a reader sees a whole entry or none; concurrent
writers of one key each rename a whole entry). A miss is built under a file lock per entry
(`.<sha256>.lock` beside it, filelock, torch's own dependency): TP ranks compiling the same kernel
at once wait for the first and load its entry, and a bad entry is removed only by the lock's
holder, so never one another process just wrote. An entry that is unreadable, of another format
or key, fails its checksum or does not load is logged, removed and rebuilt, never used. Entries of
old keys are never looked up again; delete the folder to reclaim them.

Constraint: the loaded function takes positional arguments only (every kernel's launch passes
them so); a compiled kernel with keyword or default arguments or raw pointer arguments is not
stored.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path

from filelock import FileLock, Timeout

from k3compile.files import write_atomic
from k3compile.settings import KERNELS

from .dsl import compile_options, have_dsl, have_tvm_ffi, log

FORMAT = 1
MAGIC = b"K3KERNEL\n"
PACKAGE = Path(__file__).resolve().parent.parent  # kernels/
LOCK_SECONDS = 600.0  # longest wait for another process's build of one entry (then build too)
HISTORY = 64  # entries of an op whose build seconds `build_seconds` reads (the newest)

# what this process did: loaded, built, stored, rebuilt (bad entries), unstored (not storable);
# and the seconds it spent loading and building kernels
STATS: Counter[str] = Counter()
SECONDS: Counter[str] = Counter()


class BadEntry(Exception):
    """An entry that must not be loaded (corrupt, truncated, another format or key)."""


def root() -> Path | None:
    """The folder of compiled kernels (K3_CACHE_DIR/kernels), or None where the cache is off."""
    return Path(KERNELS.cache_dir) / "kernels" if KERNELS.cache_dir else None


def fetch(op: str, key: Hashable, build: Callable[[], object], *, arch: str | None,
          module: str) -> object:
    """The compiled kernel of `op` for `key`: loaded from a valid entry, else `build()` and stored
    for the next process. `module`: where `build` is defined (its sources are in the key).

    A miss builds under the entry's lock: processes compiling one kernel at once (TP ranks) wait
    for the first, then load what it stored, instead of each compiling it."""
    where = entry_of(op, key, arch, module)
    if where is None:
        return build()
    path, text = where
    if (compiled := _peek(path, text, op)) is not None:
        return compiled
    with entry_lock(path):
        try:
            if (compiled := _load(path, text, op)) is not None:
                return compiled  # stored by the process that held the lock
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is rebuilt
            log.warning("k3::%s: kernel cache entry %s unusable (%s: %s); rebuilding", op, path,
                        type(e).__name__, e)
            STATS["rebuilt"] += 1
            path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with _timed("build"):
            compiled = build()
        STATS["built"] += 1
        store(path, text, compiled, op, seconds=time.perf_counter() - t0)
        return compiled


def lookup(op: str, key: Hashable, *, arch: str | None, module: str) -> object | None:
    """The compiled kernel of a valid entry for `key`, else None (no cache, a key that is not
    stored, no entry, or a bad one: the next `fetch` judges it under the lock and rebuilds)."""
    where = entry_of(op, key, arch, module)
    return None if where is None else _peek(*where, op)


def entry_of(op: str, key: Hashable, arch: str | None, module: str) -> tuple[Path, str] | None:
    """(entry path, key text) of `key`, or None where the cache is off or the key not storable
    (then every process builds it)."""
    folder = root()
    text = key_text(op, key, arch, module) if folder is not None and have_dsl() else None
    return None if text is None else (entry_path(folder, op, text), text)


def _peek(path: Path, text: str, op: str) -> object | None:
    with contextlib.suppress(Exception):  # a bad entry is judged (and removed) under the lock
        return _load(path, text, op)
    return None


def _load(path: Path, text: str, op: str) -> object | None:
    """The kernel of the entry at `path` (None: no entry); raises where the entry is bad."""
    if not path.exists():
        return None
    with _timed("load"):
        compiled = load(read_entry(path, text), symbol(text))
    STATS["loaded"] += 1
    log.debug("k3::%s: loaded %s", op, path)
    return compiled


@contextlib.contextmanager
def entry_lock(path: Path, timeout: float | None = None):
    """Held while one process checks, builds and writes the entry at `path` (a file lock on
    `.<name>.lock` beside it; the OS drops it when its holder dies). Past `timeout` seconds
    (default LOCK_SECONDS), or where no lock file can be made (a read-only folder: `store` says
    so), the caller goes on without it: the write is atomic anyway, the lock only saves the
    duplicate compiles."""
    timeout = LOCK_SECONDS if timeout is None else timeout
    lock, held = FileLock(path.parent / f".{path.stem}.lock", timeout=timeout), False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        held = lock.acquire() is not None
    except Timeout:
        log.warning("k3: waited %.0f s for the lock of %s; building it here too", timeout, path)
    except OSError as e:
        log.debug("k3: building %s without its lock (%s: %s)", path.name, type(e).__name__, e)
    try:
        yield
    finally:
        if held:
            lock.release()


@contextlib.contextmanager
def _timed(what: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        SECONDS[what] += time.perf_counter() - t0


def store(path: Path, text: str, compiled, op: str, seconds: float | None = None) -> bool:
    """Write `compiled`'s entry, with the `seconds` its build took (False: not exportable, or
    the folder is not writable)."""
    try:
        payload = export(compiled, symbol(text))
        if payload is not None:
            write_entry(path, text, payload, seconds)
            STATS["stored"] += 1
            return True
    except Exception as e:  # noqa: BLE001 - a cache that cannot write only costs time
        why = f"{type(e).__name__}: {e}"
        log.log(logging.DEBUG if why in _unwritable else logging.WARNING,
                "k3::%s: kernel not cached (%s)", op, why)
        _unwritable.add(why)
    STATS["unstored"] += 1
    return False


_unwritable: set[str] = set()  # reasons already logged as warnings (a read-only folder: once)


# ---- key ---------------------------------------------------------------------------------------

def key_text(op: str, key: Hashable, arch: str | None, module: str) -> str | None:
    """Everything that changes the binary, as one JSON text; None where the key's repr is not
    stable across processes (an object's default repr carries its address) or `module` has no
    source file."""
    scalars, source = repr(key), source_digest(module)
    if " at 0x" in scalars or source is None:
        return None
    return json.dumps({"format": FORMAT, "op": op, "key": scalars, "arch": arch,
                       "source": source, "options": compile_options(arch),
                       "dsl_settings": dsl_settings(), **toolchain()}, sort_keys=True)


def entry_path(folder: Path, op: str, text: str) -> Path:
    return folder / op / f"{hashlib.sha256(text.encode()).hexdigest()}.k3kernel"


def symbol(text: str) -> str:
    """The exported entry symbol: one per key, so no two loaded kernels share a name."""
    return f"k3_{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def dsl_settings() -> str:
    """The DSL's compile-affecting settings (arch, runtime libraries, line info, debug...), as its
    own JIT cache key renders them. Read at every call: the DSL's settings object is mutable."""
    from cutlass.cutlass_dsl import CuTeDSL

    return CuTeDSL._get_dsl().envar.cache_key_str()


@functools.cache
def toolchain() -> dict[str, object]:
    """Versions of what builds and links the binary (the DSL's packages, also where they are
    only on the path without metadata), TVM-FFI, torch and CUDA, and the host's machine type."""
    from importlib.metadata import distributions

    import cutlass
    import torch

    dsl = sorted(f"{d.metadata['Name']}=={d.version}" for d in distributions()
                 if (d.metadata["Name"] or "").lower().startswith("nvidia-cutlass-dsl"))
    tvm_ffi = sys.modules["tvm_ffi"].__version__ if have_tvm_ffi() else None
    return {"dsl": [f"cutlass=={getattr(cutlass, '__version__', '?')}", *dsl],
            "tvm_ffi": tvm_ffi, "torch": torch.__version__, "cuda": torch.version.cuda,
            "host": platform.machine()}


@functools.cache
def source_digest(module: str) -> str | None:
    """sha256 over the source of `module` and of every module under kernels/ it imports,
    transitively (relative or `k3compile.kernels.` imports, at any depth of the file); None for
    a module without a source file."""
    source = getattr(sys.modules.get(module), "__file__", None)
    if not source or not source.endswith(".py"):
        return None
    files = _kernel_imports(Path(source).resolve())
    digest = hashlib.sha256()
    for path in sorted(files):
        name = path.relative_to(PACKAGE) if path.is_relative_to(PACKAGE) else path.name
        digest.update(f"{name}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _kernel_imports(start: Path) -> set[Path]:
    seen, todo = set(), [start]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += _direct_imports(path)
    return seen


@functools.cache
def _direct_imports(path: Path) -> list[Path]:
    """The files under kernels/ that `path` imports itself: each file is parsed once a process
    (the kernels' modules share most of their imports; parsing them again for every module was
    0.7 s of a warm process's first bucket on the H200)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _import_base(path, node)
            for name in [None] + [a.name for a in node.names]:
                out += _module_files(base, node.module, name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                out += _module_files(None, alias.name, None)
    return out


def _import_base(path: Path, node: ast.ImportFrom) -> Path | None:
    """The folder a relative import starts from (None: an absolute import)."""
    if not node.level:
        return None
    base = path.parent
    for _ in range(node.level - 1):
        base = base.parent
    return base


def _module_files(base: Path | None, module: str | None, name: str | None) -> list[Path]:
    """The file of `module` (and of `module.name`, where `name` is a submodule) under kernels/."""
    if base is None:
        prefix = "k3compile.kernels"
        if not module or not (module == prefix or module.startswith(prefix + ".")):
            return []
        base, module = PACKAGE, module[len(prefix) + 1:]
    parts = [p for p in (module or "").split(".") if p] + ([name] if name else [])
    target = base.joinpath(*parts)
    found = [f for f in (target.with_suffix(".py"), target / "__init__.py") if f.is_file()]
    return [f.resolve() for f in found if f.resolve().is_relative_to(PACKAGE)]


# ---- entries -----------------------------------------------------------------------------------

def flavour() -> str:
    return "tvm_ffi" if have_tvm_ffi() else "c"


def export(compiled, name: str) -> bytes | None:
    """The object file of a compiled kernel (None: not a DSL function, or not loadable as one)."""
    from cutlass.base_dsl.jit_executor import JitCompiledFunction

    if not isinstance(compiled, JitCompiledFunction):
        return None
    args = compiled.execution_args
    if args.has_pointer_address_arg_specs or any(
            p.default is not p.empty or p.kind is p.KEYWORD_ONLY
            for p in args.original_signature.parameters.values()):
        return None
    if flavour() == "c":
        _link_runtime()
        return compiled.dump_to_object(name)
    with tempfile.TemporaryDirectory(prefix="k3-export-") as tmp:
        out = os.path.join(tmp, "kernel.o")
        compiled.export_to_c(out, function_name=name)
        return Path(out).read_bytes()


@functools.cache
def _link_runtime() -> None:
    """Without TVM-FFI the DSL links the object it dumps against its runtime library in this
    process, which a compile for another arch than this machine's (no JIT engine) never loaded."""
    import ctypes

    from cutlass.runtime import find_runtime_libraries

    for path in find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def load(payload: bytes, name: str):
    """Link an exported object file again (the DSL's loader reads it from a path)."""
    from cutlass.cute.runtime import load_module

    fd, path = tempfile.mkstemp(prefix="k3-kernel-", suffix=".o")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        return load_module(path, enable_tvm_ffi=flavour() == "tvm_ffi")[name]
    finally:
        os.unlink(path)


def write_entry(path: Path, text: str, payload: bytes, seconds: float | None = None) -> None:
    header: dict[str, object] = {"format": FORMAT, "key": text, "size": len(payload),
                                 "sha256": hashlib.sha256(payload).hexdigest()}
    if seconds is not None:
        header["seconds"] = round(seconds, 3)
    line = json.dumps(header, sort_keys=True).encode()
    write_atomic(path, MAGIC + line + b"\n" + payload)


def read_entry(path: Path, text: str) -> bytes:
    """The payload of a whole, checked entry for this key text; BadEntry otherwise."""
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise BadEntry("not a k3 kernel entry")
    end = data.find(b"\n", len(MAGIC))
    try:
        header = json.loads(data[len(MAGIC):end])
    except ValueError as e:
        raise BadEntry(f"unreadable header ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise BadEntry(f"format {header.get('format') if isinstance(header, dict) else '?'}"
                       f" (this is {FORMAT})")
    if header.get("key") != text:
        raise BadEntry("built for another key (toolchain, source or scalars)")
    payload = data[end + 1:]
    if len(payload) != header.get("size") or (
            hashlib.sha256(payload).hexdigest() != header.get("sha256")):
        raise BadEntry("checksum mismatch")
    return payload


def build_seconds(op: str, newest: int = HISTORY) -> dict[str, float]:
    """The build seconds recorded in the newest `newest` entries of `op` (any toolchain, source or
    arch), by the repr of their compile key (`key_text`'s "key"); entries without them (stored
    before headers had them, or unreadable) are left out. `build_pool` orders its builds by them."""
    folder = root()
    if folder is None or not (folder / op).is_dir():
        return {}
    seen: dict[str, float] = {}
    for path in sorted((folder / op).glob("*.k3kernel"), key=_mtime, reverse=True)[:newest]:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            header = _header(path)
            if isinstance(seconds := header.get("seconds"), int | float):
                seen.setdefault(json.loads(header["key"])["key"], float(seconds))
    return seen


def _header(path: Path) -> dict:
    """An entry's header alone (its first line after MAGIC; the object file is not read)."""
    with path.open("rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a k3 kernel entry")
        return json.loads(f.readline())


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile (a bad entry, by its lock's holder)
        return 0.0


def stats() -> dict[str, int]:
    return dict(STATS)


def seconds() -> dict[str, float]:
    """Seconds this process spent building and loading kernels through the cache."""
    return dict(SECONDS)
