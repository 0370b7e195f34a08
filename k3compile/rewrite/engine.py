"""The rewrite engine: patterns written as plain torch code, traced, matched on the functional ATen
graph and replaced by one `torch.ops.k3.*` call each.

Invariants (checked by the pipeline's `check` stage):
* the graph stays functional except for the declared state buffers (index_put_ / copy_ into
  graph inputs that Inductor's functionalization put back);
* every node a rewrite creates carries `meta["val"]`.

A pattern is data (`Pattern`): search fn, replacement fn, example inputs, a `check` reading only
node metadata, the scalars captured as keyword arguments (eps), an optional batch-bucket range.
The registry's order (`patterns/__init__.py`) is the priority order. Each application records
hits per pattern and, for sites that resemble a pattern but did not rewrite, a near miss naming
the node and the failed condition.

A replacement never changes what the graph says a value is: one whose outputs differ in dtype,
shape or device from the matched nodes' `meta["val"]` is refused (a near miss with the reason),
so a pattern traced in one dtype cannot take a site of another (issue 18: `moe_front[float32]`'s
fp32 logits at a bf16 site). Every rewrite is recorded (`Rewrite`) so the `verify` stage can
check it numerically afterwards and `revert` it: the pattern's search, traced at the site, is
spliced back in place of the replacement.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch import fx

from k3compile.rewrite import inductor, near_miss, trace_cache
from k3compile.rewrite.near_miss import NearMiss, module_path, stack_path

# ops outside the fusion plans: the plain GEMMs `patterns/linear.py` takes after every fusion
NEUTRAL = frozenset({"linear"})

log = logging.getLogger("k3compile.rewrite")


@dataclasses.dataclass(frozen=True)
class Hit:
    pattern: str
    node: str
    module: str
    op: str


@dataclasses.dataclass
class Pattern:
    """One rewrite. `search` and `replace` take the same arguments (tensors first, then the
    scalars named in `scalars`, whose example values must be unique literals in the trace)."""

    name: str
    search: Callable[..., Any]
    replace: Callable[..., Any]
    example_inputs: Callable[[], Sequence[Any]]
    op: str  # the k3 op it produces, e.g. "k3.attn_res_mix_norm"
    check: Callable[[inductor.Match], str | None] | None = None  # None = accept, else the reason
    scalars: dict[str, float] = dataclasses.field(default_factory=dict)
    buckets: tuple[int, int] | None = None  # (min, max) batch size this pattern may fire at
    distinctive: tuple[str, ...] = ()  # op names whose presence marks a resembling site
    # arguments that must bind distinct graph nodes (e.g. the weights of same-shaped linears on
    # one input: without this, two pattern outputs could match the same linear)
    exclusive: tuple[str, ...] = ()
    # string arguments (e.g. a process group's name) traced as these sentinels, matched as
    # wildcards and passed to `replace` under the argument's name
    strings: dict[str, str] = dataclasses.field(default_factory=dict)
    fake_trace: bool = False  # trace with fake tensors (patterns holding collectives)
    # trace through Inductor's joint-graph passes, as the model's graph was (einsums: their
    # permute pairs fold away in the graph, so the search graph must fold them too)
    joint_passes: bool = False
    # verify mode: relative tolerance of the fused op against the unfused pattern, per dtype
    tolerance: dict[torch.dtype, float] = dataclasses.field(default_factory=lambda: {
        torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4})
    # verify mode: random inputs for a site (default: randn floats, zero ints, the captured scalars)
    random_inputs: Callable[[dict[str, Any]], list] | None = None
    # on a GPU graph: why the op's CUDA kernel would refuse this site (shapes past its limits),
    # or None. A refused site stays unfused for Inductor, as an op without a kernel does: the
    # op's reference would run eagerly (e.g. the experts dequantised op by op)
    kernel_refusal: Callable[[inductor.Match], str | None] | None = None
    # why this variant cannot match anywhere in a graph, read off the graph before any tracing
    # (e.g. a recurrence unrolled for another T), or None. Stage `fuse` leaves such variants
    # untraced; where no variant of an op fits, the reason is its near miss
    fits: Callable[[fx.Graph], str | None] | None = None

    @functools.cached_property
    def expr(self) -> inductor.PatternExpr:
        trace = inductor.fwd_only_fake if self.fake_trace else inductor.fwd_only
        if self.joint_passes:
            trace = inductor.fwd_only_joint
        expr, self._search_gm = inductor.gen_pattern_and_search_gm(
            self.search, self.example_inputs(), trace_cache.cached(trace, self.name),
            self.scalars, self.exclusive)
        inductor.literal_args(expr, self._search_gm, self.argnames)
        if self.strings:
            inductor.wildcard_strings(expr, {v: k for k, v in self.strings.items()})
        inductor.commutative(expr)
        inductor.view_alike(expr)
        inductor.defaults_alike(expr)
        return expr

    @functools.cached_property
    def argnames(self) -> list[str]:
        return list(inspect.signature(self.search).parameters)

    @property
    def anchors(self) -> set:
        expr = self.expr
        return set(expr.outputs[0].fns if isinstance(expr, inductor.MultiOutputPattern) else expr.fns)

    @functools.cached_property
    def op_signature(self) -> collections.Counter:
        """The ops of the first output's input cone: a site is only ever compared from its anchor
        (the first output), whose cone cannot hold the other outputs' ops."""
        self.expr  # noqa: B018 (traces the search graph)
        out = next(n for n in self._search_gm.graph.nodes if n.op == "output")
        first = torch.utils._pytree.tree_leaves(out.args[0])[0]
        return near_miss.cone_ops(near_miss.cone(first, len(self._search_gm.graph.nodes)))


