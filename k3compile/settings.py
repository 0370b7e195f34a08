"""Every `K3_*` switch, in one place: the per-compile backend `Options` and the per-process
kernel settings, one parser and one rule for booleans.

    torch.compile(model, backend="k3", options={...})   ->  Options.make(options)  (env fills gaps)
    settings.KERNELS.pdl, .gemv_fused, ...               ->  read by the kernels at each call

Booleans: `1 true yes on` are true, `0 false no off` (and unset or empty) are false, anything
else is an error naming the variable. No other module reads `os.environ` for a `K3_*` switch
(tests/engine/test_layout.py checks it); README's "Switches" table lists `SWITCHES` (tested).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GEMV_VARIANTS = ("norm", "situ", "gate", "split")
GEMV_DEFAULT = frozenset({"norm", "situ", "gate", "split"})
GEMM_TC_VARIANTS = ("split", "situ", "norm")
GEMM_TC_DEFAULT = frozenset({"split", "situ"})  # norm loses on the H200 (docs/decisions.md)
ALLREDUCE_ALGORITHMS = ("one_shot", "two_shot", "nccl")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

# name -> (what it sets, default as a user writes it): the README's table is checked against this
SWITCHES: dict[str, tuple[str, str]] = {
    "K3_VERIFY": ("option `verify`: check every rewrite numerically at compile time", "0"),
    "K3_STRICT": ("option `strict`: a fusion-contract shortfall raises", "0"),
    "K3_FUSE_ALL": ("option `fuse_without_kernels`: on CUDA also fuse ops without a kernel", "0"),
    "K3_SIDE_STREAMS": ("option `side_streams`: shared experts and prefetch on side streams", "1"),
    "K3_PACK_WEIGHTS": ("option `pack_weights`: each fused group's weights in one buffer", "1"),
    "K3_STACK_INPUTS": ("option `stack_inputs`: a packed expert stack is one graph input", "1"),
    "K3_WEIGHT_VIEWS": (("option `weight_views`: a weight cut from a flat storage "
                         "(`flat.narrow().view()`) is read as a graph input of its own"), "1"),
    "K3_WEIGHT_CAST": (("option `weight_cast`: an fp32 weight read only through a cast to bf16 / "
                        "fp16 (autocast) is read as a copy in that dtype (a write through "
                        "`param.data` is not seen)"), "0"),
    "K3_EXECUTOR": ("option `executor`: `inductor` or `aten`", "inductor"),
    "K3_SHARD_MOE": ("option `shard_moe`: `auto`, `on` or `off`", "auto"),
    "K3_VALIDATE": ("option `validate`: input checks `auto`, `host`, `device` or `off`", "auto"),
    "K3_SDPA_MATH": (("option `sdpa_math`: on CUDA trace SDPA through its math path, so the "
                      "canonical rules see the attention (`0`: the device's fused SDPA op)"), "1"),
    "K3_PDL": ("kernels: programmatic dependent launch", "1"),
    "K3_PDL_MAX_ROWS": ("kernels: PDL only for launches of at most this many rows", "16"),
    "K3_GEMM_TC_LATE_TRIGGER": (("kernels: with PDL, gemm_tc lets the next kernel launch once "
                                 "its K loops are done (`1`), or does so for weights of at "
                                 "least this many MB (a number); `0`: at its start"), "20"),
    "K3_FRONT_ROUTE": (("option `front_route`: moe_front + moe_route as one op (CUDA: with "
                        "K3_KERNELS_EXTRA=moe_front_route)"), "0"),
    "K3_GEMV_FUSED": ("kernels: gemv's one-launch variants (`norm,situ,gate,split`, `all`, `0`)",
                      "norm,situ,gate,split"),
    "K3_GEMM_TC_FUSED": (("kernels: gemm_tc's one-launch variants at 3-32 rows (gemv's at 1-2; "
                          "`split,situ,norm`, `all`, `0`)"), "split,situ"),
    "K3_MOE_GROUPED": (("kernels: `moe_experts` by expert on tensor cores at 8-64 rows (`1`), or "
                        "from this many rows (a number, e.g. `64`); `0`: never"), "0"),
    "K3_MOE_F16": (("kernels: `moe_experts` decodes into packed fp16 math (fma.rn.f16x2): `auto` "
                    "at buckets of 16 rows and more, `1` at every bucket, `0` never"), "auto"),
    "K3_MOE_BY_EXPERT": (("kernels: `moe_experts` FC1 by expert on CUDA cores with the fp16 "
                          "decode (each weight word decoded once per 2 routed tokens), up to "
                          "64 rows; slower than the per-pair kernels on the H100 (session 30)"),
                         "0"),
    "K3_KDA_FB": (("kernels: `fb_kda_decode` in one launch (the KDA kernel computes the f_b "
                   "projection itself) at buckets of at least N requests: `1` every bucket, `0` "
                   "never (the f_b GEMM, then the KDA kernel)"), "0"),
    "K3_CHECK_KERNEL": (("kernels: the device-side input check and redirect (`validate=device` on "
                         "CUDA) as one CuTe kernel launch per step (`0`: Inductor's 1-5 "
                         "kernels)"), "1"),
    "K3_KERNELS_EXTRA": (("kernels: also register these opt-in kernel modules (slower than the "
                          "default on the H200: moe_front_route, oproj_mix, moe_one_launch; no "
                          "faster: mla_q_absorb; docs/decisions.md)"), ""),
    "K3_KERNELS_SKIP": ("kernels: leave these kernels unregistered (their sites go to Inductor)",
                        ""),
    "K3_ALLREDUCE": ("kernels: force the TP all-reduce (`one_shot`, `two_shot`, `nccl`)", ""),
    "K3_BUILD_WORKERS": (("kernels: worker processes that build a bucket's CuTe kernels at once "
                          "(needs K3_CACHE_DIR; `0`: one by one; `auto`: this rank's share of "
                          "the cores, less one; 0 where the share is 1 core; CUDA steps "
                          "only)"), "auto"),
    "K3_QUIET": ("no compile progress on stderr (buckets, stages, kernels built)", "0"),
    "K3_STAGE_CACHE": ("option `stage_cache`: each bucket's stage output cached under "
                       "K3_CACHE_DIR", "1"),
    "K3_SKIP_AOT": ("option `skip_aot`: a stage-cache hit by Dynamo's graph skips AOTAutograd "
                    "where its runtime wrappers do nothing", "1"),
    "K3_CACHE_DIR": ("the on-disk cache of compiled kernels, traced patterns and stage outputs "
                     "(`0`: none)",
                     "~/.cache/k3compile"),
    "K3_COLLECTIVE_TIMEOUT": ("tests: seconds the multi-process collective test waits", "150"),
    "K3_MOONSHOT_DIR": ("`k3compile.adapt`: folder holding Moonshot's modeling files", ""),
    "K3_DIFFSUITE": ("tests: `full` runs every differential-suite cell (`bounded`: a few)",
                     "bounded"),
}


def env(name: str) -> str | None:
    """The raw value of a registered switch (None: unset)."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a k3 switch (k3compile.settings.SWITCHES)")
    return os.environ.get(name)


