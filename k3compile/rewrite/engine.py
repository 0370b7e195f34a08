"""The rewrite engine: patterns written as plain torch code, traced, matched on the functional ATen
graph and replaced by one `torch.ops.k3.*` call each.

Invariants (checked by the pipeline's last stage):
* the graph stays functional except for the declared state buffers (index_put_ / copy_ into
  graph inputs that Inductor's functionalization put back);
* every node a rewrite creates carries `meta["val"]`.

A pattern is data (`Pattern`): search fn, replacement fn, example inputs, a `check` reading only
node metadata, the scalars captured as keyword arguments (eps), an optional batch-bucket range.
The registry's order (`patterns/__init__.py`) is the priority order. Each application records
hits per pattern and, for sites that resemble a pattern but did not rewrite, a near miss naming
the node and the failed condition.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from k3compile.rewrite import inductor, near_miss
from k3compile.rewrite.near_miss import NearMiss, module_path

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

    @functools.cached_property
    def expr(self) -> inductor.PatternExpr:
        trace = inductor.fwd_only_fake if self.fake_trace else inductor.fwd_only
        if self.joint_passes:
            trace = inductor.fwd_only_joint
        expr, self._search_gm = inductor.gen_pattern_and_search_gm(
            self.search, self.example_inputs(), trace, self.scalars, self.exclusive)
        if self.strings:
            inductor.wildcard_strings(expr, {v: k for k, v in self.strings.items()})
        inductor.commutative(expr)
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


@dataclasses.dataclass
class RewriteReport:
    hits: list[Hit] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    reverted: list[Reverted] = dataclasses.field(default_factory=list)  # failed verification
    verified: int = 0
    deferred: dict[str, str] = dataclasses.field(default_factory=dict)  # op -> why not applied

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(h.pattern for h in self.hits)

    def merge(self, other: RewriteReport) -> None:
        self.hits += other.hits
        self.near_misses += other.near_misses
        self.reverted += other.reverted
        self.verified += other.verified
        self.deferred.update(other.deferred)


def apply_patterns(graph: fx.Graph, patterns: Sequence[Pattern], batch: int | None = None,
                   enabled: Callable[[str], bool] = lambda name: True,
                   verify: bool = False,
                   deferred: Callable[[Pattern], str | None] | None = None,
                   kernels_only: bool = False) -> RewriteReport:
    """Match every pattern, in priority order, at every node of the graph; replace the matches
    that pass their check (and, with `verify`, agree numerically with the unfused pattern on
    fresh random inputs of the site's shapes). `deferred(pattern)` names a reason to skip a
    pattern for this graph (its op has no kernel on the graph's device), recorded per op; with
    `kernels_only`, a site whose kernel refuses it (`Pattern.kernel_refusal`) is deferred so too.
    Returns hits, near misses, reverted sites and deferred ops."""
    report = RewriteReport()
    neutral_sites: set[str] = set()  # nodes a NEUTRAL op (a plain GEMM) took
    for pattern in patterns:
        if not enabled(pattern.name):
            continue
        if deferred is not None and (why := deferred(pattern)):
            report.deferred.setdefault(pattern.op.split(".")[-1], why)
            continue
        if pattern.buckets and batch is not None and not pattern.buckets[0] <= batch <= pattern.buckets[1]:
            continue
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
            where, stack = module_path(node), node.meta.get("nn_module_stack")
            args = [m.kwargs[a] for a in pattern.argnames]
            if verify:
                error = verify_site(pattern, m)
                if error is not None:
                    report.reverted.append(Reverted(pattern.name, node.name, where, error))
                    log.warning("k3 verify: %s at %s reverted: %s", pattern.name, where or node.name, error)
                    continue
                report.verified += 1
            before = set(graph.nodes)
            m.replace_by_example(pattern.replace, args)
            # the nodes the replacement added (torch 2.11's replace_by_example returns None)
            new_nodes = [n for n in graph.nodes if n not in before]
            # the replacement goes before the site's first output, which can precede the
            # definition of another input (W_UK is cut from kv_b after q is split): reorder
            inductor.stable_topological_sort(graph)
            for n in new_nodes:
                n.meta["k3_pattern"] = pattern.name
                if stack is not None:
                    n.meta["nn_module_stack"] = stack
            report.hits.append(Hit(pattern.name, node.name, where, pattern.op))
            if pattern.op.split(".")[-1] in NEUTRAL:
                neutral_sites.update(n.name for n in m.nodes)
    graph.eliminate_dead_code()
    # a near miss at a site that a later (or earlier) pattern fused is not a miss; one whose GEMM
    # only became a plain `k3.linear` still is (the fusion it names did not happen)
    alive = {n.name for n in graph.nodes} | neutral_sites
    report.near_misses = [nm for nm in report.near_misses if nm.node in alive]
    return report


def _random_like(val: Any, gen: torch.Generator) -> Any:
    if not isinstance(val, torch.Tensor):
        return val
    shape = [int(d) for d in val.shape]
    if val.dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(val.dtype)
    if len(shape) == 1 and val.dtype == torch.int64:  # slots / positions: distinct rows
        return torch.arange(shape[0])
    return torch.zeros(shape, dtype=val.dtype)


def verify_site(pattern: Pattern, match: Any, seed: int = 0) -> str | None:
    """Run the unfused pattern and the fused replacement on the same fresh random inputs of the
    site's shapes; None when they agree within the pattern's tolerance, else the error."""
    with inductor.unset_fake_temporarily():  # compile runs under fake mode; this needs real data
        return _verify_site(pattern, match, seed)


def _verify_site(pattern: Pattern, match: Any, seed: int) -> str | None:
    values = {}
    for name in pattern.argnames:
        arg = match.kwargs[name]
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
        if isinstance(val, torch.Tensor) and any(not isinstance(d, int) for d in val.shape):
            return None  # symbolic shapes: nothing concrete to test at this site
        values[name] = val
    device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), "cpu")
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
    for i, (w, g) in enumerate(zip(want, got)):
        if w.shape != g.shape or w.dtype != g.dtype:
            return f"output {i}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
        tol = pattern.tolerance.get(w.dtype, 0.0)
        if w.is_floating_point():
            err = float((g.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30))
            if not err <= tol:
                return f"output {i}: relative error {err:.3g} > {tol:.3g}"
        elif not torch.equal(w, g):
            return f"output {i}: integer outputs differ"
    return None


def tensor_meta(node: Any) -> torch.Tensor | None:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


__all__ = ["Hit", "NearMiss", "Pattern", "RewriteReport", "apply_patterns", "module_path", "tensor_meta"]


def with_signature(fn: Callable[..., Any], names: Sequence[str]) -> Callable[..., Any]:
    """fn(*args) with a named signature, for variants whose argument count is a parameter
    (the tracer and the matcher name the pattern's inputs by the signature)."""

    def wrapper(*args):
        return fn(*args)

    wrapper.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    wrapper.__name__ = getattr(fn, "__name__", "fn")
    return wrapper
