"""Everything k3compile takes from `torch._inductor`, in one place, so a torch upgrade touches one
file: pattern tracing/matching (Inductor's pattern matcher) and the compile entry points."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable

import torch
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.pattern_matcher import (
    CallFunction,
    ExclusiveKeywordArg,
    FailedMatch,
    Ignored,
    KeywordArg,
    Match,
    MatchContext,
    MultiOutputPattern,
    PatternExpr,
    fwd_only,
    gen_pattern_and_search_gm,
    is_match,
    stable_topological_sort,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._ordered_set import OrderedSet


def fwd_only_fake(fn, args, *, get_decomp_fn=None):
    """`fwd_only` with fake tensors, for patterns whose ops cannot run eagerly (collectives)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, (get_decomp_fn or select_decomp_table)(), tracing_mode="fake")(*args)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


# Inductor's own pattern passes stay off in our compile: they run before our stages and change
# the graph the patterns look for, differently per torch version and device. torch 2.11's
# pointless_convert drops bf16 -> fp32 round trips (the model's roundings, so numerics too); on a
# GPU pad_mm rewrites unaligned mms into pad + mm + slice (measured on the H200, BENCHMARKS.md).
# Inductor's fusion and codegen are unaffected. Search graphs traced through the joint passes
# see the same config.
GRAPH_PASSES_OFF = {"pattern_matcher": False, "shape_padding": False}

# Inductor's per-input size/stride asserts stay out of the code it generates for us. They check
# again, on every call, what Dynamo's guards have checked already (each tensor input's sizes and
# strides); and torch 2.13 generates them in O(inputs^2) (`codegen_input_size_asserts` looks each
# input up in a list of names). A model whose experts are an `nn.ModuleList` hands the step one
# input per expert weight: at one TP16 rank's 4 layers, 21.6k inputs, ~30 s of its compile on
# the CPU and 21.6k asserts on each call outside a CUDA graph (docs/decisions.md, session 14).
INPUT_ASSERTS_OFF = {"size_asserts": False}


def graph_cache_tagged(tag: str):
    """A context under which Inductor's FX graph cache keys also hold `tag` (torch's
    `cache_key_tag`, after the user's own), or None where this torch has no such tag. The key
    holds the graph Inductor receives, our k3 ops by name; what an op's fake kernel says of its
    outputs (sizes, strides) is baked into the generated code, so the tag is the digest of the
    package that defines them: an edited op never reuses code generated for the old one."""
    config = torch.compiler.config
    if not hasattr(config, "cache_key_tag"):
        return None
    user = config.cache_key_tag
    return config.patch(cache_key_tag=f"{user}|k3:{tag}" if user else f"k3:{tag}")


def aot_wrappers(aten_gm: torch.fx.GraphModule, describe, inputs: list, kwargs: dict) -> str | None:
    """Why AOTAutograd's runtime wrappers around this ATen graph do more than call it with
    Dynamo's arguments and return its outputs, or None where they do nothing else: read, inside
    our `inner_compile`, off the `ViewAndMutationMeta` AOTAutograd left in the tracing context.
    Nothing else: an inference graph (grad off in the call), input mutations kept in the graph,
    no aliased outputs, no intermediate bases, no effect tokens, no subclasses, no functionalized
    RNG, no autocast, and the graph takes exactly Dynamo's inputs (no duplicate dropped, no
    synthetic base): `describe` of each placeholder's value equals that of each input (or the
    input is a size the graph does not read)."""
    from torch._functorch._aot_autograd.schemas import PlainTensorMeta

    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    checks = [
        (meta is not None, "no AOTAutograd metadata"),
        (kwargs.get("is_inference") is True, "not an inference graph"),
        (meta is None or meta.num_mutated_inp_runtime_indices == 0,
         "input mutations applied by the wrapper"),
        (meta is None or meta.num_outputs_aliased == 0, "aliased outputs"),
        (meta is None or meta.num_intermediate_bases == 0, "intermediate bases"),
        (meta is None or not meta.tokens, "effect tokens"),
        (meta is None or meta.grad_enabled_mutation is None, "a grad-mode change"),
        (meta is None or not meta.is_rng_op_functionalized, "functionalized RNG"),
        (meta is None or all(isinstance(m, (int, PlainTensorMeta))
                             for m in (*meta.subclass_inp_meta, *meta.subclass_fw_graph_out_meta)),
         "tensor subclasses"),
        (not torch._C._is_any_autocast_enabled(), "autocast"),
        (len(placeholders) == len(inputs) and all(
            describe(n.meta.get("val")) == describe(x) or (
                not isinstance(x, torch.Tensor) and n.meta.get("val") is None and not n.users)
            for n, x in zip(placeholders, inputs)),
         "the graph's inputs are not Dynamo's (deduplicated or a synthetic base)"),
    ]
    return next((why for ok, why in checks if not ok), None)


def written_inputs(count: int) -> list[int] | None:
    """The positions of the inputs AOTAutograd found written (in the graph or by its wrapper),
    read inside our `inner_compile`; None outside AOTAutograd or where its inputs are not the
    `count` Dynamo passed."""
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if meta is None or len(meta.input_info) != count:
        return None
    return [i for i, m in enumerate(meta.input_info) if m.mutates_data or m.mutates_metadata]


def graph_bumps() -> list[int]:
    """The inputs whose version counters AOTAutograd's wrapper bumps per call (mutated inside
    the graph, seen by autograd)."""
    meta = torch._guards.TracingContext.try_get().fw_metadata
    return list(meta.mutated_graph_handled_indices_seen_by_autograd)