def parse_bool(name: str, value: str | None) -> bool | None:
    """None when unset; the one rule for booleans otherwise."""
    if value is None:
        return None
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: expected one of {_TRUE + _FALSE[:-1]}")


def env_bool(name: str) -> bool | None:
    """A boolean switch; None where it is unset or empty (the default applies)."""
    value = env(name)
    return None if value is None or not value.strip() else parse_bool(name, value)


def env_list(name: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in (env(name) or "").split(",") if n.strip())


def parse_variants(name: str, value: str | None, variants: tuple[str, ...],
                   default: frozenset[str]) -> frozenset[str]:
    """A list of a kernel's one-launch variants: unset -> `default`; `1`/`all` every variant;
    `0` none; else names."""
    if value is None:
        return default
    v = value.strip().lower()
    if v == "all" or v in _TRUE:
        return frozenset(variants)
    if v in _FALSE:
        return frozenset()
    names = frozenset(v.strip() for v in value.split(",") if v.strip())
    if unknown := names - set(variants):
        raise ValueError(f"{name}: unknown variants {sorted(unknown)} (of {variants})")
    return names


def parse_gemv_fused(value: str | None) -> frozenset[str]:
    """K3_GEMV_FUSED: unset -> the default; `1`/`all` every variant; `0` none; else names."""
    return parse_variants("K3_GEMV_FUSED", value, GEMV_VARIANTS, GEMV_DEFAULT)