@dataclasses.dataclass(frozen=True)
class Reverted:
    pattern: str
    node: str
    module: str
    error: str


@dataclasses.dataclass(eq=False)
class Rewrite:
    """One rewrite as `apply_patterns` made it: what the `verify` stage needs to check it on
    random inputs shaped like the site and to splice the unfused computation back."""

    pattern: Pattern
    hit: Hit
    args: list  # the site's arguments (graph nodes, lists of them, literals), pattern.argnames order
    values: dict[str, Any]  # their meta["val"] (fake tensors) or literal values, by argument name
    site: list  # the matched outputs' meta["val"] leaves: what the graph says the site computes
    outputs: list  # the replacement's output leaves, in the search's output order
    nodes: list  # the nodes the replacement added
    uses: list  # per output: (user, leaf index) uses the matched output had before the rewrite
    stack: Any = None  # the site's nn_module_stack
    consumed_by: Rewrite | None = None  # a later rewrite whose match took some of `nodes`


@dataclasses.dataclass
class RewriteReport:
    hits: list[Hit] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    reverted: list[Reverted] = dataclasses.field(default_factory=list)  # failed verification
    verified: int = 0
    deferred: dict[str, str] = dataclasses.field(default_factory=dict)  # op -> why not applied
    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)  # in the order made

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(h.pattern for h in self.hits)

    def merge(self, other: RewriteReport) -> None:
        self.hits += other.hits
        self.near_misses += other.near_misses
        self.reverted += other.reverted
        self.verified += other.verified
        self.deferred.update(other.deferred)
        self.rewrites += other.rewrites


