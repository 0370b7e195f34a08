"""The compile pipeline: one ordered list of named stages over the functional ATen graph.

Inductor's own machinery lowers the Dynamo graph (functionalisation, decompositions, inference
only); `Pipeline.inner_compile` then receives the ATen graph, runs the stages, and hands what the
patterns left to Inductor (or, with executor "aten", runs it as it is).

    normalize -> canonicalize -> fuse -> verify -> writeback -> shard -> streams -> prefetch -> check -> ranks
    -> contract -> conv_layout -> pack -> stack_inputs

Before them, on every compile and before the stage cache's key (`BEFORE_KEY`), `weight_views`
reads the weights a flat storage holds (`flat.narrow(0, a, n).view(N, K)`) as inputs of their
own, `kernel_layout` reads [in, out] weights (Flax kernels, `x @ W`) as the [out, in] inputs the patterns want, and
`weight_cast` reads an fp32 weight that the graph reads only through a cast to bf16 / fp16
(`torch.autocast`) as a copy in that dtype; like `stack_inputs`, they change what the graph
takes, and the executor calls the graph through their wrappers.

Where the stage cache is on (`Options.stage_cache`, K3_CACHE_DIR; k3compile/stage_cache.py), a
stage "cache" first looks the graph up: a hit stands for every stage before `ranks`, whose
output a second process then loads; `ranks`, `contract`, `pack` and `stack_inputs` run on every
compile. `stack_inputs` changes the graph's inputs (an expert stack's parts -> one buffer): the
executor compiles the graph on its mapping of the inputs and calls it through its wrapper. A link
entry keyed by Dynamo's graph (`Options.skip_aot`) lets a second process skip AOTAutograd too:
the ATen graph is decoded from the stage key the link names and goes through the same stages,
and the executor gets it without AOTAutograd's runtime wrappers, which the first process found
to do nothing for that graph (`inductor.aot_wrappers`).

`STAGES` is every stage in its order; `stages(options)` is the list one compile runs, decided
once, here, as data: a stage is off where `Options.disabled_stages` names it or where the option
that switches it (`SWITCHED_BY`) is false. Stage functions never decide whether they run. Each
stage lives in `k3compile/stages/<module>.py` and is a plain `(gm, Context) -> gm` function.

An `Observer` wraps every stage: wall time, op histogram before/after, a printed copy of the graph,
and the rewrite report. The graph-diff tool and the fusion contract read what it records. A
`BucketProgress` (k3compile/progress.py) shows each bucket's compile and first run on stderr.
With K3_BUILD_WORKERS on CUDA the first run first runs the step in record mode on clones of the
inputs it writes (`written_inputs`) and has a pool of processes build the kernels it lacked
(kernels/common/build_pool.py); the real call then loads them from the disk cache.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import fx

from k3compile import stage_cache
from k3compile.layers import attribute, dynamo_input_paths, state_inputs
from k3compile.observe import Observer
from k3compile.progress import BucketProgress
from k3compile.read_guard import ReadGuard
from k3compile.rewrite import inductor, trace_cache
from k3compile.settings import KERNELS, Options
from k3compile.stages import Context
from k3compile.stages.canonicalize import canonicalize
from k3compile.stages.check import check
from k3compile.stages.contract import contract
from k3compile.stages.fuse import fuse, writeback
from k3compile.stages.kernel_layout import conv_layout, kernel_layout
from k3compile.stages.normalize import normalize
from k3compile.stages.pack import pack, remember
from k3compile.stages.prefetch import prefetch
from k3compile.stages.ranks import ranks
from k3compile.stages.shard import shard
from k3compile.stages.stack_inputs import stack_inputs
from k3compile.stages.streams import streams
from k3compile.stages.verify import verify
from k3compile.stages.weight_cast import hint as weight_cast_hint
from k3compile.stages.weight_cast import weight_cast
from k3compile.stages.weight_views import weight_views

log = logging.getLogger("k3compile")

Stage = Callable[[fx.GraphModule, Context], fx.GraphModule]

# Every stage, in order. `verify` checks what `fuse` made before anything builds on it (and may
# splice unfused code back, whose write-backs `writeback` then drops); `check` sees the final
# schedule; `ranks` before `contract`, so TP ranks agree before one may raise; `pack` last: it
# moves real weights, so only after every check has passed.
STAGES: list[tuple[str, Stage]] = [
    ("normalize", normalize),
    ("canonicalize", canonicalize),  # every spelling -> the one the patterns are written against
    ("fuse", fuse),
    ("verify", verify),
    ("writeback", writeback),
    ("shard", shard),
    ("streams", streams),
    ("prefetch", prefetch),
    ("check", check),
    ("ranks", ranks),
    ("contract", contract),
    ("conv_layout", conv_layout),  # weights a fused op reads permuted: re-laid by the first call
    ("pack", pack),
    ("stack_inputs", stack_inputs),  # after pack: the packed expert stacks as one input each
]

# Before the stage cache's key, on every compile (a hit included): they change what the graph
# takes (its inputs' layout, dtype), so the key is the graph they made; never on a graph decoded
# from a direct link (one is stored only where they took nothing).
BEFORE_KEY: list[tuple[str, Stage]] = [
    ("weight_views", weight_views),  # first: the weights a flat storage holds, as inputs
    ("kernel_layout", kernel_layout),
    ("weight_cast", weight_cast),  # after kernel_layout: it takes the cast of a Wᵀ as it is
]

# stage -> the boolean option that switches it on (the others always run unless disabled)
SWITCHED_BY: dict[str, str] = {
    "weight_views": "weight_views",  # K3_WEIGHT_VIEWS
    "weight_cast": "weight_cast",  # K3_WEIGHT_CAST
    "verify": "verify",  # K3_VERIFY
    "streams": "side_streams",  # K3_SIDE_STREAMS
    "ranks": "check_ranks",
    "conv_layout": "pack_weights",  # it moves weights, as pack does
    "pack": "pack_weights",  # K3_PACK_WEIGHTS
    "stack_inputs": "stack_inputs",  # K3_STACK_INPUTS
}


def stages(options: Options) -> list[tuple[str, Stage]]:
    """The stages a compile with `options` runs, in order."""
    unknown = set(options.disabled_stages) - {name for name, _ in BEFORE_KEY + STAGES}
    if unknown:
        raise ValueError(f"disabled_stages: unknown stages {sorted(unknown)} (the stages: "
                         f"{', '.join(name for name, _ in BEFORE_KEY + STAGES)})")
    return _on(STAGES, options)


def before_key(options: Options) -> list[tuple[str, Stage]]:
    """The `BEFORE_KEY` stages a compile with `options` runs, in order."""
    return _on(BEFORE_KEY, options)


def _on(listed: list[tuple[str, Stage]], options: Options) -> list[tuple[str, Stage]]:
    return [(name, fn) for name, fn in listed
            if name not in options.disabled_stages
            and getattr(options, SWITCHED_BY.get(name, ""), True)]


class Pipeline:
    """Runs the stages inside Inductor's compile (as its `inner_compile`) for one bucket."""

    def __init__(self, options: Options, observer: Observer):
        self.options = options
        self.observer = observer
        self.stages = stages(options)
        self.before_key = before_key(options)

    def run(self, gm: fx.GraphModule, ctx: Context, text: str | None = None) -> fx.GraphModule:
        """Every stage on gm, each under the observer; what they reported kept by bucket. The
        stages before `stage_cache.REPLAYED` are looked up in the stage cache first (stage
        "cache", where the cache is on): a hit stands for them, a miss runs them and stores
        their graph; the replayed stages run on every compile. `text`: gm's stage key, where a
        link gave it (gm was decoded from it)."""
        cached, replayed = stage_cache.split(self.stages)
        if text is None:  # a decoded graph (a direct link) was never rewritten: see `compile`
            for _, stage in self.before_key:
                gm = stage(gm, ctx)
            if not self.options.weight_cast:  # off by default: say where it would take weights
                weight_cast_hint(gm, ctx)
        if text is None and cached and self.options.stage_cache:
            text = stage_cache.key_text(gm, ctx, [name for name, _ in self.stages])
        path = stage_cache.path_of(text) if text is not None else None
        hit = None
        if path is not None:  # stage "cache": the lookup, and on a hit the stages' output

            def lookup(given: fx.GraphModule, _ctx: Context) -> fx.GraphModule:
                nonlocal hit
                hit = stage_cache.lookup(path, text, given, ctx.inputs)
                return given if hit is None else hit.gm

            gm = self.observer.run("cache", lookup, gm, ctx)
            ctx.stage_key = text
        if hit is not None:
            self.observer.records[ctx.batch] += hit.records  # what "cache" stood for
            ctx.report.merge(hit.report)
            ctx.notes.update(hit.notes)
            ctx.inputs_read = hit.reads
        else:
            given = gm = stage_cache.complete(gm)  # a decoded graph's values, for the stages
            for name, stage in cached:
                gm = self.observer.run(name, stage, gm, ctx)
            gm.meta.setdefault("inputs_read", set()).update(given.meta.get("inputs_read", ()))
            ctx.inputs_read = frozenset(gm.meta["inputs_read"])
            if path is not None:
                stored = stage_cache.store(path, text, gm, ctx.inputs,
                                           self.observer.records[ctx.batch][-len(cached):],
                                           ctx.report, ctx.notes)
                if stored and self.options.executor == "inductor":
                    # Inductor gets the graph a later process loads: its FX graph cache key
                    # (the GraphModule's code and class) is then the same there
                    gm = stage_cache.reloaded(path, text, given, ctx.inputs, gm)
        for name, stage in replayed:
            gm = self.observer.run(name, stage, gm, ctx)
        # The stages' real inputs (every weight) leave with them: Inductor's FX graph cache
        # pickles the GraphModule, meta included, and keys each tensor it meets by its values
        # (`tolist`): at one TP16 rank's 4 layers that took the B1 compile from 133 to 399 s.
        gm.meta.pop("real_inputs", None)
        self.observer.reports[ctx.batch] = ctx.report
        self.observer.notes[ctx.batch] = ctx.notes
        self.observer.graphs[ctx.batch] = gm.graph
        return gm

    def compile(self, gm: fx.GraphModule, example_inputs: list, batch: int | None,
                user_inputs: frozenset[int] = frozenset()) -> Callable:
        """`user_inputs`: the positions of the inputs the caller passes anew each step (ids,
        positions, slots), as opposed to the module's parameters and buffers."""
        ctx = Context(self.options, batch, inputs=list(example_inputs), user_inputs=user_inputs)
        cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
        if cuda:
            from k3compile.kernels import register_all

            register_all()  # CuTe DSL kernels replace the references on CUDA where the DSL is
        written: dict[str, frozenset[int] | None] = {}  # the inputs the step writes
        paths = dynamo_input_paths(gm)  # a functional model's layers are read off these
        cached, _ = stage_cache.split(self.stages)
        names = [name for name, _ in self.stages]
        link_text = (stage_cache.dynamo_key_text(gm, example_inputs, ctx, names)
                     if cached and self.options.stage_cache and self.options.skip_aot else None)
        link_path = stage_cache.path_of(link_text, "links") if link_text is not None else None
        link = stage_cache.link(link_path, link_text) if link_path is not None else None
        warm = _kernels_stored(link, link_path, link_text)
        prebuild = _prebuilder(written, cuda, warm)
        patches = {"emulate_precision_casts": True,  # see there: Inductor's pattern passes,
                   **inductor.GRAPH_PASSES_OFF, **inductor.INPUT_ASSERTS_OFF}  # its asserts off

        def inner_compile(aten_gm: fx.GraphModule, aten_inputs, **kwargs):
            import k3compile.ops  # noqa: F401  (the k3 ops must exist before patterns trace)

            why = (inductor.aot_wrappers(aten_gm, stage_cache.describe, example_inputs, kwargs)
                   if link_path is not None else None)
            written["inputs"] = written_inputs(aten_gm, len(example_inputs),
                                               inductor.written_inputs(len(example_inputs)))
            attribute(aten_gm.graph, paths)  # before the stage key, which holds module paths
            aten_gm = self.run(aten_gm, ctx)
            if ctx.viewed is not None:  # the executor's wrapper appends the views
                why = why or "stage weight_views reads views of flat inputs as inputs"
            if ctx.transposed is not None:  # Dynamo's inputs are not the graph's as they come
                why = why or "stage kernel_layout reads weights transposed"
            if ctx.weight_cast is not None:  # the executor's wrapper hands it the copies
                why = why or "stage weight_cast reads weights through copies"
            if ctx.permuted is not None:  # the executor's wrapper re-lays them at the first call
                why = why or "stage conv_layout re-lays weights"
            if link_path is not None and ctx.stage_key is not None:
                direct = None if why else {"bumps": inductor.graph_bumps(),
                                           **inductor.compile_kwargs(kwargs)}
                stage_cache.store_link(link_path, link_text, ctx.stage_key, direct, why)
            return self._executor(aten_gm, aten_inputs, kwargs, ctx)

        tagged = inductor.graph_cache_tagged(trace_cache.package_digest())
        if tagged is None:  # a key that cannot tell our ops' versions apart: no FX graph cache
            patches["fx_graph_cache"] = False
        progress = BucketProgress(self.observer, ctx, names)
        # AOTAutograd's cache stays off: its key is Dynamo's graph, without our options, and a
        # hit skips `inner_compile`, i.e. every stage (and `pack`, which moves the weights the
        # compiled graph expects packed). Inductor's FX graph cache (torch's default, or
        # TORCHINDUCTOR_FX_GRAPH_CACHE) serves what the stages made: its key is that graph.
        with (progress.compiling(), torch._functorch.config.patch(enable_autograd_cache=False),
              tagged or contextlib.nullcontext(), inference_only(example_inputs),
              sdpa_traced_as_math(cuda and self.options.sdpa_math)):
            if link is not None and link["direct"] is not None:
                fn = self._direct(link, ctx, example_inputs, patches, written)
            else:
                fn = inductor.compile_fx_static(gm, example_inputs, patches, inner_compile)
        around = (None if warm or link_path is None else  # keep the kernels the bucket used
                  lambda: _noting_kernels(link_path, link_text))
        run = progress.first_run(fn, prebuild, around)  # on a GPU the first run builds kernels
        # the inputs whose values the stages read, for the caller to check at every call (the
        # backend, before a CUDA graph's replay too: k3compile/read_guard.py)
        run.k3_read_guard = ReadGuard(guarded_reads(ctx.inputs_read, ctx.user_inputs,
                                                    written.get("inputs")), ctx.inputs)
        return run

    def _executor(self, aten_gm: fx.GraphModule, aten_inputs, kwargs, ctx: Context) -> Callable:
        remember(ctx.inputs)  # later compiles never move what this one was handed
        viewed = ctx.viewed  # views of flat inputs the graph takes as inputs of their own
        if viewed is not None:
            aten_inputs = viewed.inputs(aten_inputs)
            kwargs = {**kwargs, "static_input_idxs": viewed.static(kwargs.get("static_input_idxs"))}
        transposed = ctx.transposed  # [in, out] weights the graph reads as [out, in]
        if transposed is not None:
            aten_inputs = transposed.inputs(aten_inputs)
        cast = ctx.weight_cast  # fp32 weights the graph reads as their bf16 / fp16 copies
        if cast is not None:
            aten_inputs = cast.inputs(aten_inputs)
        stacked = ctx.notes.get("stack_inputs")
        if stacked is not None:  # the graph takes each packed expert stack as one input
            aten_inputs = stacked.inputs(aten_inputs)
            kwargs = {**kwargs, "static_input_idxs": stacked.static(kwargs.get("static_input_idxs"))}
        if self.options.executor == "inductor":
            inductor.register_fallbacks(aten_gm)
            fn = inductor.compile_fx_inner(aten_gm, aten_inputs, **kwargs)
        else:  # the graph as it is: side-stream ops name their stream in their calls
            fn = inductor.make_boxed_func(aten_gm.forward)
        fn = fn if stacked is None else stacked.wrap(fn)
        fn = fn if cast is None else cast.wrap(fn)
        fn = fn if transposed is None else transposed.wrap(fn)
        fn = fn if ctx.permuted is None else ctx.permuted.wrap(fn)
        return fn if viewed is None else viewed.wrap(fn)

    def _direct(self, link: dict, ctx: Context, example_inputs: list, patches: dict,
                written: dict) -> Callable:
        """The bucket without AOTAutograd: the ATen graph the link's stage key holds, on fake
        copies of Dynamo's inputs, through the stages (stage "cache" loads their output), then
        the executor, called as AOTAutograd's trivial wrappers would."""
        direct = link["direct"]
        with inductor.fake_inputs(example_inputs, patches) as fakes:
            aten_gm = stage_cache.aten_graph(link["aten"], fakes, link["aten_key"])
            written["inputs"] = written_inputs(aten_gm, len(example_inputs), [])
            aten_gm = self.run(aten_gm, ctx, link["aten"])
            remember(ctx.inputs)
            stage_cache.STATS["direct"] += 1
            stacked = ctx.notes.get("stack_inputs")
            if stacked is not None:  # as `_executor` does
                fakes = stacked.inputs(fakes)
                direct = {**direct, "static_input_idxs": stacked.static(direct["static_input_idxs"])}
            if self.options.executor == "inductor":
                compiled = inductor.compile_fx_inner_direct(aten_gm, fakes, direct)
            else:
                compiled = inductor.make_boxed_func(aten_gm.forward)
            if stacked is not None:
                compiled = stacked.wrap(compiled)
        return inductor.plain_call(compiled, direct["bumps"], boxed=True)