def parse_gemm_tc_fused(value: str | None) -> frozenset[str]:
    """K3_GEMM_TC_FUSED: as K3_GEMV_FUSED, over gemm_tc's variants (`split`, `situ`, `norm`)."""
    return parse_variants("K3_GEMM_TC_FUSED", value, GEMM_TC_VARIANTS, GEMM_TC_DEFAULT)


def parse_cache_dir(value: str | None) -> str | None:
    """K3_CACHE_DIR: unset or empty -> $XDG_CACHE_HOME/k3compile (else ~/.cache/k3compile);
    `0 false no off` -> None (no on-disk cache); anything else is the folder."""
    v = (value or "").strip()
    if v.lower() in _FALSE[:-1]:
        return None
    if v:
        return os.path.abspath(os.path.expanduser(v))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "k3compile")


def parse_auto_bool(name: str, value: str | None) -> bool | None:
    """A boolean switch that also takes `auto` (None, as unset or empty)."""
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    return parse_bool(name, value)


def parse_min_rows(name: str, value: str | None) -> int:
    """A switch on from a bucket of N requests: unset, empty or a false word -> 0 (never); a
    true word -> 1 (every bucket); else N >= 1."""
    v = (value or "").strip().lower()
    if not v or v in _TRUE or v in _FALSE:
        return int(bool(parse_bool(name, v or "0")))
    if not v.isdigit():
        raise ValueError(f"{name}={value!r}: expected a boolean or a number of requests")
    return int(v)


def parse_late_trigger(value: str | None) -> float | None:
    """K3_GEMM_TC_LATE_TRIGGER: unset or empty -> its default (20 MB: session 33's A/B); a
    false word (`0`) -> None (never); a true word (`1`) -> 0.0 (every launch); any other number
    -> weights of at least that many MB."""
    v = (value or "").strip().lower() or SWITCHES["K3_GEMM_TC_LATE_TRIGGER"][1]
    if v in _TRUE or v in _FALSE:
        return 0.0 if parse_bool("K3_GEMM_TC_LATE_TRIGGER", v) else None
    try:
        mb = float(v)
    except ValueError:
        raise ValueError(f"K3_GEMM_TC_LATE_TRIGGER={value!r}: expected a boolean or a size in "
                         "MB") from None
    if not mb >= 0:
        raise ValueError(f"K3_GEMM_TC_LATE_TRIGGER={value!r}: a size in MB must be >= 0")
    return mb


def parse_workers(value: str | None) -> int:
    """K3_BUILD_WORKERS: unset or empty -> `auto` (the H200, 2026-12-04: the yardstick's 8
    buckets cold 89.3 s with 15 workers; B1 33.9 -> 29.3 s, B8 12.8 -> 6.5 s against one by one);
    `auto` -> this rank's share of the cores
    this process may run on (shared by the ranks of this host, LOCAL_WORLD_SIZE as torchrun sets
    it: each rank starts its own pool), less one for the process itself: at least 1, and 0 (one
    by one, no pool) where the share is under 2 cores (there a worker would build on the core its
    waiting rank would build on, after its start: ~9 s of imports); else a count >= 0."""
    v = (value or "").strip() or "auto"
    if v == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")
        ranks = int(local) if local.isdigit() and int(local) > 0 else 1
        share = (cores or 1) // ranks
        return share - 1 if share >= 2 else 0
    if not v.isdigit():
        raise ValueError(f"K3_BUILD_WORKERS={value!r}: expected a number of processes, or `auto` "
                         f"(0: none)")
    return int(v)