def apply_patterns(graph: fx.Graph, patterns: Sequence[Pattern], batch: int | None = None,
                   enabled: Callable[[str], bool] = lambda name: True,
                   deferred: Callable[[Pattern], str | None] | None = None,
                   kernels_only: bool = False) -> RewriteReport:
    """Match every pattern, in priority order, at every node of the graph; replace the matches
    that pass their check and whose replacement computes what the graph's metadata says the
    site computes (dtype, shape, device of every output). `deferred(pattern)` names a reason to
    skip a pattern for this graph (its op has no kernel on the graph's device), recorded per op;
    with `kernels_only`, a site whose kernel refuses it (`Pattern.kernel_refusal`) is deferred so
    too. Returns hits, near misses, deferred ops and every rewrite made (for `verify_rewrites`)."""
    report = RewriteReport()
    neutral_sites: set[str] = set()  # nodes a NEUTRAL op (a plain GEMM) took
    made_by: dict[fx.Node, Rewrite] = {}  # node a replacement added -> its rewrite
    for pattern in patterns:
        if not enabled(pattern.name):
            continue
        if deferred is not None and (why := deferred(pattern)):
            report.deferred.setdefault(pattern.op.split(".")[-1], why)
            continue
        if pattern.buckets and batch is not None and not pattern.buckets[0] <= batch <= pattern.buckets[1]:
            continue
        if pattern.fits is not None and pattern.fits(graph) is not None:
            continue  # cannot match here: left untraced
        anchors = pattern.anchors
        for node in reversed(list(graph.nodes)):
            if node.op != "call_function" or node.target not in anchors or not node.graph:
                continue
            if node._erased:
                continue
            m = inductor.match(pattern.expr, node)
            if not m:
                if (nm := near_miss.failed(pattern, node, m, module_path(node))) is not None:
                    report.near_misses.append(nm)
                continue
            reason = pattern.check(m) if pattern.check else None
            if reason:
                report.near_misses.append(NearMiss(pattern.name, node.name, f"check refused: {reason}",
                                                   module_path(node)))
                continue
            if kernels_only and pattern.kernel_refusal and (reason := pattern.kernel_refusal(m)):
                report.deferred.setdefault(pattern.op.split(".")[-1], f"kernel refuses: {reason}")
                report.near_misses.append(NearMiss(pattern.name, node.name, f"kernel refused: {reason} "
                                                   "(left to Inductor)", module_path(node)))
                continue
            args = [m.kwargs[a] for a in pattern.argnames]
            if reason := reads_its_site(m, args) or replacement_mismatch(pattern, m, args):
                report.near_misses.append(NearMiss(pattern.name, node.name, f"replacement refused: {reason}",
                                                   module_path(node)))
                continue
            rewrite = _replace(graph, pattern, m, args, node)
            for taken in m.nodes:  # a later fusion over an earlier one's op (fb_kda_decode, ...)
                if (earlier := made_by.get(taken)) is not None and earlier.consumed_by is None:
                    earlier.consumed_by = rewrite
            made_by.update((n, rewrite) for n in rewrite.nodes)
            report.rewrites.append(rewrite)
            report.hits.append(rewrite.hit)
            if pattern.op.split(".")[-1] in NEUTRAL:
                neutral_sites.update(n.name for n in m.nodes)
    graph.eliminate_dead_code()
    # a near miss at a site that a later (or earlier) pattern fused is not a miss; one whose GEMM
    # only became a plain `k3.linear` still is (the fusion it names did not happen)
    alive = {n.name for n in graph.nodes} | neutral_sites
    report.near_misses = [nm for nm in report.near_misses if nm.node in alive]
    return report


def _keep(*_):  # the target of a temporary node that holds the replacement's outputs
    return None


def _leaf_uses(node: fx.Node) -> list[tuple[fx.Node, int]]:
    """(user, index among the user's flattened args and kwargs) for every use of node."""
    out = []
    for user in node.users:
        leaves = torch.utils._pytree.tree_leaves((user.args, user.kwargs))
        out += [(user, i) for i, leaf in enumerate(leaves) if leaf is node]
    return out


def _site_module(anchor: fx.Node, matched: Sequence[fx.Node]) -> tuple[str, Any]:
    """(module path, nn_module_stack) a rewrite is placed in: the anchor's; where the anchor lies
    outside every layer but most of the matched computation lies in one layer (a model that
    writes the norm after a layer's depth mix in its own forward, not in the layer's module),
    that layer's last matched node's; where none does but what it computes feeds one layer only
    (a model that writes layer 0's input norm in its own forward), that layer's
    (`_fed_layer_stack`). A top-level op that only reads a few of a layer's nodes
    (Moonshot's final mix stacks the last layer's blocks there, then feeds the final norm) stays
    where its anchor is. In a
    functional model, whose layers were read off the weights (`k3compile.layers.attribute`), the
    earliest layer of the matched nodes, wherever the anchor is: there a layer's last op that reads no weight (MoE's
    `routed + shared`) lies in the layer it feeds, the one a residual fusion anchors at."""
    from k3compile.layers import ATTRIBUTED, layer_index  # noqa: PLC0415 (it imports rewrite)

    where = module_path(anchor)
    placed = [n for n in matched if isinstance(n, fx.Node) and n.op == "call_function"
              and layer_index(module_path(n)) is not None]
    if any(ATTRIBUTED in n.meta["nn_module_stack"] for n in placed):
        first = min(placed, key=lambda n: layer_index(module_path(n)))
        return module_path(first), first.meta.get("nn_module_stack")
    if layer_index(where) is None:
        computed = [n for n in matched if isinstance(n, fx.Node) and n.op == "call_function"]
        by_layer = collections.defaultdict(list)
        for n in computed:
            by_layer[layer_index(module_path(n))].append(n)
        outside = len(by_layer.pop(None, ()))
        if by_layer:
            nodes = max(by_layer.values(), key=len)
            if len(nodes) > outside:
                last = max(nodes)
                return module_path(last), last.meta.get("nn_module_stack")
        if (stack := _fed_layer_stack(matched)) is not None:
            return stack_path(stack), stack
    return where, anchor.meta.get("nn_module_stack")


