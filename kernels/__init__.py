"""CuTe DSL kernels: `kernels/<op>.py` is the CUDA implementation of `k3.<op>`; the shared GEMM
engines, the launcher and the DSL helpers are in `kernels/common/`.

    register_all()   # plug every kernel in as its op's CUDA implementation, and into the op
                     # registry (k3compile.ops.registry) with its limits
    cuda_ops()       # the ops that run well on CUDA now (registry.cuda_ops())

Importing this package imports no `cutlass`: device code is compiled on first use, so the
refusals and the torch references work without the DSL. `register_all` registers the kernels
only where the DSL imports; a registered kernel that cannot take a call (inputs it refuses, or
no TVM-FFI to launch through) logs why and runs the reference.
"""

import importlib
import importlib.util

from k3compile import settings
from k3compile.ops import registry

# op names: kernels/<op>.py is the CUDA implementation of k3.<op>
KERNELS = ("attn_res_mix_norm", "mla_lowrank_norm", "rms_norm", "moe_route", "situ_gate_up",
           "oproj_attn_res_mix_norm", "allreduce_attn_res_mix_norm", "norm_linear", "moe_front",
           "linear_concat", "linear", "mla_uv_gate", "moe_experts", "kda_decode", "fb_kda_decode",
           "mla_decode")
# shared GEMM engines (kernels/common/) that K3_KERNELS_SKIP may also name: `gemm_tc` there keeps
# the GEMM router on cuBLAS above one row
ENGINES = ("gemm_tc",)

# ops whose torch reference is already what a GPU should run (stream and prefetch bookkeeping;
# linear_concat's one GEMM over the concatenated weights, whose module also registers it
# native): as fast on CUDA as the unfused graph under Inductor. Registered with or without the DSL.
NATIVE = ("linear_concat", "stream_fork", "stream_join", "prefetch_l2")

_registered: list[str] = []


def register_all() -> list[str]:
    """Register every kernel as the CUDA implementation of its op; returns the names registered
    (empty without the DSL). Idempotent."""
    from k3compile.kernels.common.dsl import have_dsl, log

    for op in NATIVE:
        registry.register_kernel(op, native=True)
    if not have_dsl():
        log.info("nvidia-cutlass-dsl not importable: k3 ops keep their torch references on CUDA")
        return []
    import k3compile.ops  # noqa: F401  (the ops must exist before kernels attach to them)

    for name in selected_kernels():
        if name not in _registered:
            importlib.import_module(f"{__name__}.{name}").register()
            _registered.append(name)
    return list(_registered)


def selected_kernels() -> list[str]:
    """The kernels this process registers where the DSL is present: KERNELS and
    K3_KERNELS_EXTRA's, less K3_KERNELS_SKIP's."""
    skip = skipped_kernels()
    return [n for n in KERNELS + extra_kernels() if n not in skip]


def extra_kernels() -> tuple[str, ...]:
    """Kernel modules not yet in KERNELS (written, awaiting their GPU tests) that
    `K3_KERNELS_EXTRA=name,name` registers too: a device call can then test a new kernel and
    measure its effect in the yardstick in one go. Its tests decide whether it joins KERNELS."""
    names = settings.KERNELS.extra
    for name in names:
        if importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise ValueError(f"K3_KERNELS_EXTRA: no kernel module {__name__}.{name}")
    return tuple(n for n in names if n not in KERNELS)


def skipped_kernels() -> tuple[str, ...]:
    """Kernels `K3_KERNELS_SKIP=name,name` leaves unregistered (their ops run the torch reference
    on CUDA and their patterns are deferred there): a kernel whose GPU test fails on a machine
    can be set aside without a code change, the rest of a run keeps going."""
    names = settings.KERNELS.skip
    if unknown := set(names) - set(KERNELS) - set(ENGINES) - set(extra_kernels()):
        raise ValueError(f"K3_KERNELS_SKIP: no kernel {sorted(unknown)} (of {KERNELS})")
    return names


def fingerprint() -> list[str]:
    """What picks the CUDA kernels and their configs in this process beyond the graph itself: the
    kernels registered (DSL present, K3_KERNELS_EXTRA / K3_KERNELS_SKIP), the PDL and gemv
    switches, the DSL version and the shipped tuning tables' digests (gemm_tc, gemv). Ranks must
    agree on all of it (`k3compile.stages.ranks` adds it to each rank's fingerprint): a replicated op
    computed by different kernels could round differently on different ranks."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    from k3compile.kernels.common import gemm_tc, gemv

    # the DSL by its package metadata: importing cutlass here would start its threads in every
    # rank process (a gloo worker aborted at exit with "terminate called without an active
    # exception" once it did)
    try:
        dsl_version = version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        dsl_version = None
    names = selected_kernels() if dsl_version else []
    tables = [f"{m.OP}_table " + (hashlib.sha256(m.TABLE.read_bytes()).hexdigest()[:12]
                                  if m.TABLE.exists() else "None") for m in (gemm_tc, gemv)]
    return [f"kernels {names}", *settings.KERNELS.fingerprint(), f"cutlass_dsl {dsl_version}",
            *tables]


def cuda_ops() -> frozenset[str]:
    """The k3 ops that run well on CUDA now: a registered kernel (or kernel composite) or a
    native reference (`registry.cuda_ops()` after `register_all`). The others run their torch
    reference there, op by op (many small launches, slower than Inductor's code for the unfused
    graph), so the backend leaves them unfused on CUDA unless told otherwise (option
    `fuse_without_kernels`)."""
    register_all()
    return registry.cuda_ops()
