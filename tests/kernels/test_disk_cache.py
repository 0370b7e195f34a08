"""The on-disk kernel cache (kernels/common/disk_cache.py, K3_CACHE_DIR).

CPU (needs the DSL; kernels compiled for sm_90a, as the H200 runs them): a kernel compiled
through `launch.Kernel` is stored, and what is stored is the object the cold compile exports,
carrying its cubin; a fresh in-process cache (and, `slow`, a second process) then loads it
without compiling. Every corrupt or stale entry (flipped byte, truncated, empty, not an entry,
another format, another key, an object that does not link) is logged, rebuilt and rewritten,
never loaded. The key changes with each thing that changes the binary and not otherwise; the
source part follows the kernel's imports under kernels/. A failed or impossible write leaves no
entry; results that are not DSL functions pass through; K3_CACHE_DIR=0 stores nothing.
GPU (marked `gpu`): processes run one launch of every compiled kernel at a TP16 rank's shapes
on fixed inputs: cold (compiles and stores), warm (loads every kernel, compiles none) and warm
after one entry was corrupted (that one rebuilt): bitwise the same outputs each time.
"""

import dataclasses
import functools
import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass")

from k3compile.kernels import rms_norm
from k3compile.kernels.common import disk_cache, dsl, gemv
from k3compile.kernels.common.dsl import cubin_of, have_tvm_ffi
from k3compile.kernels.common.launch import Kernel

from k3compile import settings

pytestmark = pytest.mark.dsl

ROOT = Path(__file__).resolve().parents[2]
ARCH = "sm_90a"
DIM = 256
CFG = rms_norm.config(DIM, 1)
KEY = (DIM, CFG, ARCH, ("pdl", False))  # what Kernel.compiled keys this build by


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache folder and fresh counters for this test."""
    monkeypatch.setattr(settings.KERNELS, "cache_dir", str(tmp_path / "k3cache"))
    monkeypatch.setattr(disk_cache, "STATS", Counter())
    monkeypatch.setattr(disk_cache, "SECONDS", Counter())
    monkeypatch.setattr(disk_cache, "_unwritable", set())
    return tmp_path / "k3cache"


@pytest.fixture(params=["tvm_ffi", "c"])
def route(request, monkeypatch):
    """Both ways an entry is made and loaded: TVM-FFI's export (where apache-tvm-ffi is installed:
    the GPU machine, CI) and, without it, the DSL's object dump (forced here by hiding TVM-FFI)."""
    if request.param == "tvm_ffi" and not have_tvm_ffi():
        pytest.skip("apache-tvm-ffi is not installed")
    if request.param == "c":
        monkeypatch.setattr(dsl, "have_tvm_ffi", lambda: False)
        monkeypatch.setattr(disk_cache, "have_tvm_ffi", lambda: False)
    return request.param


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """One cold compile of rms_norm at DIM for sm_90a, with its cubin kept."""
    dump = tmp_path_factory.mktemp("dump")
    compiled = rms_norm.build(DIM, CFG, arch=ARCH, pdl=False, dump_dir=str(dump))
    return compiled, cubin_of(compiled)


def counted(build, calls: list):
    """`build`, recording its calls (defined in build's module, as the key's source needs)."""
    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        calls.append(args)
        return build(*args, **kwargs)
    return wrapper


def key_text(key=KEY, arch=ARCH, module=rms_norm.__name__):
    return disk_cache.key_text("rms_norm", key, arch, module)


def exported(compiled) -> bytes:
    return disk_cache.export(compiled, disk_cache.symbol(key_text()))