def _fed_layer_stack(matched: Sequence[fx.Node]) -> dict | None:
    """The module stack of the one layer that what `matched` computes feeds (its values read,
    through nodes outside every layer, by that layer's nodes only: never by the graph's output
    nor another layer), cut to its outermost module inside the layer; None where there is no
    such layer. A layer's input norm written in the model's forward (spell6, spell8, the
    red-team spelling) so lies in its layer, as in a model that writes it in the layer's module,
    and as `k3compile.layers.attribute` places what prepares a layer's input."""
    from k3compile.layers import layer_index  # noqa: PLC0415 (it imports rewrite)

    inside = {n for n in matched if isinstance(n, fx.Node) and n.op == "call_function"}
    todo = [u for n in inside for u in n.users if u not in inside]
    seen, fed = set(todo), None
    while todo:
        n = todo.pop()
        if n.op == "output":
            return None
        if layer_index(module_path(n)) is None:
            todo += [u for u in n.users if u not in seen and u not in inside]
            seen.update(n.users)
            continue
        if fed is not None and layer_index(module_path(n)) != layer_index(module_path(fed)):
            return None
        fed = fed or n
    if fed is None:
        return None
    stack = {}
    for key, entry in fed.meta["nn_module_stack"].items():
        stack[key] = entry
        if layer_index(stack_path(stack)) is not None:
            return stack
    return None


def _replace(graph: fx.Graph, pattern: Pattern, m: Any, args: list, node: fx.Node) -> Rewrite:
    """m.replace_by_example, recording what the rewrite did (a `Rewrite`)."""
    where, stack = _site_module(node, m.nodes)
    olds = m.output_nodes()
    site = [v for o in olds if isinstance(o, fx.Node)
            for v in torch.utils._pytree.tree_leaves(o.meta.get("val"))]
    uses = [_leaf_uses(o) if isinstance(o, fx.Node) else [] for o in olds]
    values = {name: (a.meta.get("val") if isinstance(a, fx.Node)
                     else fx.map_arg(a, lambda n: n.meta.get("val"))) for name, a in zip(pattern.argnames, args)}
    before = set(graph.nodes)
    # a node holding the outputs learns their replacements (Inductor rewires it with the other
    # users); not where one output node stands for several values (rewired through getitems)
    plain = all(o is None or isinstance(o.meta.get("val"), torch.Tensor) for o in olds)
    holder = graph.call_function(_keep, tuple(olds)) if plain else None
    m.replace_by_example(pattern.replace, args)
    outputs = list(holder.args) if holder is not None else []
    if holder is not None:
        graph.erase_node(holder)
    # the nodes the replacement added (torch 2.11's replace_by_example returns None)
    new_nodes = [n for n in graph.nodes if n not in before]
    # the replacement goes before the site's first output, which can precede the definition of
    # another input (W_UK is cut from kv_b after q is split): reorder, where a new node now
    # reads one defined after it (the sort is O(graph); this check, O(what was added))
    if any(not arg < n for n in new_nodes for arg in n.all_input_nodes):
        inductor.stable_topological_sort(graph)
    for n in new_nodes:
        n.meta["k3_pattern"] = pattern.name
        if stack is not None:
            n.meta["nn_module_stack"] = stack
    hit = Hit(pattern.name, node.name, where, pattern.op)
    return Rewrite(pattern, hit, args, values, site, outputs, new_nodes, uses, stack)


def _fake_mode(values: Sequence[Any]):
    leaves = [v for v in torch.utils._pytree.tree_leaves(list(values)) if isinstance(v, torch.Tensor)]
    mode = torch._guards.detect_fake_mode(leaves)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def _same_size(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def _describe_val(v: Any) -> str:
    if not isinstance(v, torch.Tensor):
        return repr(v)
    return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)} on {v.device.type}"