def compile_kwargs(kwargs: dict) -> dict:
    """Inductor's `compile_fx_inner` arguments as data (for a compile without AOTAutograd)."""
    return {"static_input_idxs": list(kwargs.get("static_input_idxs") or ()),
            "cudagraphs": bool(getattr(kwargs.get("cudagraphs"), "value", False)),
            "graph_id": kwargs.get("graph_id"), "is_inference": True,
            "decomp": "get_decomp_fn" in kwargs}


def plain_call(graph_fn, bumps: list[int], boxed: bool):
    """What AOTAutograd's runtime wrapper does around an inference graph whose wrappers are
    trivial (`aot_wrappers`): grad off, the version bumps, the outputs as a list."""
    increment = torch.autograd.graph.increment_version

    def call(*args):
        if bumps:
            increment(tuple(args[i] for i in bumps))
        with torch.no_grad():
            outs = graph_fn(list(args)) if boxed else graph_fn(*args)
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]

    return call


def register_fallbacks(gm: torch.fx.GraphModule) -> None:
    """Inductor's fallback lowering for each custom op of the graph that has none yet, registered
    as Inductor's implicit fallback would (the op's layout tag, else its default). torch 2.11
    formats the line it logs at that point ("Creating implicit fallback for:" and the op's
    arguments as IR, each a deep tree printed through `textwrap.indent`) whether or not INFO is
    on: on the H200, ~55 s of the first bucket of every process for our 13 k3 ops (session 15's
    profile, BENCHMARKS.md); later buckets found the lowerings registered. torch 2.13 formats
    it lazily."""
    try:
        from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag, is_builtin
    except ImportError:  # a torch without them: Inductor's implicit fallback, as before
        return
    for node in gm.graph.nodes:
        op = node.target
        if (node.op == "call_function" and isinstance(op, torch._ops.OpOverload)
                and not is_builtin(op) and op not in lowerings):
            tag = get_layout_constraint_tag(op, with_default=True)
            make_fallback(op, layout_constraint=tag_to_layout_constraint(tag), warn=False)


def compile_fx_inner_direct(aten_gm: torch.fx.GraphModule, fakes: list, data: dict):
    """Inductor's `compile_fx_inner` on an ATen graph without AOTAutograd around it (inside
    `fake_inputs`), with the arguments `compile_kwargs` stored; a boxed callable."""
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.utils import BoxedBool

    register_fallbacks(aten_gm)
    output = next(n for n in reversed(aten_gm.graph.nodes) if n.op == "output")
    output.meta["user_visible_output_idxs"] = [
        i for i, a in enumerate(output.args[0]) if isinstance(a, torch.fx.Node)]
    # only where `compile_fx` passed it too: the FX graph cache hashes these arguments, and a
    # function's repr holds its address, so an argument the cold compile did not have (torch 2.11's
    # `compile_fx` passes no `get_decomp_fn`) missed the cache in every warm process (session 16)
    decomp = {"get_decomp_fn": select_decomp_table} if data.get("decomp", True) else {}
    return compile_fx_inner(
        aten_gm, fakes, static_input_idxs=data["static_input_idxs"],
        cudagraphs=BoxedBool(data["cudagraphs"]), graph_id=data["graph_id"],
        is_inference=True, boxed_forward_device_index=BoxedDeviceIndex(None), **decomp)


@contextlib.contextmanager
def fake_inputs(inputs: list, patches: dict):
    """Each tensor as a fake tensor of one new fake mode (static shapes), other values as they
    are, under what `compile_fx` sets around AOTAutograd and our `inner_compile`: a tracing
    context of that mode (not Dynamo's, whose fake tensors these must not meet), the mode as
    Inductor's, its config `patches` and functorch's two patches (torch 2.13)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # a shape env, though every size is static: Inductor's FX graph cache bypasses without one
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    # detached, as AOTAutograd hands an inference graph's inputs (Inductor's cache key holds it)
    fakes = [mode.from_tensor(x.detach(), static_shapes=True) if isinstance(x, torch.Tensor)
             else x for x in inputs]
    with (inductor_config.patch(patches), V.set_fake_mode(mode),
          torch._guards.tracing(torch._guards.TracingContext(mode)),
          functorch_config.patch(unlift_effect_tokens=True,
                                 selective_decompose=inductor_config.selective_decompose)):
        yield fakes


def compile_fx_static(gm: torch.fx.GraphModule, inputs: list, patches: dict | None = None,
                      inner_compile=compile_fx_inner):
    """`compile_fx` of a graph on these inputs with every size and int static, under a fake mode
    that has a shape env. The backend compiles a bucket at its first call, outside Dynamo's
    tracing context; there `compile_fx` makes a fake mode without a shape env, and Inductor's FX
    graph cache then bypasses ("No shape env"): a warm process could never load what a cold one
    compiled. `ignore_shape_env` keeps AOTAutograd from making the graph's ints and sizes
    symbols of that env. A torch without that argument compiles as before (no cache)."""
    patches = patches or {}
    if "ignore_shape_env" not in inspect.signature(compile_fx).parameters:
        return compile_fx(gm, inputs, inner_compile=inner_compile, config_patches=patches)
    with fake_inputs(inputs, patches) as fakes:
        return compile_fx(gm, fakes, inner_compile=inner_compile, config_patches=patches,
                          ignore_shape_env=True)


def fwd_only_joint(fn, args, *, get_decomp_fn=None):
    """`fwd_only_fake`, then Inductor's joint-graph passes: the search graph takes the form the
    model's graph has when our stages see it (e.g. the permute pairs of an einsum folded away)."""
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    gm = fwd_only_fake(fn, args, get_decomp_fn=get_decomp_fn)
    with inductor_config.patch(GRAPH_PASSES_OFF):  # as in our compile
        joint_graph_passes(gm)
    return gm