def guarded_reads(reads, user_inputs, written) -> frozenset[int]:
    """The inputs whose values the stages read that are tables, for `ReadGuard`: less the
    caller's own inputs and the state the step writes (rule mxfp4_dequant's constant folding
    records any small input it evaluates, a conv state of 2880 elements among them; a step
    that writes it changes it at every call). Where the written inputs are unknown, none."""
    if written is None:
        return frozenset()
    return frozenset(reads) - frozenset(user_inputs) - frozenset(written)


def written_inputs(aten_gm: fx.GraphModule, count: int,
                   by_aot: list[int] | None) -> frozenset[int] | None:
    """The positions of Dynamo's `count` inputs a step writes: the ATen graph's written
    placeholders (input mutations kept in the graph) and `by_aot` (what AOTAutograd found
    written; [] without it); None where the graph's inputs are not Dynamo's."""
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != count or by_aot is None:
        return None
    return frozenset(placeholders.index(n) for n in state_inputs(aten_gm.graph)) | set(by_aot)


def _prebuilder(written: dict, cuda: bool, warm: bool = False) -> Callable | None:
    """K3_BUILD_WORKERS: what the first run does first (`build_pool.prebuild`: a record run on
    clones of the inputs the step writes, then the missing kernels built by the pool, which
    starts now so its workers import the DSL while the stages run); None where it is 0, the
    step is not on CUDA (no kernel builds there) or `warm` (`_kernels_stored`)."""
    from k3compile.kernels.common import build_pool

    workers = KERNELS.build_workers
    if not workers or not cuda or warm:
        return None
    build_pool.start(workers)

    def prebuild(step: Callable, args, on_build, on_done) -> build_pool.Pooled:
        return build_pool.prebuild(step, args, written=written.get("inputs"), workers=workers,
                                   on_build=on_build, on_done=on_done)

    return prebuild