def output_mismatch(got: Sequence[Any], want: Sequence[Any]) -> str | None:
    """Where the values `got` differ from `want` in count, dtype, shape or device (None: they
    agree; a value of unknown metadata agrees with anything)."""
    if len(got) != len(want):
        return f"{len(got)} outputs where the site has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, torch.Tensor) or not isinstance(w, torch.Tensor):
            continue
        if (g.dtype != w.dtype or g.device.type != w.device.type or g.dim() != w.dim()
                or not all(_same_size(a, b) for a, b in zip(g.shape, w.shape))):
            return f"output {i} is {_describe_val(g)} where the graph has {_describe_val(w)}"
    return None


def reads_its_site(m: Any, args: list) -> str | None:
    """Why the replacement would read its own result (an input computed from a matched node: a
    cycle once the site's outputs are rewired to it), or None. spell11's AttnRes bank is a cat
    that holds the prefix attn_res_mix_norm[delta] computes, sliced before the new block, so
    the mix's block input is computed from the site's own add."""
    matched = set(m.nodes)
    if not matched:
        return None
    first = min(matched)
    seen = set()  # shared: an ancestor already walked from one input reached no matched node
    for arg in (a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, fx.Node)):
        todo = [arg]
        while todo:
            n = todo.pop()
            if n in seen or n < first:  # nothing before the site is computed from it
                continue
            seen.add(n)
            if n in matched:
                return f"its input {arg.name} is computed from the site's {n.name}"
            todo += n.all_input_nodes
    return None


def replacement_mismatch(pattern: Pattern, m: Any, args: list) -> str | None:
    """Run the replacement on the site's fake values: why its outputs are not what the matched
    nodes' meta["val"] say (dtype, shape, device), or None."""
    site = [v for o in m.output_nodes() if isinstance(o, fx.Node)
            for v in torch.utils._pytree.tree_leaves(o.meta.get("val"))]
    if not site or any(v is None for v in site):
        return None  # nothing recorded to compare with
    vals = [fx.map_arg(a, lambda n: n.meta.get("val")) for a in args]
    if any(isinstance(a, fx.Node) and v is None for a, v in zip(args, vals)):
        return None
    try:
        with _fake_mode(vals):
            got = torch.utils._pytree.tree_leaves(pattern.replace(*vals))
    except Exception as e:  # noqa: BLE001  (a replacement that cannot run here cannot replace)
        return f"the replacement raised {type(e).__name__} on the site's metadata: {e}"
    if why := output_mismatch(got, site):
        return why
    sizes = _Sizes()  # the op's fake trusts its inputs; its reference does not
    ref = _reference_outputs(pattern, vals, sizes)
    if ref is not None and (why := output_mismatch(ref, sizes.fakes(site))):
        return f"the op's reference on the bound inputs: {why}{sizes.said()}"
    return None


def _finite(bound) -> int | None:
    """A value range's bound as an int, None where it is infinite (sympy's or torch's oo)."""
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