def _register_joint_patterns() -> None:
    """Inductor registers its joint-graph patterns on first use, per device, under a config patch
    that cannot nest in a compile's own (torch 2.11): our search graphs (device None) are traced
    inside a compile, so register them now, at import (~0.4 s)."""
    from torch._inductor.fx_passes.joint_graph import lazy_init

    lazy_init(None)


_register_joint_patterns()


def _each_op(expr, fn) -> None:
    """fn(p) on every op of a pattern tree (a multi-output pattern's outputs too), once each, an
    op before its arguments (fn may rewrite them or the op's class)."""
    seen = set()

    def visit(p):
        if id(p) in seen:
            return
        seen.add(id(p))
        if isinstance(p, CallFunction):
            fn(p)
            for a in (*p.args, *p.kwargs.values()):
                visit(a)
        for sub in getattr(p, "outputs", ()) or ():
            visit(sub)

    visit(expr)


def wildcard_strings(expr, names: dict[str, str]) -> None:
    """Replace string literals (sentinels traced in place of e.g. a process group's name) in a
    pattern tree by keyword args, so they match any string and are captured."""
    def wildcard(p):
        p.args = tuple(KeywordArg(names[a]) if isinstance(a, str) and a in names else a
                       for a in p.args)
        p.flat_args_kwargs = p.flatten(p.args, p.kwargs)

    _each_op(expr, wildcard)


_COMMUTATIVE = {torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor}


class _CommutativeCall(CallFunction):
    """A binary add/mul that also matches with its operands swapped (`h * w` and `w * h`, `a + b`
    and `b + a` are one op to the model's author, two graphs to a positional matcher). The
    written order is tried first; a failed try leaves no trace in the match context. Where both
    fail, the failure of the order that got further is reported (`_attempt`), so that the near
    miss names the node where the right order differs, not the wrong order's first operand."""

    def _match(self, node, ctx):
        if len(self.args) != 2:
            return super()._match(node, ctx)
        swapped = self.__dict__.get("_swapped")
        if swapped is None:
            swapped = self._swapped = CallFunction(self.fns, self.args[1], self.args[0],
                                                   _users=self.users, **self.kwargs)
            swapped._match_users = self._match_users  # the user check knows us, not the twin
        saved = dict(ctx.pattern_to_node), list(ctx.exclusive_node_set)
        tries = []
        for order in (self, swapped):
            _restore(ctx, saved)
            result, rank = _attempt(order, node, ctx, saved)
            if is_match(result):
                return result
            tries.append((rank, result))
        _restore(ctx, saved)
        return max(tries, key=lambda t: t[0])[1]


def _attempt(order: CallFunction, node, ctx, saved) -> tuple:
    """(result, rank) of one operand order of a commutative op; a failure's rank says how far
    it got. A user-count failure is checked against the structure first (the same order, user
    counts ignored): where the structure matches, only an intermediate's users differ (an escape,
    ranked first); where it does not, the user count was met at a node the pattern does not have
    there (the wrong order's operand: the outer product meeting the decayed state), and the
    structural failure stands for the order. Otherwise: pattern ops visited, then a mismatch at
    a node over one at a constant (the operands in the other order)."""
    result = CallFunction._match(order, node, ctx)
    if is_match(result):
        return result, None
    if _head(result) == "multiple_users":
        users = result
        _restore(ctx, saved)
        with users_ignored(ctx):
            result = CallFunction._match(order, node, ctx)
        if is_match(result):
            return users, (1, _visited(ctx, saved), 1)
    at_constant = _head(result) == "function_mismatch" and not isinstance(
        (getattr(result, "args", ()) or (None,))[0], torch.fx.Node)
    return result, (0, _visited(ctx, saved), 0 if at_constant else 1)


def _head(failure) -> str:
    return str(getattr(failure, "format_string", "")).split(" ")[0].split(":")[0]


def _visited(ctx, saved) -> int:
    """The pattern ops met since `saved` (matched or not)."""
    return sum(1 for p in ctx.pattern_to_node if p not in saved[0] and isinstance(p, CallFunction))


class _AnyOutput(list):
    """`ctx.outputs` while user counts are ignored: Inductor's user check passes any user count
    at a pattern output."""

    def __contains__(self, pattern) -> bool:
        return True


@contextlib.contextmanager
def users_ignored(ctx):
    """Match in ctx with every pattern node's user count ignored (the structure alone)."""
    outputs, ctx.outputs = ctx.outputs, _AnyOutput(ctx.outputs)
    try:
        yield
    finally:
        ctx.outputs = outputs


def _restore(ctx, saved) -> None:
    ctx.pattern_to_node.clear()
    ctx.pattern_to_node.update(saved[0])
    ctx.exclusive_node_set[:] = saved[1]