def _kernels_stored(link: dict | None, path, text: str | None) -> bool:
    """Whether an earlier process compiled this bucket whole (its link is direct) and every
    kernel its first run asked for is in the disk cache (a stat each). Then a record run and the
    pool's start would only cost (the H200, session 17: warm 24.1 s for 8 buckets with them,
    B1 10.0 s against 8.1 s without); a kernel list missing or a kernel missing (the kernel
    cache cleared, a new DSL) gets the record run and the pool, as a cold compile does."""
    if link is None or not link["direct"]:
        return False
    from k3compile.kernels.common import build_pool

    builds = stage_cache.stored_kernels(path, text)
    return builds is not None and not build_pool.missing(builds)


@contextlib.contextmanager
def _noting_kernels(path, text: str):
    """Open over a bucket's first run: the kernels it asks for, kept beside its link."""
    from k3compile.kernels.common import launch

    with launch.using() as builds:
        yield
    stage_cache.store_kernels(path, text, builds)


def sdpa_traced_as_math(on: bool) -> contextlib.AbstractContextManager:
    """AOT's trace with F.scaled_dot_product_attention decomposed by its math path, as on the CPU
    (Options.sdpa_math: on CUDA the device's fused SDPA op hides the attention from the rules)."""
    if not on:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def inference_only(example_inputs: list) -> contextlib.AbstractContextManager:
    """A decode step is compiled for inference. Called with grad mode on and parameters that
    require grad (a user's model not put under `torch.no_grad()` / `requires_grad_(False)`),
    AOTAutograd would build a training graph: its state writes leave the graph for a runtime
    epilogue, so no stage would see the model's state (no layer found, no input checked, nothing
    fused). Compiled under `no_grad` instead, with a warning: the step's outputs carry no
    autograd graph (using them in a backward raises; values are eager's)."""
    if not torch.is_grad_enabled() or not any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        return contextlib.nullcontext()
    log.warning("k3: grad mode is on and parameters require grad; the decode step is compiled "
                "for inference (its outputs carry no autograd graph). Call it under "
                "torch.no_grad() or set requires_grad_(False) to silence this.")
    return torch.no_grad()


__all__ = ["BEFORE_KEY", "STAGES", "SWITCHED_BY", "Context", "Pipeline", "Stage", "stages"]