class _Sizes:
    """One integer per size symbol, so that a site of symbolic sizes (every site under
    `mark_batch`) is checked at sizes it can have: a backed symbol at its hint, an unbacked one
    (the marked batch) at the least of its range that is at least 2 (a batch of 1 hides a
    mis-bound dim, as T = 1 hid spell14's heads-first o_lat). The same value wherever the symbol
    appears, in the inputs and in the site's outputs; `None` from `size` where an expression
    does not evaluate to an integer."""

    def __init__(self):
        self.values: dict = {}

    def size(self, n) -> int | None:
        if type(n) is int:
            return n
        node = getattr(n, "node", None)
        expr, env = getattr(node, "expr", None), getattr(node, "shape_env", None)
        if expr is None or env is None:
            return None
        for sym in expr.free_symbols:
            if sym not in self.values:
                self.values[sym] = sympy.Integer(self._value(sym, env))
        try:
            return int(expr.xreplace(self.values))
        except (TypeError, ValueError):
            return None

    @staticmethod
    def _value(sym, env) -> int:
        backed = getattr(env, "backed_var_to_val", None)  # torch 2.13's name
        hint = (env.var_to_val if backed is None else backed).get(sym)
        if hint is not None:
            return int(hint)
        bounds = env.var_to_range.get(sym)
        low = _finite(bounds.lower) if bounds is not None else None
        high = _finite(bounds.upper) if bounds is not None else None
        low = low or 0
        return max(low, 2) if high is None or high >= 2 else low

    def shape(self, v: torch.Tensor, strides: bool = False) -> tuple[int, ...] | None:
        dims = [self.size(n) for n in (*v.shape, *(v.stride() if strides else ()))]
        return None if any(d is None for d in dims) else tuple(dims)

    def fakes(self, vals: list) -> list:
        """`vals` with each tensor of symbolic sizes a fake of these sizes (of unknown sizes:
        None, which agrees with anything)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        def one(v):
            if not isinstance(v, torch.Tensor) or all(type(n) is int for n in v.shape):
                return v
            shape = self.shape(v)
            return None if shape is None else torch.empty(shape, dtype=v.dtype, device=v.device)
        with FakeTensorMode():
            return [one(v) for v in vals]

    def said(self) -> str:
        return (f" (symbolic sizes at {', '.join(f'{k}={v}' for k, v in self.values.items())})"
                if self.values else "")


def _reference_outputs(pattern: Pattern, vals: list, sizes: _Sizes) -> list | None:
    """The replacement's outputs with its op computed by the op's torch reference, on fresh fakes
    of the site's shapes in a mode of their own (no shape environment: a reference's `.item()`
    or data-dependent size raises there and decides nothing, and no symbol or guard reaches
    Dynamo's); symbolic sizes at the integers `sizes` gives them (session 38: before, such a
    site, every site under `mark_batch`, went unchecked). None where the reference cannot run
    on fakes or a size has no integer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    leaves, spec = torch.utils._pytree.tree_flatten(vals)
    layouts = {i: sizes.shape(v, strides=True) for i, v in enumerate(leaves)
               if isinstance(v, torch.Tensor)}
    if any(layout is None for layout in layouts.values()):
        return None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _Reference(pattern.op):
            fresh = [torch.empty_strided(layouts[i][:v.dim()], layouts[i][v.dim():],
                                         dtype=v.dtype, device=v.device)
                     if i in layouts else v for i, v in enumerate(leaves)]
            return torch.utils._pytree.tree_leaves(
                pattern.replace(*torch.utils._pytree.tree_unflatten(fresh, spec)))
    except Exception:  # noqa: BLE001  (data-dependent, or not runnable on fakes: cannot tell)
        return None