# ---- per compile ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Options:
    """Backend options: `torch.compile(model, backend="k3", options={...})` or environment."""

    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    strict: bool = False  # a fusion-contract shortfall raises instead of warning
    verify: bool = False  # check every rewrite numerically at compile time (K3_VERIFY=1)
    cuda_graphs: bool = True  # capture each bucket in a CUDA graph (GPU only)
    disabled_patterns: frozenset[str] = frozenset()  # names or name prefixes
    disabled_stages: frozenset[str] = frozenset()
    disabled_rules: frozenset[str] = frozenset()  # canonical-form rules (k3compile.canonical)
    scratch_slot: int | None = None  # state slot for padding rows; inferred when None
    # The observer keeps each stage's graph text (the diff tool asks for it). Off by default: a
    # printed graph is O(nodes) per stage, ~4 s a stage (CPU, profiled) for the second spelling's
    # 22k-node graph; TORCH_LOGS=k3_graphs / TORCH_TRACE print their own where asked.
    keep_graphs: bool = False
    # What runs the graph the patterns leave: "inductor" (default), or "aten": the fused ATen
    # graph op by op, no codegen (CPU tests: Inductor's C++ build costs ~30 s per bucket there).
    executor: str = "inductor"
    # L2 bytes the `prefetch` stage budgets from (None: the GPU's own; on CPU an H200's 60 MB)
    l2_bytes: int | None = None
    # Prefetch also before side-stream joins. Off: on the H200 at world size 1 the join hides
    # almost nothing and the prefetch's own read cost more (docs/decisions.md).
    prefetch_on_join: bool = False
    # On CUDA, fuse also the ops that have no GPU kernel yet (they then run their torch reference
    # op by op: correct, slower than Inductor on the unfused graph). K3_FUSE_ALL=1.
    fuse_without_kernels: bool = False
    # under tensor parallelism, all-gather a fingerprint of each rank's compiled graph and fail
    # on a mismatch (stage `ranks`)
    check_ranks: bool = True
    # Stage `shard` (TP > 1): "auto" shards a replicated MoE projection only where the weight
    # bytes it saves per rank outweigh the all-gather it adds; "on" every one it can; "off" none.
    shard_moe: str = "auto"
    # Side streams (stage `streams`: the shared experts; stage `prefetch`: beside fused
    # collectives). K3_SIDE_STREAMS=1|0.
    side_streams: bool = True
    # Stage `pack`: each fused group's weights moved once into one buffer, the parameters views
    # of it, so no concatenated copy exists. K3_PACK_WEIGHTS=0 turns it off.
    pack_weights: bool = True
    # Stage `stack_inputs` (after `pack`): an expert stack whose parts lie back to back in one
    # buffer is one input of the graph the executor compiles, not one per expert.
    # K3_STACK_INPUTS=0 turns it off.
    stack_inputs: bool = True
    # Stage `weight_views` (first before the stage cache's key): a weight the graph cuts out of a
    # flat storage by views (FSDP's FlatParameter: `flat.narrow(0, a, n).view(N, K)`) is a graph
    # input of its own, handed by the wrapper as a view of the flat storage (never a copy).
    # K3_WEIGHT_VIEWS=0 turns it off.
    weight_views: bool = True
    # Stage `weight_cast` (before the stage cache's key): a weight kept in fp32 and read only
    # through a cast to bf16 / fp16 (torch.autocast) is read as a copy in that dtype, made once
    # and made again by the wrapper where the weight's address or version changed. Off: a write
    # through `param.data` (`param.data.copy_(t)`) bumps no version, so the copy would miss it
    # (docs/decisions.md, session 32). K3_WEIGHT_CAST=1 turns it on.
    weight_cast: bool = False
    # The step's input checks (k3compile/validate.py): "auto" (on the host for CPU inputs, inside
    # the step for CUDA ones), "host", "device" (also on CPU: the tests) or "off". K3_VALIDATE.
    validate: str = "auto"
    # Each bucket's stage output on disk (k3compile/stage_cache.py, under K3_CACHE_DIR): a second
    # process compiling the same graph loads it. K3_STAGE_CACHE=0 runs every stage every time.
    stage_cache: bool = True
    # With the stage cache: a bucket whose Dynamo graph and inputs a link entry knows loads the
    # stages' graph without AOTAutograd's lowering, where AOTAutograd's runtime wrappers were
    # found to do nothing for it (k3compile/stage_cache.py). K3_SKIP_AOT=0: AOTAutograd always.
    skip_aot: bool = True
    # Pattern `moe_front_route`: the MoE front's logits feeding the routing become one op
    # (exact on CPU). Off: the op changes the graph that stages pack, streams and shard read,
    # which know moe_front; on CUDA its kernel also needs K3_KERNELS_EXTRA=moe_front_route until
    # the H200 validates it. K3_FRONT_ROUTE=1.
    front_route: bool = False
    # On CUDA, AOT traces F.scaled_dot_product_attention to the device's fused op (efficient,
    # flash or cuDNN attention), opaque to every rule: the MLA of a spelling written with SDPA
    # (spell6) fused on the CPU and not on a GPU (session 26, H100). The trace selects SDPA's
    # math path, as on the CPU, so rule `sdpa_math` sees it; where no rule takes the attention
    # the graph keeps that math (Inductor fuses it, not into one kernel). K3_SDPA_MATH=0.
    sdpa_math: bool = True

    @classmethod
    def make(cls, options: dict[str, Any] | None = None) -> Options:
        opts = dict(options or {})
        unknown = set(opts) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown k3 backend options {sorted(unknown)}")
        for key, var in (("verify", "K3_VERIFY"), ("strict", "K3_STRICT"),
                         ("fuse_without_kernels", "K3_FUSE_ALL"),
                         ("side_streams", "K3_SIDE_STREAMS"),
                         ("pack_weights", "K3_PACK_WEIGHTS"),
                         ("stack_inputs", "K3_STACK_INPUTS"),
                         ("weight_views", "K3_WEIGHT_VIEWS"),
                         ("weight_cast", "K3_WEIGHT_CAST"),
                         ("stage_cache", "K3_STAGE_CACHE"), ("skip_aot", "K3_SKIP_AOT"),
                         ("front_route", "K3_FRONT_ROUTE"), ("sdpa_math", "K3_SDPA_MATH")):
            if (value := env_bool(var)) is not None:
                opts.setdefault(key, value)
        for key, var in (("executor", "K3_EXECUTOR"), ("shard_moe", "K3_SHARD_MOE"),
                         ("validate", "K3_VALIDATE")):
            if env(var):
                opts.setdefault(key, env(var))
        for key in ("disabled_patterns", "disabled_stages", "disabled_rules"):
            if key in opts:
                opts[key] = frozenset(opts[key])
        if "buckets" in opts:
            buckets = tuple(sorted(set(int(b) for b in opts["buckets"])))
            if not buckets or buckets[0] < 1:
                raise ValueError(f"buckets must be positive batch sizes, got {opts['buckets']}")
            opts["buckets"] = buckets
        if opts.get("shard_moe", "auto") not in ("auto", "on", "off"):
            raise ValueError(f"shard_moe must be 'auto', 'on' or 'off', got {opts['shard_moe']!r}")
        if opts.get("validate", "auto") not in ("auto", "host", "device", "off"):
            raise ValueError(f"validate must be 'auto', 'host', 'device' or 'off', got "
                             f"{opts['validate']!r}")
        if opts.get("executor", "inductor") not in ("inductor", "aten"):
            raise ValueError(f"executor must be 'inductor' or 'aten', got {opts['executor']!r}")
        return cls(**opts)

    def pattern_enabled(self, name: str) -> bool:
        if name.startswith("moe_front_route") and not self.front_route:
            return False
        return not any(name == d or name.startswith(d) for d in self.disabled_patterns)