class _ExplainingContext(MatchContext):
    """Inductor's match context, but a pattern node met twice at different graph nodes (a value
    the pattern uses twice, which the graph computes twice or differently) names the node, and so
    does a user-count failure: Inductor's `multiple_users` names only the pattern node, so the
    graph node it failed at is kept on the failure (`k3_node`; the innermost match that failed
    sets it) for `near_miss.explain_failure`; so does a multi-output pattern's output that found
    no anchor (`k3_gap`, `anchor_gap`). A node that matched its pattern op must also agree with
    it on every argument Inductor's matcher leaves unread (`disagreement`)."""

    def match(self, pattern, node):
        if pattern in self.pattern_to_node and self.pattern_to_node[pattern] != node:
            return FailedMatch("repeated_pattern: node={node} is not the node this pattern value "
                               "was bound to elsewhere ({bound})", node=node, pattern=pattern,
                               bound=self.pattern_to_node[pattern])
        bound = pattern in self.pattern_to_node
        m = super().match(pattern, node)
        if is_match(m) and isinstance(pattern, (KeywordArg, ExclusiveKeywordArg)):
            self.__dict__.setdefault("k3_bound", {})[pattern] = node
        if is_match(m) and not bound and (
                differs := disagreement(pattern, node, self._bound)) is not None:
            self.pattern_to_node[pattern] = None
            self.__dict__.setdefault("k3_disagreements", []).append((pattern, differs))
            return differs
        if (isinstance(m, FailedMatch) and not hasattr(m, "k3_node")
                and str(getattr(m, "format_string", "")).startswith("multiple_users")):
            m.k3_node = node
        return m

    def _bound(self) -> dict[str, torch.fx.Node]:
        """The pattern inputs bound so far (by name) in the match under way: those of a branch
        that failed were unbound again (`_restore`)."""
        return {p.name: n for p, n in self.__dict__.get("k3_bound", {}).items()
                if p in self.pattern_to_node}


_NO_DEFAULT = "none in its schema"
# a disagreement's message, by where the pattern's value comes from: the op's default, a literal
_UNPASSED = ("keyword_mismatch: node={node} has {key}={value!r}, which the pattern's op does not "
             "pass (default: {default})")
_UNEQUAL = "literal_mismatch: node={node} has {key}={value!r} where the pattern's op has {want!r}"


def disagreement(pattern, node, bound: Callable[[], dict] | None = None) -> FailedMatch | None:
    """Why a node that matched a pattern op computes another value than it, or None: the one
    check after Inductor's match, over every argument its matcher leaves unread. Two kinds, by
    where the pattern's value comes from. `keyword_mismatch`: the node passes an argument the
    pattern's op does not (Inductor drops such keywords unread; an extra trailing positional
    argument reaches here through `_DefaultsCall`), which must be the schema default
    (`sum(x, [-1], dtype=torch.float32)` matched a pattern's `sum(x, [-1])`). `literal_mismatch`:
    a literal of the search graph that `fx_to_pattern` left free (`Ignored`: every int, float,
    list, dtype and device), kept by `literal_args` (`mean(-2)` matched a pattern's `mean(-1)`,
    `pow(4)` its `pow(2)`, a select of token 1 its select of token 0); `_agrees` says which
    literals decide the value (docs/decisions.md, sessions 35 and 36). A reshape's sizes are
    free literals, but where the pattern's view carries an input dim whole, the site's must
    carry it to the same output dim (`_carried_otherwise`, the traced shapes `literal_args`
    kept: `A_log.view(1, H)` matched a pattern's `A_log.view(H, 1)`; session 37). `bound`: gives
    the site nodes the pattern's inputs are bound to so far, by name (`_traced_at_one`; read only
    at a view)."""
    if not isinstance(pattern, CallFunction) or not isinstance(node, torch.fx.Node):
        return None
    literals = getattr(pattern, "k3_literals", {})
    if (_UNSQUEEZE in pattern.fns and node.target is _VIEW and 1 in literals
            and not _inserts_at(node, literals[1])):  # a view as the unsqueeze (`_ViewCall`)
        return FailedMatch(_UNEQUAL, node=node, key="size", value=node.args[1],
                           want=f"a unit dim at {literals[1]}")
    if (traced := getattr(pattern, "k3_view", None)) is not None and (
            carried := _carried_otherwise(traced, node, _traced_at_one(pattern, bound))) is not None:
        return FailedMatch(_UNEQUAL, node=node, key="size", value=carried[0], want=carried[1])
    for key, got, want, omitted in _unread_arguments(pattern, node):
        if omitted and (isinstance(got, torch.fx.Node) or want is _NO_DEFAULT):
            ok = False
        else:
            ok = _agrees(node, key, got, want, strict=omitted)
        if not ok:
            return FailedMatch(_UNPASSED if omitted else _UNEQUAL, node=node, key=key, value=got,
                               want=want, default=want)
    return None