class _Reference(torch.overrides.TorchFunctionMode):
    """Calls of k3 op `op` ("k3.name") run the function its `torch.library.custom_op` wraps
    (the op's torch reference) instead of its registered fake. A fake takes its output's shape
    from one argument (mla_uv_gate's from g) and so agrees with the site whatever the other
    arguments are; the reference computes from all of them. spell14's heads-first o_lat,
    bound where the op reads [B, T, H, C], gave [B, H, H·V] from the reference and [B, 1, H·V]
    from the fake: a shape the graph never had, caught here before the graph runs."""

    def __init__(self, op: str):
        super().__init__()
        from torch._library.custom_ops import OPDEFS

        self.opdef = OPDEFS.get(op.replace(".", "::", 1))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "_qualified_op_name", None) or getattr(
            getattr(func, "_schema", None), "name", None)
        if self.opdef is not None and name == self.opdef._qualname:
            return self.opdef._init_fn(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _random_like(val: Any, gen: torch.Generator) -> Any:
    if isinstance(val, (list, tuple)):
        return type(val)(_random_like(v, gen) for v in val)
    if not isinstance(val, torch.Tensor):
        return val
    shape = [int(d) for d in val.shape]
    if val.dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(val.dtype)
    if len(shape) == 1 and val.dtype == torch.int64:  # slots / positions: distinct rows
        return torch.arange(shape[0])
    return torch.zeros(shape, dtype=val.dtype)


def verify_site(pattern: Pattern, site: Any, seed: int = 0,
                expected: Sequence[Any] | None = None) -> str | None:
    """Run the unfused pattern and the fused replacement on the same fresh random inputs of the
    site's shapes (`site`: a match, or the site's argument values by name); None when they agree
    in dtype, shape and value (within the pattern's tolerance), and with `expected` (the
    metadata of the site's outputs) in dtype and shape, else the error."""
    values = site if isinstance(site, dict) else {
        n: (site.kwargs[n].meta.get("val") if isinstance(site.kwargs[n], fx.Node) else site.kwargs[n])
        for n in pattern.argnames}
    with inductor.unset_fake_temporarily():  # compile runs under fake mode; this needs real data
        return _verify_site(pattern, values, seed, expected)


def _verify_site(pattern: Pattern, values: dict[str, Any], seed: int,
                 expected: Sequence[Any] | None) -> str | None:
    tensors = [v for v in torch.utils._pytree.tree_leaves(list(values.values()))
               if isinstance(v, torch.Tensor)]
    if any(not isinstance(d, int) for v in tensors for d in v.shape):
        return None  # symbolic shapes: nothing concrete to test at this site
    device = tensors[0].device if tensors else "cpu"
    gen = torch.Generator().manual_seed(seed)
    try:
        inputs = (pattern.random_inputs(values) if pattern.random_inputs
                  else [_random_like(values[n], gen) for n in pattern.argnames])
        inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]
        clone = lambda xs: [x.clone() if isinstance(x, torch.Tensor) else x for x in xs]
        with torch.no_grad():
            want = torch.utils._pytree.tree_leaves(pattern.search(*clone(inputs)))
            got = torch.utils._pytree.tree_leaves(pattern.replace(*clone(inputs)))
    except Exception as e:  # a replacement that cannot run is as bad as a wrong one
        return f"raised {type(e).__name__}: {e}"
    if len(want) != len(got):
        return f"{len(got)} outputs, the pattern has {len(want)}"
    for i, (w, g) in enumerate(zip(want, got)):
        if not isinstance(w, torch.Tensor) or not isinstance(g, torch.Tensor):
            if w != g:
                return f"output {i}: {g!r} != {w!r}"
            continue
        if w.shape != g.shape or w.dtype != g.dtype:
            return f"output {i}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
        tol = pattern.tolerance.get(w.dtype, 0.0)
        if w.is_floating_point():
            err = float((g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30))
            if not err <= tol:
                return f"output {i}: relative error {err:.3g} > {tol:.3g}"
        elif not torch.equal(w, g):
            return f"output {i}: integer outputs differ"
    if expected is not None and (why := output_mismatch(got, list(expected))):
        return f"against the site's metadata: {why}"
    return None


def verify_rewrites(graph: fx.Graph, report: RewriteReport, seed: int = 0) -> None:
    """Verify mode: check every rewrite in `report` (`verify_site`, against the site's metadata
    too) and revert each one that fails, splicing the pattern's search back at its site. A
    rewrite a failing one's op was fused into (`consumed_by`) is reverted first, then the failing
    one where the later search put its op back. Updates the report: `verified`, `reverted`, and
    a reverted rewrite's hit removed."""
    failed: dict[Rewrite, str] = {}
    for rw in report.rewrites:
        error = verify_site(rw.pattern, rw.values, seed, rw.site)
        if error is None:
            report.verified += 1
        else:
            failed[rw] = error
    undo = dict(failed)
    for rw in failed:  # what was built on a failing rewrite goes with it
        later = rw.consumed_by
        while later is not None and later not in undo:
            undo[later] = f"built on {rw.pattern.name}'s op at {rw.hit.node}, which failed"
            later = later.consumed_by
    for rw in reversed(report.rewrites):  # latest first
        if rw not in undo:
            continue
        error = undo[rw]
        why = revert(graph, rw, report.rewrites)
        if why is not None:
            error += f" (NOT reverted: {why})"
        else:
            report.hits = [h for h in report.hits if h is not rw.hit]
        report.reverted.append(Reverted(rw.pattern.name, rw.hit.node, rw.hit.module, error))
        log.warning("k3 verify: %s at %s reverted: %s", rw.pattern.name,
                    rw.hit.module or rw.hit.node, error)
    if undo:
        graph.eliminate_dead_code()


def _search_trace(pattern: Pattern):
    if pattern.joint_passes:
        return inductor.fwd_only_joint
    return inductor.fwd_only_fake if pattern.fake_trace else inductor.fwd_only