# ---- per process (the kernels) -------------------------------------------------------------------

@dataclasses.dataclass
class KernelSettings:
    """What picks the CUDA kernels and their builds in this process. Read once from the
    environment into `KERNELS`; kernels read its fields at each call (tests and benchmarks set
    them with monkeypatch)."""

    pdl: bool = True
    pdl_max_rows: int = 16
    gemv_fused: frozenset[str] = GEMV_DEFAULT
    gemm_tc_fused: frozenset[str] = GEMM_TC_DEFAULT  # the composites' variants at 3-32 rows
    # PDL: gemm_tc's dependents launch after its K loops for weights of >= this many MB (None:
    # never, at its start)
    gemm_tc_late_trigger_mb: float | None = 20.0
    extra: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    allreduce: str | None = None
    cache_dir: str | None = None  # kernels/common/disk_cache.py, k3compile/rewrite/trace_cache.py
    # moe_experts by expert from this many rows, within 8-64 (kernels/moe_experts.py `grouped`);
    # 0 / False: never, 1 / True: 8-64
    moe_grouped: int = 0
    # moe_experts' packed fp16 decode; None: `auto` (kernels/moe_experts.py, `f16_decode`)
    moe_f16: bool | None = None
    moe_by_expert: bool = False  # moe_experts FC1 by expert, fp16 decode (kernels/moe_experts.py)
    # fb_kda_decode's one-launch build at buckets of at least this many requests; 0: never
    # (kernels/fb_kda_decode.py)
    kda_fb: int = 0
    check_kernel: bool = True  # validate's device check as one launch (kernels/input_check.py)
    build_workers: int = 0  # a bucket's kernels built by a pool (kernels/common/build_pool.py);
    # from_env's default is `auto` (parse_workers)

    @classmethod
    def from_env(cls) -> KernelSettings:
        pdl = env_bool("K3_PDL")
        rows = env("K3_PDL_MAX_ROWS")
        allreduce = env("K3_ALLREDUCE") or None
        if allreduce is not None and allreduce not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"K3_ALLREDUCE={allreduce!r}: expected one of {ALLREDUCE_ALGORITHMS}")
        return cls(pdl=True if pdl is None else pdl,
                   pdl_max_rows=int(rows) if rows else 16,
                   gemv_fused=parse_gemv_fused(env("K3_GEMV_FUSED")),
                   gemm_tc_fused=parse_gemm_tc_fused(env("K3_GEMM_TC_FUSED")),
                   gemm_tc_late_trigger_mb=parse_late_trigger(env("K3_GEMM_TC_LATE_TRIGGER")),
                   extra=env_list("K3_KERNELS_EXTRA"), skip=env_list("K3_KERNELS_SKIP"),
                   allreduce=allreduce, cache_dir=parse_cache_dir(env("K3_CACHE_DIR")),
                   moe_grouped=parse_min_rows("K3_MOE_GROUPED", env("K3_MOE_GROUPED")),
                   moe_f16=parse_auto_bool("K3_MOE_F16", env("K3_MOE_F16")),
                   moe_by_expert=bool(env_bool("K3_MOE_BY_EXPERT")),
                   kda_fb=parse_min_rows("K3_KDA_FB", env("K3_KDA_FB")),
                   check_kernel=env_bool("K3_CHECK_KERNEL") is not False,
                   build_workers=parse_workers(env("K3_BUILD_WORKERS")))

    def fingerprint(self) -> list[str]:
        """Tensor-parallel ranks must agree on all of it (stage `ranks`)."""
        return [f"pdl {self.pdl} rows<={self.pdl_max_rows}",
                f"gemv_fused {sorted(self.gemv_fused)}",
                f"gemm_tc_fused {sorted(self.gemm_tc_fused)}",
                f"gemm_tc_late_trigger_mb {self.gemm_tc_late_trigger_mb}",
                f"extra {list(self.extra)}",
                f"skip {list(self.skip)}", f"allreduce {self.allreduce}",
                f"moe_grouped {self.moe_grouped}", f"moe_f16 {self.moe_f16}",
                f"moe_by_expert {self.moe_by_expert}",
                f"kda_fb {self.kda_fb}"]  # not check_kernel: it changes no stage output and
        # no collective (each rank checks its own inputs), so stage caches need not split on it


KERNELS = KernelSettings.from_env()


def quiet() -> bool:
    """K3_QUIET=1: the backend shows no compile progress (read at each compile)."""
    return bool(env_bool("K3_QUIET"))


def fingerprint(options: Options) -> str:
    """One digest of the compile options and the process's kernel settings."""
    text = repr(sorted(dataclasses.asdict(options).items())) + repr(KERNELS.fingerprint())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def torch_env(name: str) -> str | None:
    """A variable torch itself reads (e.g. TORCH_LOGS, whose k3 names k3compile.logs registers)."""
    return os.environ.get(name)


def torch_env_default(name: str, value: str) -> None:
    """Set a torch environment variable unless the user did (e.g. symmetric memory's
    TORCH_SYMM_MEM_DISABLE_MULTICAST, which the collectives need off on lent machines)."""
    os.environ.setdefault(name, value)


def color_wanted() -> bool:
    """The https://no-color.org convention: colour unless NO_COLOR is set."""
    return "NO_COLOR" not in os.environ