def entries(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.k3kernel"))


def _env(cache: Path) -> dict:
    """A child process's environment: this cache folder, this process's import path."""
    return {**os.environ, "K3_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}


def loaded_type(route: str | None = None):
    tvm_ffi = have_tvm_ffi() if route is None else route == "tvm_ffi"
    return "Function" if tvm_ffi else "CudaDialectJitCompiledFunction"


# ---- store, then load instead of compiling -------------------------------------------------------

def test_a_kernel_is_stored_then_loaded_instead_of_compiled(cache_dir, cold, route):
    builds = []
    compiled = Kernel("rms_norm", counted(rms_norm.build, builds)).compiled(DIM, CFG, arch=ARCH,
                                                                            pdl=False)
    assert len(builds) == 1 and disk_cache.stats() == {"built": 1, "stored": 1}
    [entry] = entries(cache_dir)
    assert entry == disk_cache.entry_path(cache_dir / "kernels", "rms_norm", key_text())
    payload = disk_cache.read_entry(entry, key_text())
    assert payload == exported(compiled), "stored: what the cold compile exports"
    assert cold[1] in payload, "the stored object carries the cold compile's cubin"

    again = Kernel("rms_norm", counted(rms_norm.build, builds)).compiled(DIM, CFG, arch=ARCH,
                                                                         pdl=False)
    assert len(builds) == 1, "compiled again"
    assert disk_cache.stats() == {"built": 1, "stored": 1, "loaded": 1}
    assert set(disk_cache.seconds()) == {"build", "load"}
    assert type(again).__name__ == loaded_type(route)
    assert entries(cache_dir) == [entry], "no temporary file left behind"
    if route == "c":  # a JitCompiledFunction names its kernels; a tvm_ffi.Function not
        assert again.kernel_info == compiled.kernel_info


def test_kernels_loaded_in_one_process_stay_apart(cache_dir, route):
    """Each entry exports its own symbol: two kernels loaded together are each their own."""
    if route == "tvm_ffi":
        pytest.skip("a tvm_ffi.Function does not name its kernels")
    kernel, dims = Kernel("rms_norm", rms_norm.build), (DIM, 2 * DIM)
    cold = [kernel.compiled(d, rms_norm.config(d, 1), arch=ARCH, pdl=False) for d in dims]
    kernel = Kernel("rms_norm", rms_norm.build)
    warm = [kernel.compiled(d, rms_norm.config(d, 1), arch=ARCH, pdl=False) for d in dims]
    assert disk_cache.stats() == {"built": 2, "stored": 2, "loaded": 2}
    assert cold[0].kernel_info != cold[1].kernel_info
    assert [w.kernel_info for w in warm] == [c.kernel_info for c in cold]


WORKER = """
import json, sys
from k3compile.kernels import rms_norm
from k3compile.kernels.common import disk_cache
from k3compile.kernels.common.launch import Kernel

def never(*args, **kwargs):
    raise AssertionError("compiled again")

never.__module__ = rms_norm.__name__
got = Kernel("rms_norm", never).compiled({dim}, rms_norm.config({dim}, 1), arch="{arch}",
                                         pdl=False)
print(json.dumps({{"stats": disk_cache.stats(), "type": type(got).__name__}}))
"""


@pytest.mark.slow
def test_a_second_process_loads_without_compiling(cache_dir, cold):
    Kernel("rms_norm", rms_norm.build).compiled(DIM, CFG, arch=ARCH, pdl=False)
    run = subprocess.run([sys.executable, "-c", WORKER.format(dim=DIM, arch=ARCH)], cwd=ROOT,
                         env=_env(cache_dir), capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"stats": {"loaded": 1}, "type": loaded_type()}


# ---- corrupt and stale entries -------------------------------------------------------------------

def _flip(data: bytes) -> bytes:
    i = len(data) - 100
    return data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]


def _other_format(data: bytes) -> bytes:
    assert b'"format": 1' in data
    return data.replace(b'"format": 1', b'"format": 0', 1)


def _other_key(data: bytes) -> bytes:  # e.g. built by another DSL version, renamed by hand
    return data.replace(b"nvidia-cutlass-dsl==", b"nvidia-cutlass-dsl==0.", 1)


BAD = {"flipped_payload_byte": _flip, "truncated": lambda d: d[:len(d) // 2],
       "empty": lambda d: b"", "not_an_entry": lambda d: b"\x7fELF" + d[9:],
       "unreadable_header": lambda d: d[:20] + b"\xff" + d[21:],
       "other_format": _other_format, "other_key": _other_key}


@pytest.mark.parametrize("damage", BAD, ids=str)
def test_a_bad_entry_is_rebuilt_never_loaded(damage, cache_dir, cold, caplog):
    text, compiled = key_text(), cold[0]
    path = disk_cache.entry_path(cache_dir / "kernels", "rms_norm", text)
    disk_cache.store(path, text, compiled, "rms_norm")
    good = path.read_bytes()
    path.write_bytes(BAD[damage](good))
    builds = []
    with caplog.at_level(logging.WARNING, "k3compile.kernels"):
        got = disk_cache.fetch("rms_norm", KEY, lambda: builds.append(1) or compiled, arch=ARCH,
                               module=rms_norm.__name__)
    assert got is compiled and builds == [1], "a bad entry must not be loaded"
    assert "rebuilding" in caplog.text and str(path) in caplog.text
    assert disk_cache.stats() == {"stored": 2, "rebuilt": 1, "built": 1}
    assert disk_cache.read_entry(path, text) == exported(compiled), "the entry is written anew"
    assert list(disk_cache.build_seconds("rms_norm")) == [repr(KEY)], "with its build seconds"


def test_an_entry_whose_object_does_not_link_is_rebuilt(cache_dir, cold, caplog):
    """A whole entry with a valid checksum whose payload is no loadable object."""
    text, compiled = key_text(), cold[0]
    path = disk_cache.entry_path(cache_dir / "kernels", "rms_norm", text)
    disk_cache.write_entry(path, text, b"\x7fELF" + bytes(60))
    with caplog.at_level(logging.WARNING, "k3compile.kernels"):
        got = disk_cache.fetch("rms_norm", KEY, lambda: compiled, arch=ARCH,
                               module=rms_norm.__name__)
    assert got is compiled and "rebuilding" in caplog.text
    assert disk_cache.read_entry(path, text) == exported(compiled)


def test_read_entry_accepts_only_its_own_key(cache_dir, cold):
    text = key_text()
    path = disk_cache.entry_path(cache_dir / "kernels", "rms_norm", text)
    disk_cache.write_entry(path, text, b"payload")
    assert disk_cache.read_entry(path, text) == b"payload"
    with pytest.raises(disk_cache.BadEntry, match="another key"):
        disk_cache.read_entry(path, key_text(arch="sm_100a"))


# ---- writes --------------------------------------------------------------------------------------

def test_a_failed_write_leaves_no_entry(cache_dir, cold, monkeypatch, caplog):
    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(disk_cache.os, "replace", fail)
    with caplog.at_level(logging.WARNING, "k3compile.kernels"):
        got = disk_cache.fetch("rms_norm", KEY, lambda: cold[0], arch=ARCH,
                               module=rms_norm.__name__)
    assert got is cold[0] and "not cached" in caplog.text
    left = [p for p in cache_dir.rglob("*") if p.is_file() and p.suffix != ".lock"]
    assert left == [], "a partial file remained"
    assert disk_cache.stats() == {"built": 1, "unstored": 1}


def test_an_unwritable_folder_only_costs_the_cache(tmp_path, cold, monkeypatch, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(settings.KERNELS, "cache_dir", str(blocker))
    monkeypatch.setattr(disk_cache, "STATS", Counter())
    monkeypatch.setattr(disk_cache, "_unwritable", set())
    with caplog.at_level(logging.WARNING, "k3compile.kernels"):
        got = disk_cache.fetch("rms_norm", KEY, lambda: cold[0], arch=ARCH,
                               module=rms_norm.__name__)
    assert got is cold[0] and "not cached" in caplog.text
    assert blocker.read_text() == "not a folder"
    caplog.clear()
    with caplog.at_level(logging.WARNING, "k3compile.kernels"):
        disk_cache.fetch("rms_norm", KEY, lambda: cold[0], arch=ARCH, module=rms_norm.__name__)
    assert caplog.text == "", "the same reason is a warning once"
    assert disk_cache.stats() == {"built": 2, "unstored": 2}


def test_results_that_are_not_dsl_functions_pass_through(cache_dir):
    """As test_pdl's and test_gemv's stand-in builds return flags."""
    assert Kernel("rms_norm", lambda *_, pdl=False, **__: ("built", pdl)).compiled(
        DIM, CFG, pdl=True) == ("built", True)
    assert entries(cache_dir) == [] and disk_cache.stats() == {"built": 1, "unstored": 1}


def test_switched_off_nothing_is_read_or_written(cache_dir, cold, monkeypatch):
    disk_cache.store(disk_cache.entry_path(cache_dir / "kernels", "rms_norm", key_text()),
                     key_text(), cold[0], "rms_norm")
    monkeypatch.setattr(settings.KERNELS, "cache_dir", None)
    builds = []
    got = disk_cache.fetch("rms_norm", KEY, lambda: builds.append(1) or "built", arch=ARCH,
                           module=rms_norm.__name__)
    assert got == "built" and builds == [1] and disk_cache.root() is None
    assert len(entries(cache_dir)) == 1


def test_the_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert settings.parse_cache_dir(None) == str(tmp_path / "k3compile")
    assert settings.parse_cache_dir(" ") == str(tmp_path / "k3compile")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert settings.parse_cache_dir(None) == os.path.expanduser("~/.cache/k3compile")
    for off in ("0", "off", "False", "no"):
        assert settings.parse_cache_dir(off) is None
    assert settings.parse_cache_dir("~/k3") == os.path.expanduser("~/k3")
    assert settings.parse_cache_dir("rel") == os.path.join(os.getcwd(), "rel")
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "here"))
    assert settings.KernelSettings.from_env().cache_dir == str(tmp_path / "here")


# ---- the key -------------------------------------------------------------------------------------

def test_the_key_changes_with_everything_that_changes_the_binary(monkeypatch):
    base = key_text()
    assert key_text() == base, "not deterministic"
    other_cfg = dataclasses.replace(CFG, threads=2 * CFG.threads)
    changed = {"scalars": key_text((2 * DIM, CFG, ARCH, ("pdl", False))),
               "config": key_text((DIM, other_cfg, ARCH, ("pdl", False))),
               "pdl": key_text((DIM, CFG, ARCH, ("pdl", True))),
               "arch": key_text((DIM, CFG, "sm_100a", ("pdl", False)), arch="sm_100a"),
               "module": key_text(module=gemv.__name__)}
    tool = disk_cache.toolchain()
    for name, patch in [("dsl", {"dsl": ["nvidia-cutlass-dsl==4.9.0"]}),
                        ("tvm_ffi", {"tvm_ffi": "9.9"}), ("torch", {"torch": "9.9"}),
                        ("cuda", {"cuda": "99.9"}), ("host", {"host": "riscv"})]:
        monkeypatch.setattr(disk_cache, "toolchain", lambda p=patch: {**tool, **p})
        changed[name] = key_text()
    monkeypatch.setattr(disk_cache, "toolchain", lambda: tool)
    for name, attr, value in [("dsl_settings", "dsl_settings", lambda: "arch='sm_100a';"),
                              ("options", "compile_options", lambda arch: "--other"),
                              ("source", "source_digest", lambda module: "0" * 64)]:
        with monkeypatch.context() as m:
            m.setattr(disk_cache, attr, value)
            changed[name] = key_text()
    assert key_text() == base
    texts = [base, *changed.values()]
    assert None not in texts
    assert len(set(texts)) == len(texts), [n for n, t in changed.items() if t == base]
    paths = {disk_cache.entry_path(Path("/c"), "rms_norm", t) for t in texts}
    assert len(paths) == len(texts)


def test_no_key_for_a_repr_that_carries_an_address():
    assert key_text((DIM, object(), ARCH)) is None
    assert disk_cache.fetch("rms_norm", (object(),), lambda: "built", arch=None,
                            module=rms_norm.__name__) == "built"


def test_the_source_follows_the_kernels_imports():
    files = {str(p.relative_to(disk_cache.PACKAGE))
             for p in disk_cache._kernel_imports(Path(rms_norm.__file__).resolve())}
    assert {"rms_norm.py", "device/rms_norm.py", "common/dsl.py", "common/launch.py",
            "common/copy.py", "common/reduce.py", "common/disk_cache.py"} <= files
    assert not files & {"common/gemv.py", "device/gemv.py", "moe_experts.py"}, files


def test_an_edit_under_an_import_changes_the_source_and_elsewhere_not(tmp_path, monkeypatch):
    pkg = tmp_path / "kernels"
    for path, text in {
            "__init__.py": "", "common/__init__.py": "", "device/__init__.py": "",
            "op.py": "from .common.dsl import x\n\ndef build():\n    from .device.op import K\n",
            "device/op.py": "from ..common import reduce\nfrom ..op import build\n",
            "common/dsl.py": "x = 1\n", "common/reduce.py": "y = 1\n",
            "other.py": "z = 1\n"}.items():
        (pkg / path).parent.mkdir(parents=True, exist_ok=True)
        (pkg / path).write_text(text)
    monkeypatch.setattr(disk_cache, "PACKAGE", pkg.resolve())
    module = type(sys)("fake_kernel_op")
    module.__file__ = str(pkg / "op.py")
    monkeypatch.setitem(sys.modules, "fake_kernel_op", module)

    def digest():
        disk_cache.source_digest.cache_clear()
        return disk_cache.source_digest("fake_kernel_op")

    base = digest()
    (pkg / "other.py").write_text("z = 2\n")
    assert digest() == base, "a file the kernel does not import is not in its key"
    for path in ("common/reduce.py", "device/op.py", "common/dsl.py", "op.py"):
        (pkg / path).write_text((pkg / path).read_text() + "# edited\n")
        assert digest() != base, path
        base = digest()
    disk_cache.source_digest.cache_clear()


# ---- GPU: a second process runs every kernel from the cache --------------------------------------

def gpu_worker(out_path: str) -> None:
    """One launch of every compiled kernel at a TP16 rank's shapes on fixed inputs; saves the
    outputs and prints this process's cache counters and kernel fallbacks."""
    from k3compile.kernels import (
        attn_res_mix_norm,
        kda_decode,
        mla_decode,
        mla_lowrank_norm,
        moe_experts,
        moe_route,
        situ_gate_up,
    )
    from k3compile.kernels.common import dsl, gemm_tc, gemv

    from tests.fusions.test_attn_res_mix_norm_kernel import make_inputs as mix_inputs
    from tests.fusions.test_kda_decode_kernel import Inputs as KDAInputs
    from tests.fusions.test_mla_decode_kernel import Inputs as MLAInputs
    from tests.fusions.test_mla_lowrank_norm_kernel import make_inputs as lowrank_inputs
    from tests.fusions.test_moe_experts_kernel import make_experts, make_tokens

    gen = torch.Generator(device="cuda").manual_seed(1234)
    bf16 = functools.partial(torch.randn, generator=gen, device="cuda")
    x7168 = bf16(8, 7168).bfloat16()
    w768 = (bf16(768, 7168) * 7168 ** -0.5).bfloat16()
    out = {
        "rms_norm": rms_norm.rms_norm_cuda(bf16(2, 3584).bfloat16(),
                                           (1 + 0.2 * bf16(3584)).bfloat16(), 1e-5),
        "moe_route": moe_route.moe_route_cuda(bf16(2, 896) * 2, bf16(896) * 0.1, 16, 2.5),
        "mla_lowrank_norm": mla_lowrank_norm.mla_lowrank_norm_cuda(*lowrank_inputs(gen, 2),
                                                                   1e-6),
        "attn_res_mix_norm": attn_res_mix_norm.attn_res_mix_norm_cuda(
            **mix_inputs(gen, 2, 7168, 8, True)),
        "situ": situ_gate_up.situ_cuda(bf16(2, 768).bfloat16(), 4.0, 25.0),
        "gemv": gemv.gemv_cuda(x7168[:1], w768),
        "gemm_tc": gemm_tc.gemm_tc_cuda(x7168, w768),
    }
    kda = KDAInputs(gen, 2, 1)
    out["kda_decode"] = (kda_decode.kda_decode_cuda(*kda.args(kda.conv_state, kda.state)),
                         kda.conv_state, kda.state)
    mla = MLAInputs(gen, 2, 1)
    out["mla_decode"] = mla_decode.mla_decode_cuda(*mla.args(mla.cache))
    experts = make_experts(gen, 32, 3584, 192, "cuda")
    z, ids, w = make_tokens(gen, 2, 3584, 32, 16, "cuda")
    out["moe_experts"] = moe_experts.moe_experts_cuda(z, ids, w, *experts, 4.0, 25.0)
    torch.cuda.synchronize()
    torch.save({k: [t.cpu() for t in (v if isinstance(v, tuple) else (v,))]
                for k, v in out.items()}, out_path)
    print(json.dumps({"stats": disk_cache.stats(), "fallbacks": sorted(map(list, dsl.fallback_counts()))}))


def _run_gpu_worker(cache: Path, out: Path) -> dict:
    code = ("import sys; from tests.kernels.test_disk_cache import gpu_worker; "
            "gpu_worker(sys.argv[1])")
    run = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, env=_env(cache),
                         capture_output=True, text=True, timeout=540, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _assert_same_outputs(a: Path, b: Path) -> None:
    got, want = torch.load(b), torch.load(a)
    assert got.keys() == want.keys()
    for name in want:
        for g, w in zip(got[name], want[name], strict=True):
            assert torch.equal(g, w), f"{name}: a cached kernel computed different bits"


@pytest.mark.gpu
def test_a_second_process_runs_every_kernel_from_the_cache(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from k3compile.kernels.common.dsl import runtime_refusal

    if reason := runtime_refusal():
        pytest.skip(reason)
    cache = tmp_path / "k3cache"
    cold = _run_gpu_worker(cache, tmp_path / "cold.pt")
    stored = cold["stats"].get("stored", 0)
    assert cold["fallbacks"] == [], "a kernel did not run"
    assert cold["stats"] == {"built": stored, "stored": stored} and stored >= 11, cold
    warm = _run_gpu_worker(cache, tmp_path / "warm.pt")
    assert warm == {"stats": {"loaded": stored}, "fallbacks": []}
    _assert_same_outputs(tmp_path / "cold.pt", tmp_path / "warm.pt")

    victim = entries(cache)[len(entries(cache)) // 2]
    victim.write_bytes(_flip(victim.read_bytes()))
    mended = _run_gpu_worker(cache, tmp_path / "mended.pt")
    assert mended["stats"] == {"loaded": stored - 1, "rebuilt": 1, "built": 1, "stored": 1}
    _assert_same_outputs(tmp_path / "cold.pt", tmp_path / "mended.pt")
    assert _run_gpu_worker(cache, tmp_path / "again.pt")["stats"] == {"loaded": stored}