def revert(graph: fx.Graph, rw: Rewrite, rewrites: Sequence[Rewrite] = ()) -> str | None:
    """Splice the unfused computation back in place of rewrite `rw`: the pattern's search traced
    on the site's values, its outputs taking the replacement's uses. An earlier rewrite of
    `rewrites` whose op `rw` had consumed finds its op again in what was spliced back (so it can
    be reverted next). None when done, else why it cannot be."""
    if not rw.outputs:
        return "its outputs were not recorded"
    if rw.consumed_by is not None and any(n._erased for n in rw.nodes):
        return f"a later rewrite ({rw.consumed_by.pattern.name}) holds its op"
    live = [n for n in rw.nodes if not n._erased]
    if any(isinstance(o, fx.Node) and o._erased for o in rw.outputs) or not live:
        return "its outputs are no longer in the graph"
    vals = [fx.map_arg(a, lambda n: n.meta["val"]) for a in rw.args]
    with _fake_mode(vals):
        gm = _search_trace(rw.pattern)(rw.pattern.search, vals)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    leaves = torch.utils._pytree.tree_leaves(rw.args)
    if len(placeholders) != len(leaves):
        return f"the search traced {len(placeholders)} inputs for {len(leaves)} arguments"
    before = set(graph.nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min(live, key=order.__getitem__)):
        result = graph.graph_copy(gm.graph, dict(zip(placeholders, leaves)))
    new = torch.utils._pytree.tree_leaves(result)
    if len(new) != len(rw.outputs):
        return f"the search gave {len(new)} outputs for the replacement's {len(rw.outputs)}"
    made = set(rw.nodes)
    for i, (old, value) in enumerate(zip(rw.outputs, new)):
        if old in made:
            old.replace_all_uses_with(value)
        else:  # the replacement passed an input through (a state it updates in place)
            for user, leaf in rw.uses[i]:
                if user._erased:
                    continue
                flat, spec = torch.utils._pytree.tree_flatten((user.args, user.kwargs))
                flat[leaf] = value
                user.args, user.kwargs = torch.utils._pytree.tree_unflatten(flat, spec)
    for n in reversed(rw.nodes):
        if not n._erased and not n.users:
            graph.erase_node(n)
    spliced = [n for n in graph.nodes if n not in before]
    for n in spliced:
        n.meta["k3_reverted"] = rw.pattern.name
        if rw.stack is not None:
            n.meta["nn_module_stack"] = rw.stack
    for earlier in rewrites:
        if earlier.consumed_by is rw:
            _relocate(earlier, spliced)
    inductor.stable_topological_sort(graph)
    return None


def _relocate(rw: Rewrite, spliced: list[fx.Node]) -> bool:
    """Point `rw` at the twins of its erased nodes among `spliced` (same target, same arguments
    up to the nodes already mapped): a later rewrite took its op, and reverting that one put an
    equal op back."""
    mapping: dict[fx.Node, fx.Node] = {}
    pool = list(spliced)
    for n in rw.nodes:
        if not n._erased:
            continue
        args = fx.map_arg((n.args, n.kwargs), lambda a: mapping.get(a, a))
        twin = next((s for s in pool if s.target == n.target
                     and _same_args((s.args, s.kwargs), args)), None)
        if twin is None:
            return False
        pool.remove(twin)
        mapping[n] = twin
    rw.nodes = [mapping.get(n, n) for n in rw.nodes]
    rw.outputs = [mapping.get(o, o) for o in rw.outputs]
    rw.uses = [[(mapping.get(u, u), i) for u, i in uses] for uses in rw.uses]
    rw.consumed_by = None
    return True


def _same_args(a: Any, b: Any) -> bool:
    la, sa = torch.utils._pytree.tree_flatten(a)
    lb, sb = torch.utils._pytree.tree_flatten(b)
    return len(la) == len(lb) and all(x is y if isinstance(x, fx.Node) or isinstance(y, fx.Node)
                                      else x == y for x, y in zip(la, lb))


def tensor_meta(node: Any) -> torch.Tensor | None:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


__all__ = ["Hit", "NearMiss", "Pattern", "Rewrite", "RewriteReport", "apply_patterns", "module_path",
           "output_mismatch", "replacement_mismatch", "revert", "tensor_meta", "verify_rewrites",
           "verify_site"]


def with_signature(fn: Callable[..., Any], names: Sequence[str]) -> Callable[..., Any]:
    """fn(*args) with a named signature, for variants whose argument count is a parameter
    (the tracer and the matcher name the pattern's inputs by the signature)."""

    def wrapper(*args):
        return fn(*args)

    wrapper.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    wrapper.__name__ = getattr(fn, "__name__", "fn")
    return wrapper