def _unread_arguments(pattern, node):
    """(argument name, the node's value, the pattern's, whether the pattern omits it) of each
    argument Inductor's match left unread: the node's arguments the pattern's op does not pass
    (the pattern's value: the schema default) and the literals the pattern left free (the node's
    value, where it omits one: the schema default)."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    literals = getattr(pattern, "k3_literals", {}) if node.target in pattern.fns else {}
    for i, got in enumerate(node.args):
        if i >= len(pattern.args) and i < len(names):
            yield names[i], got, _default(node.target, names[i]), True
    for key, got in node.kwargs.items():
        if key not in pattern.kwargs:
            yield key, got, _default(node.target, key), True
    for where, want in literals.items():
        key = names[where] if isinstance(where, int) and where < len(names) else where
        if isinstance(where, int):
            got = node.args[where] if where < len(node.args) else _default(node.target, key)
        else:
            got = node.kwargs.get(where, _default(node.target, key))
        if isinstance(key, str) and got is not _NO_DEFAULT:
            yield key, got, want, False


def _default(target, key: str):
    """The schema default of `target`'s argument `key`, or _NO_DEFAULT (no schema, no such
    argument, no default)."""
    schema = getattr(target, "_schema", None)
    arg = next((a for a in getattr(schema, "arguments", ()) if a.name == key), None)
    if arg is None or not arg.has_default_value():
        return _NO_DEFAULT
    return arg.default_value


def _same(value, default) -> bool:
    try:
        return value is default or bool(value == default)
    except Exception:  # noqa: BLE001 (a value without a plain ==: not the default)
        return False


# reshapes: the output's shape alone decides which element goes where, so their dims and sizes
# follow the site's shapes (a pattern's view sizes are its tracing sizes)
_RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "expand", "squeeze", "flatten",
                       "unflatten", "alias"})
_DIM_NAMES = frozenset({"dim", "dims", "dimension", "dim0", "dim1", "dim2"})
_NUMBER_TYPES = frozenset({"number", "Scalar", "float", "Tensor"})  # add.Tensor's other=1e-6
# the ints with which a shape op or a range chooses its elements (a select's index, a slice's
# bounds, an iota's start), as against its sizes (a slice's length, an iota's): "index" counted
# as the pattern counts it, on the site's dim (a negative index from its end, a bound past the end
# at the end); "exact" equal
_CHOOSES = {
    "select": {"index": "index"},
    "slice": {"start": "index", "end": "index", "step": "exact"},
    "narrow": {"start": "index"},
    "unfold": {"step": "exact"},
    "diagonal": {"offset": "exact"},
    "roll": {"shifts": "exact"},
    "iota": {"start": "exact", "step": "exact"},
    "arange": {"start": "exact", "step": "exact"},
}
# reductions and scans whose `dtype=` equal to a float input's dtype is no cast: the same value
# (an int or bool input's default accumulates in int64, so only floats)
_ACCUMULATES = frozenset({"sum", "mean", "prod", "nansum", "cumsum", "cumprod", "softmax",
                          "log_softmax"})
# where a pattern computes in fp32 (its upcast), a site may compute in fp64 (the op's fp32 math is
# its documented rounding), never in fewer bits (fp16's squares overflow where fp32's do not)
_HOLDS_FP32 = (torch.float32, torch.float64)


def _val(arg):
    if isinstance(arg, (list, tuple)) and arg:
        arg = arg[0]
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _rank(arg) -> int | None:
    val = _val(arg)
    return None if val is None else val.dim()


def _agrees(node, key: str, got, want, strict: bool) -> bool:
    """The node's argument `key` (`got`) computes what the pattern's (`want`) does: dims (not a
    reshape's) counted as the pattern counts them, a shape op's or range's choice of elements
    (`_CHOOSES`), numbers, an fp32 upcast held in fp32 or fp64; `strict` (an argument the pattern
    omits, `want` its default): anything else equal, a reduction's `dtype=` its float input's.
    Not strict, the rest is free: sizes and dtypes follow the site's shapes and dtype (the engine
    compares the replacement's outputs)."""
    op = node.target._schema.name.split("::")[-1]
    x = node.args[0] if node.args else None
    if key in _DIM_NAMES and op not in _RESHAPES:
        if op == "permute":
            return _same_permutation(got, want, None if _val(x) is None else list(_val(x).shape))
        if op == "unsqueeze":
            return _inserts_at(node, want)
        return _same_dims(got, want, _rank(x))
    if key in _CHOOSES.get(op, {}):
        if _CHOOSES[op][key] == "exact":
            return _same(got, want)
        return _same_position(got, want, _size_along(node))
    arg = next((a for a in node.target._schema.arguments if a.name == key), None)
    if (arg is not None and str(arg.type) in _NUMBER_TYPES and isinstance(want, (int, float))
            and not isinstance(want, bool)):
        return _same(got, want)
    if want == torch.float32:
        return got in _HOLDS_FP32
    if strict and key == "dtype" and op in _ACCUMULATES:
        val = _val(x)
        return _same(got, want) or (val is not None and val.dtype.is_floating_point
                                    and got == val.dtype)
    return _same(got, want) if strict else True


def traced_shape(node) -> tuple[int, ...] | None:
    """A search graph node's shape as traced: its `meta["val"]`'s, or where the graph came from
    the trace cache (which keeps no values), the shape the cache kept (`TRACED_SHAPE`)."""
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val")
    shape = val.shape if isinstance(val, torch.Tensor) else node.meta.get(TRACED_SHAPE)
    if shape is None or not all(type(s) is int for s in shape):
        return None
    return tuple(shape)


TRACED_SHAPE = "k3_traced_shape"


def _traced_at_one(pattern, bound: Callable[[], dict] | None) -> frozenset:
    """The sizes other than 1 that the site's bound inputs have where the pattern's example
    inputs had a dim of size 1: counts the pattern was traced at 1 (a token count T, a batch)
    and the site has larger. A size-1 dim of the pattern's view may be such a count, and the
    site's view then has that count there: `graw.view(B, T, N)` traced at B = 2, T = 1 is
    [2, 1, N], at the site's B = 1, T = 8 [1, 8, N] (session 38). Without such evidence (every
    input of the site has the trace's size-1 dims) a size-1 dim stays a broadcast's."""
    shapes = getattr(pattern, "k3_inputs", None)
    if not shapes or bound is None:
        return frozenset()
    sizes = set()
    for name, node in bound().items():
        traced, val = shapes.get(name), _val(node)
        if traced is None or val is None or val.dim() != len(traced):
            continue
        sizes |= {s for t, s in zip(traced, val.shape) if t == 1 and type(s) is int and s != 1}
    return frozenset(sizes)


def _carried_otherwise(traced, node, at_one: frozenset = frozenset()) -> tuple[list, str] | None:
    """Where the site's reshape (a node the pattern's view matched) lays out its input
    otherwise than the pattern's view did: (the site's output shape, what the pattern's gives),
    else None. Two things must be the pattern's. A size-1 output dim stays size 1: it is a
    broadcast's (`A_log.view(H, 1)` against `view(1, H)`, `q.view(B, T, H, K)`'s T = 1 against
    `view(B, H, T, K)`: the decode's broadcasts pair other elements wherever the sizes allow
    it). An output dim to which the pattern's view carries an input dim whole (one of its size
    with as many elements after it: B, T, a head dim) is a whole input dim of the site's too
    (`q.view(H, B, ...)` regroups batch and heads). The sizes a view makes (a split's pieces,
    a product) follow the site's shapes, and so does where the input's size-1 dims stand (a
    reshape reads its input in order; the einsum decompositions place and drop them by the
    traced sizes). Not compared: a site of another output rank, and one with fewer size-1 dims
    than the trace in its input or output (a batch or token count traced at 1: `x.view(B * T,
    D)` of a T = 1 trace merges nothing, a T = 8 site's merges B and T). `at_one`: sizes the
    site's inputs have where the trace's had 1 (`_traced_at_one`): a size-1 dim of the trace
    may hold one of those at the site."""
    site = [_val(n) for n in (node.args[0] if node.args else None, node)]
    if any(v is None for v in site):
        return None
    (t_in, t_out), (s_in, s_out) = traced, (list(v.shape) for v in site)
    if len(s_out) != len(t_out) or any(
            sum(_surely_equal(d, 1) for d in s) < t.count(1)
            for t, s in ((t_in, s_in), (t_out, s_out))):
        return None
    why = f"{list(t_out)} of {list(t_in)}: its dim "
    for j, size in enumerate(t_out):
        if size == 1 and not _surely_equal(s_out[j], 1) and s_out[j] not in at_one:
            return s_out, why + f"{j} of size 1"
        if (size != 1 and _whole(t_in, t_out, j) and not _surely_equal(s_out[j], 1)
                and not _whole(s_in, s_out, j)):
            return s_out, why + f"{j} a whole input dim"
    return None


def _whole(shape_in, shape_out, j: int) -> bool:
    """Output dim j of a reshape of `shape_in` to `shape_out` may be an input dim carried over
    whole: one of its size with as many elements after it (not known otherwise, for symbolic
    sizes)."""
    after = math.prod(shape_out[j + 1:])
    return any(not _surely_differ(shape_in[i], shape_out[j])
               and not _surely_differ(math.prod(shape_in[i + 1:]), after)
               for i in range(len(shape_in)))


def _surely_equal(a, b) -> bool:
    """Sizes known equal (symbolic sizes the shape env cannot decide are not)."""
    if type(a) is int and type(b) is int:
        return a == b
    return statically_known_true(a == b)


def _surely_differ(a, b) -> bool:
    """Sizes known to differ (symbolic sizes the shape env cannot decide do not)."""
    if type(a) is int and type(b) is int:
        return a != b
    return statically_known_true(a != b)


def _size_along(node) -> int | None:
    """The size of a select's / slice's / narrow's input along the dim it cuts, where known."""
    val = _val(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if val is None or not isinstance(dim, int) or not -val.dim() <= dim < val.dim():
        return None
    return int(val.shape[dim])


def _same_position(got, want, size: int | None) -> bool:
    """An index or slice bound of the site (`got`) is the pattern's (`want`), both counted as the
    pattern counts it on the site's dim of `size`: from its end where negative, a bound past the
    end at the end (`x[..., T:]` is `x[..., -(taps - 1):]` on a window of taps - 1 + T)."""
    if got is None or want is None or size is None:
        return _same(got, want)

    def at(i: int) -> int:
        return min(max(i + size if i < 0 else i, 0), size)

    return isinstance(got, int) and isinstance(want, int) and at(got) == at(want)


def _same_permutation(got, want, shape) -> bool:
    """A permute of the site's input (of `shape`) by its dims (`got`) and by the pattern's
    (`want`) lay out the same elements in the same order: the input's dims longer than 1 come in
    the same order (where size-1 dims go is the einsum decomposition's choice, which differs
    with the sizes the pattern was traced at). A site of more dims than the pattern's trace keeps
    its extra leading dims in place (the pattern's dims count from the end)."""
    if not isinstance(got, (list, tuple)) or not isinstance(want, (list, tuple)) or not want:
        return _same(got, want)
    lead = len(got) - len(want)
    if lead < 0 or shape is None or len(shape) != len(got):
        return False
    want = [*range(lead), *(d % len(want) + lead for d in want)]
    return ([d % len(got) for d in got if shape[d] != 1]
            == [d for d in want if shape[d] != 1])


def literal_args(expr, search_gm: torch.fx.GraphModule, argnames: list[str] = ()) -> None:
    """Keep on each op of a pattern tree the literals Inductor's `fx_to_pattern` left free
    (`Ignored`: every int, float, list, dtype and device of the search graph), positional by
    index and keyword by name, for `disagreement`. Free, a literal matched any value:
    `mean(-2)` matched a pattern's `mean(-1)`, `pow(4)` its `pow(2)` (docs/decisions.md,
    session 35), `iota(start=1)` mla_decode's `iota(start=0)` (session 36). Also a reshape's
    traced input and output shapes (`k3_view`, from `traced_shape`; session 37) and the pattern
    inputs' traced shapes by name (`k3_inputs`: `argnames`, the search function's, in the order
    of its placeholders, as `fx_to_pattern` names them; session 38)."""
    placeholders = [n for n in search_gm.graph.nodes if n.op == "placeholder"]
    inputs = {name: shape for name, n in zip(argnames, placeholders)
              if (shape := traced_shape(n)) is not None}
    output = next(n for n in search_gm.graph.nodes if n.op == "output")
    leaves = [n for n in torch.utils._pytree.tree_leaves(output.args[0])
              if isinstance(n, torch.fx.Node)]
    outs = list(expr.outputs) if isinstance(expr, MultiOutputPattern) else [expr]
    seen = set()

    def free(q, a) -> bool:
        return (isinstance(q, Ignored) and not isinstance(a, torch.fx.Node)
                and not (isinstance(a, (list, tuple))
                         and any(isinstance(x, torch.fx.Node) for x in a)))

    def visit(p, n):
        if not isinstance(p, CallFunction) or not isinstance(n, torch.fx.Node) or id(p) in seen:
            return
        seen.add(id(p))
        p.k3_literals = {i: a for i, (q, a) in enumerate(zip(p.args, n.args)) if free(q, a)}
        p.k3_literals |= {k: a for k, a in n.kwargs.items() if free(p.kwargs.get(k), a)}
        if (n.target in _VIEWS and (shapes := (traced_shape(n.args[0]), traced_shape(n)))
                and None not in shapes):
            p.k3_view, p.k3_inputs = shapes, inputs
        for q, a in zip(p.args, n.args):
            if isinstance(q, (list, tuple)) and isinstance(a, (list, tuple)):
                for qq, aa in zip(q, a):
                    visit(qq, aa)
            else:
                visit(q, a)

    for p, n in zip(outs, leaves):
        visit(p, n)


def _same_dims(got, want, rank: int | None) -> bool:
    """The site's dims (`got`, of a tensor of `rank` dims) are the pattern's (`want`), each
    counted as the pattern counts it: from the end where it wrote a negative dim (a feature dim,
    whatever the batch dims; the search graph's ranks are not kept in its trace cache), else
    from the front."""
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    if len(got) != len(want) or rank is None:
        return got == want
    return all(g == w or (isinstance(g, int) and isinstance(w, int) and g - w in (rank, -rank)
                          and (g >= 0) != (w >= 0))
               for g, w in zip(got, want))


def match(expr, node):
    """expr.match(node), with the repeated-value failure naming its node. A user-count failure
    gives way to the structure's (the match again, user counts ignored) where the structure
    differs too: the near miss names the node where the site really differs from the pattern,
    not a shared intermediate met on the way (a pattern op tried at the wrong node)."""
    m = _match(expr, node, users=True)
    if not is_match(m) and _head(m) == "multiple_users":
        structural = _match(expr, node, users=False)
        if not is_match(structural):
            return structural
    return m


def _match(expr, node, users: bool):
    outputs = list(expr.outputs) if isinstance(expr, MultiOutputPattern) else [expr]
    ctx = _ExplainingContext(outputs, graph=node.graph)
    try:
        with contextlib.nullcontext() if users else users_ignored(ctx):
            m = ctx.match(expr, node)
    except FailedMatch as e:
        m = e
    if (not is_match(m) and isinstance(expr, MultiOutputPattern)
            and getattr(m, "format_string", "") == "no anchor found"):
        m.k3_gap = next((gap for out in expr.outputs[1:] if out is not None
                         and out not in ctx.pattern_to_node
                         and (gap := anchor_gap(out, ctx)) is not None), None)
    if (not is_match(m) and isinstance(expr, MultiOutputPattern) and getattr(m, "k3_gap", None)
            is None and ctx.pattern_to_node.get(expr.outputs[0]) is not None):
        # the first output matched, another's anchor search met a look-alike (kda's conv state
        # written back from another slice of the window) and went on to other candidates: that
        # node, not the last candidate's failure, is the near miss
        unread = [d for p, d in getattr(ctx, "k3_disagreements", ())
                  if ctx.pattern_to_node.get(p) is None]
        if unread:
            return unread[-1]
    return m


def anchor_gap(pattern, ctx) -> tuple[torch.fx.Node, PatternExpr] | None:
    """Where the anchor search of a multi-output pattern's unmatched output stopped ("no anchor
    found": its first outputs matched, this one has no candidate node): (a graph node bound to
    one of the output's inputs, the pattern op that reads it there) where none of the node's
    users is that op. The search walks up from the matched inputs, user by user; the node is
    where the site's op differs from the pattern's. None where the walk finds candidates."""
    if pattern in ctx.pattern_to_node or not hasattr(pattern, "flat_args_kwargs"):
        return None
    for child in pattern.flat_args_kwargs[0]:
        if not isinstance(child, PatternExpr):
            continue
        found = [n for n in child.find_anchor_nodes(ctx, OrderedSet())
                 if isinstance(n, torch.fx.Node)]
        if not found:
            if (gap := anchor_gap(child, ctx)) is not None:
                return gap
        elif not any(pattern._match_fns(u) for n in found for u in n.users):
            return found[0], pattern
    return None


_VIEW, _UNSQUEEZE = torch.ops.aten.view.default, torch.ops.aten.unsqueeze.default
# the reshapes whose output shape alone says where each element goes (`_carried_otherwise`)
_VIEWS = frozenset({_VIEW, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default})


def _inserts_at(node, dim) -> bool:
    """node, an unsqueeze or a view inserting one size-1 dim, gives what inserting it at `dim`
    (counted from the end where negative) gives: a unit dim inserted beside another is the same
    tensor wherever."""
    vals = [_val(n) for n in (node, node.args[0])]
    if not isinstance(dim, int) or any(v is None for v in vals):
        return False
    out, inp = (list(v.shape) for v in vals)
    at = dim + len(out) if dim < 0 else dim
    return 0 <= at < len(out) and out[at] == 1 and out[:at] + out[at + 1:] == inp


def _inserts_one_unit_dim(node) -> bool:
    """node is a view whose output is its input with one size-1 dim inserted (an unsqueeze)."""
    vals = [getattr(n, "meta", {}).get("val") for n in (node, node.args[0])]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    out, inp = (list(v.shape) for v in vals)
    return len(out) == len(inp) + 1 and any(
        out[d] == 1 and out[:d] + out[d + 1:] == inp for d in range(len(out)))


class _ViewCall(CallFunction):
    """A view / unsqueeze of a pattern that also matches the other: `x.unsqueeze(1)` and
    `x.view(B, 1, H, V)` (or `a[:, None]` and `a.view(H, 1)`; `torch.stack` of one tensor traces
    to the view) insert the same size-1 dim, one op to the model's author, two graphs to a
    positional matcher. A pattern view matches a graph unsqueeze (the view's sizes are ignored
    as every view's are); a pattern unsqueeze matches a graph view that inserts exactly one
    size-1 dim. A failed try leaves no trace in the context."""

    def _other(self, node) -> bool:
        """node is the other op, as this one would be written."""
        other = _UNSQUEEZE if _VIEW in self.fns else _VIEW
        return (isinstance(node, torch.fx.Node) and node.op == "call_function"
                and node.target is other and bool(node.args)
                and (other is _UNSQUEEZE or _inserts_one_unit_dim(node)))

    def _match_fns(self, node) -> bool:  # also where a multi-output pattern looks for its anchors
        return super()._match_fns(node) or self._other(node)

    def _match(self, node, ctx):
        saved = dict(ctx.pattern_to_node), list(ctx.exclusive_node_set)
        if not self._other(node):
            return super()._match(node, ctx)
        other = node.target
        twin = self.__dict__.get("_twin")
        if twin is None:
            twin = self._twin = CallFunction(other, self.args[0], Ignored(), _users=self.users)
            twin._match_users = self._match_users
        second = CallFunction._match(twin, node, ctx)
        if not is_match(second):
            _restore(ctx, saved)
        return second


class _DefaultsCall(CallFunction):
    """An op whose site passes trailing positional arguments that the pattern's op leaves at
    their schema defaults: `topk(x, 3, 1)` on 2-D logits for the pattern's `topk(x, 3)` (dim -1,
    the same dim). Inductor's matcher wants as many positional arguments as the pattern has, so
    the extra ones match anything here and `disagreement` compares them with the defaults, as
    it does the keywords a pattern op does not pass. A failed try leaves no trace."""

    def _match(self, node, ctx):
        extra = len(node.args) - len(self.args) if isinstance(node, torch.fx.Node) else 0
        if extra <= 0 or not self._match_fns(node):
            return super()._match(node, ctx)
        twins = self.__dict__.setdefault("_twins", {})
        if extra not in twins:
            twins[extra] = CallFunction(self.fns, *self.args, *(Ignored() for _ in range(extra)),
                                        _users=self.users, **self.kwargs)
            twins[extra]._match_users = self._match_users
        saved = dict(ctx.pattern_to_node), list(ctx.exclusive_node_set)
        m = CallFunction._match(twins[extra], node, ctx)
        if not is_match(m):
            _restore(ctx, saved)
        return m


def defaults_alike(expr) -> None:
    """Let every plain op of a pattern tree match a site that also passes trailing positional
    arguments at their defaults, as `disagreement` counts them (`_DefaultsCall`)."""
    def alike(p):
        if type(p) is CallFunction and all(isinstance(f, torch._ops.OpOverload) for f in p.fns):
            p.__class__ = _DefaultsCall

    _each_op(expr, alike)


def view_alike(expr) -> None:
    """Let every 2-argument view / unsqueeze of a pattern tree match the other (`_ViewCall`)."""
    def alike(p):  # (a `_CommutativeCall`'s operands too)
        if (type(p) is CallFunction and len(p.args) == 2 and not p.kwargs
                and list(p.fns) in ([_VIEW], [_UNSQUEEZE])):
            p.__class__ = _ViewCall

    _each_op(expr, alike)


def commutative(expr) -> None:
    """Let every binary add.Tensor / mul.Tensor of a pattern tree match either operand order."""
    def either(p):
        if (type(p) is CallFunction and len(p.args) == 2 and not p.kwargs
                and set(p.fns) <= _COMMUTATIVE):
            p.__class__ = _CommutativeCall

    _each_op(expr, either)


__all__ = [
    "GRAPH_PASSES_OFF",
    "INPUT_ASSERTS_OFF",
    "FailedMatch",
    "Match",
    "MultiOutputPattern",
    "PatternExpr",
    "aot_wrappers",
    "commutative",
    "compile_fx",
    "compile_fx_inner",
    "compile_fx_inner_direct",
    "compile_fx_static",
    "compile_kwargs",
    "defaults_alike",
    "disagreement",
    "fake_inputs",
    "fwd_only",
    "fwd_only_fake",
    "fwd_only_joint",
    "gen_pattern_and_search_gm",
    "graph_bumps",
    "graph_cache_tagged",
    "inductor_config",
    "literal_args",
    "make_boxed_func",
    "match",
    "plain_call",
    "register_fallbacks",
    "stable_topological_sort",
    "unset_fake_temporarily",
    "view_alike",
    "wildcard_strings",
]
