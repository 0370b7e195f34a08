"""`k3compile diff`: what the k3 backend did to a model's decode graph, layer template by template.

    k3compile diff --config tiny --batch 2            # or: python -m k3compile.diff ...
    k3compile diff --model mypkg.models:factory --html out/
    k3compile diff --config tiny --stages normalize fuse

The tool compiles the model with `backend="k3"` (executor "aten" unless told otherwise), reads what
the backend's observer recorded (`k3compile.backend.last_compiled()`), and reports per bucket:

* layer templates: the layers grouped by a Weisfeiler-Lehman hash of their kernel graph (the
  nodes whose module path is `...layers.N...`, views contracted, op names as labels), and the
  layers that deviate from their template (first/last layer, a layer where a pattern missed);
* per template: op histogram before/after, fused ops, kernels before -> after (`KERNEL_RULE`),
  every matched site (module path, pattern), near misses with the failing condition, stream
  assignment and prefetch points when the pipeline made any, and the bucket guards;
* `--stages A B`: op histogram and unified text diff between any two pipeline stages.

The exit status is 1 when a bucket's fusion contract is not met, so CI can gate on it. The API:
`run(...) -> DiffReport`, `analyze(compiled) -> DiffReport`, `format_text`, `write_html`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import difflib
import html
import importlib
import os
import pickle
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import networkx as nx
import torch
from torch import fx

from k3compile import backend
from k3compile.stages.contract import NEUTRAL, layer_templates
from k3compile.settings import Options
from k3compile.observe import Observer
from k3compile.rewrite import Hit, module_path

KERNEL_RULE = ("kernels: one per call of an ATen/prims/k3/collective op other than views and "
               "metadata (view, reshape, permute, expand, slice, select, split, [un]squeeze, "
               "transpose, alias, detach, empty) and stream events (wait_tensor, stream_fork, "
               "stream_join); Python operators (getitem, SymInt math) launch nothing. An upper "
               "bound (Inductor fuses pointwise chains): read the change, not the level.")

_NO_LAUNCH = frozenset({
    "view", "reshape", "_unsafe_view", "permute", "unsqueeze", "squeeze", "expand", "slice",
    "select", "split", "split_with_sizes", "unbind", "t", "transpose", "alias", "detach",
    "as_strided", "empty", "empty_like", "empty_strided", "sym_size", "sym_stride", "sym_numel",
    "wait_tensor", "stream_fork", "stream_join"})  # the last three: events, not launches
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_SYNC = re.compile(r"fork|join|event|stream")
OUTSIDE = -1  # the pseudo-layer of the nodes outside every layer (embedding, lm_head, state copies)


# ---- capture: the graph each bucket enters the pipeline with ------------------------------------

class _InputObserver(Observer):
    """The backend's observer, also keeping the graph each bucket enters the first stage with
    (the stages rewrite the graph in place, so the per-layer 'before' needs a copy)."""

    def __init__(self, keep_graphs: bool = True):
        super().__init__(keep_graphs)
        self.inputs: dict[int | None, tuple[fx.Graph, str]] = {}

    def run(self, name, stage, gm, ctx):
        if not self.records.get(ctx.batch):
            text = gm.print_readable(print_output=False) if self.keep_graphs else ""
            self.inputs[ctx.batch] = (copy.deepcopy(gm.graph), text)
        return super().run(name, stage, gm, ctx)


@contextlib.contextmanager
def capture() -> Iterator[None]:
    """Compile inside this to give `analyze` the pre-pipeline graphs (per-layer 'before')."""
    with mock.patch.object(backend, "Observer", _InputObserver):
        yield


# ---- the report as data (plain values: it crosses process boundaries for world size > 1) ---------

@dataclasses.dataclass
class DrawNode:
    name: str
    label: str
    inputs: tuple[str, ...]  # the launches it reads, through views
    type: str
    status: str  # "kept", "removed" (before only), "new" (after only)


@dataclasses.dataclass
class Miss:
    """A near miss: the engine's record (`rewrite.NearMiss`) with its reason made readable, or
    one the tool found where the contract fell short and the engine recorded none."""

    layer: int
    module: str
    node: str
    pattern: str
    reason: str  # which node, which condition
    kind: str  # the reason without node names and sizes: what groups sites in the terminal
    source: str  # "engine", or "diff" (found by this tool)

    @property
    def family(self) -> str:
        return self.pattern.split("[")[0].split(" ")[0]


@dataclasses.dataclass
class PrefetchPoint:
    op: str
    module: str
    weights: list[str]  # parameter names where known
    nbytes: int | None
    before: str  # the wait or fused collective it overlaps
    stream: int = 0  # a side stream where it runs beside a fused collective

    def text(self, limit: int | None = None) -> str:
        names = [w.replace("language_model.model.", "") for w in self.weights]
        shown = ", ".join(names[:limit]) + (f", +{len(names) - limit} more"
                                            if limit and len(names) > limit else "")
        size = f", {self.nbytes / 2**20:.2f} MiB" if self.nbytes is not None else ""
        where = ""
        if self.before:  # a side-stream prefetch runs beside its collective, not before it
            where = (f" beside {self.before} on stream {self.stream}" if self.stream
                     else f" before {self.before}")
        return f"{self.op}{where} @ {self.module}: {len(names)} weights{size} ({shown})"


@dataclasses.dataclass
class LayerInfo:
    index: int
    reads_as: str  # dense / kda_moe / mla_moe / last, from the input graph's module paths
    contract_template: str  # what the contract checked (it reads the fused graph)
    wl_before: str
    wl_after: str
    ops_before: Counter
    ops_after: Counter
    kernels_before: int
    kernels_after: int
    fused: Counter  # k3 op -> count
    hits: list[Hit]
    near_misses: list[Miss]
    reverted: list[str]  # rewrites undone by verify mode: "pattern @ module: error"
    expected: dict[str, int]
    shortfall: dict[str, int]
    streams: Counter  # (stream, op) -> count, side streams only
    sync_ops: list[str]  # fork/join/event ops: "op @ module"
    prefetch: list[PrefetchPoint]


@dataclasses.dataclass
class Template:
    id: str
    name: str  # what most of its layers read as (dense, kda_moe, mla_moe, last)
    layers: list[int]
    wl: str
    representative: int


@dataclasses.dataclass
class StageRow:
    name: str
    seconds: float
    ops_before: int
    ops_after: int


@dataclasses.dataclass
class StageDiff:
    a: str
    b: str
    histogram: list[tuple[str, int, int]]
    unified: list[str]


@dataclasses.dataclass
class BucketReport:
    bucket: int | None
    met: bool
    stages: list[StageRow]
    layers: dict[int, LayerInfo]
    outside: LayerInfo
    templates: list[Template]
    deviations: dict[int, list[str]]
    drawings: dict[int, tuple[list[DrawNode], list[DrawNode]]]
    has_before: bool
    stage_texts: dict[str, str]
    stage_diff: StageDiff | None = None
    deferred: dict[str, str] = dataclasses.field(default_factory=dict)  # op -> why not fused
    pack: str = ""  # stage `pack`'s summary (fused groups' weights stored as one buffer)


@dataclasses.dataclass
class DiffReport:
    source: str
    batches: list[int]
    T: int
    world_size: int
    executor: str
    symbol: str | None
    guards: dict[int, str]
    graphs: int  # Dynamo graphs compiled (more than one: graph breaks)
    seconds: float
    buckets: list[BucketReport]
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def met(self) -> bool:
        return all(b.met for b in self.buckets)

    @property
    def exit_code(self) -> int:
        return 0 if self.met else 1


# ---- graph reading ------------------------------------------------------------------------------

def op_label(node: fx.Node) -> str:
    """The observer's op naming (`pipeline.op_histogram`), Python operators by name."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return str(t).replace("aten.", "").replace(".default", "")
    return getattr(t, "__name__", str(t))


def launches(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname not in _NO_LAUNCH
    return isinstance(t, torch._ops.HigherOrderOperator)


def _layer_index(path: str) -> int:
    m = _LAYER.search(path)
    if m:
        return int(m.group(1))
    return OUTSIDE  # the final depth mix + norm too: the model's, not a layer's (contract.FINAL)


def _suffix(module: str) -> str:
    """The module path below the layer (`self_attn.q_proj`; `(layer)`: the layer's own code)."""
    m = _LAYER.search(module)
    return (module[m.end():] or "(layer)") if m else module or "(top)"


def _split_layers(graph: fx.Graph) -> dict[int, list[fx.Node]]:
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    out: dict[int, list[fx.Node]] = collections.defaultdict(list)
    for n in nodes:
        out[_layer_index(module_path(n))].append(n)
    return out


def _kernel_graph(nodes: list[fx.Node]) -> nx.DiGraph:
    """The launches of one layer, edges followed through the views between them."""
    inside, memo = set(nodes), {}
    graph = nx.DiGraph()

    def sources(a: fx.Node) -> list[fx.Node]:
        if a not in memo:
            memo[a] = ([] if a not in inside else [a] if launches(a) else
                       [s for b in a.all_input_nodes for s in sources(b)])
        return memo[a]

    for n in nodes:
        if launches(n):
            graph.add_node(n.name, label=op_label(n))
            for a in n.all_input_nodes:
                for s in sources(a):
                    graph.add_edge(s.name, n.name)
    return graph


def _wl(nodes: list[fx.Node]) -> str:
    graph = _kernel_graph(nodes)
    with warnings.catch_warnings():  # networkx >= 3.5 notes that its directed hashes changed
        warnings.simplefilter("ignore", UserWarning)
        return nx.weisfeiler_lehman_graph_hash(graph, node_attr="label", iterations=3)[:8]


def _type(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
                               for v in val if isinstance(v, torch.Tensor)) + ")"
    return ""


def _describe(node: fx.Node) -> str:
    where = module_path(node)
    return f"{node.name} ({op_label(node)} {_type(node)}{' @ ' + where if where else ''})"


def _input_names(compiled, graph: fx.Graph) -> dict[str, str]:
    """ATen placeholder -> the parameter or buffer it is (`layers.1.mlp.experts.w1_packed`):
    the ATen graph takes the Dynamo graph's inputs in order."""
    ours = [n.name for n in graph.nodes if n.op == "placeholder"]
    if len(ours) != len(compiled.inputs):
        return {}
    out = {}
    for name, inp in zip(ours, compiled.inputs):
        dotted = re.sub(r"^l_self_(modules_)?|^l_", "", inp.name).rstrip("_")
        out[name] = re.sub(r"_(modules|parameters|buffers)_", ".", dotted)
    return out


def _stream_info(nodes: list[fx.Node], inputs: dict[str, str]) -> tuple[Counter, list, list]:
    """Side-stream ops (meta['k3_stream']), stream fork/join/event ops, prefetch points."""
    streams, sync, prefetch = Counter(), [], []
    for n in nodes:
        label = op_label(n)
        stream = n.meta.get("k3_stream")
        if stream not in (None, 0, "main", "default"):
            streams[(str(stream), label)] += 1
        if "prefetch" in label:
            meta = n.meta.get("k3_prefetch") or {}
            names = meta.get("weights") or [a.name for a in n.all_input_nodes]
            prefetch.append(PrefetchPoint(label, module_path(n) or "?",
                                     [inputs.get(w, w) for w in names], meta.get("bytes"),
                                     meta.get("before", ""), meta.get("stream", 0)))
        elif _SYNC.search(label) and label != "wait_tensor":
            sync.append(f"{label} @ {module_path(n) or '?'}")
    return streams, sync, prefetch


def _drawing(before: list[fx.Node], after: list[fx.Node]) -> tuple[list[DrawNode], list[DrawNode]]:
    """The layer's kernel graphs, before and after; nodes the pipeline removed or added marked
    (rewrites edit the graph in place, so a node keeps its name across the stages)."""

    def draw(nodes, other, gone):
        names, graph = {n.name for n in other}, _kernel_graph(nodes)
        return [DrawNode(n.name, op_label(n), tuple(graph.predecessors(n.name)), _type(n),
                         "kept" if n.name in names else gone)
                for n in nodes if launches(n)]

    return draw(before, after, "removed"), draw(after, before, "new")


# ---- near misses: the engine's, made readable, and the ones it did not record --------------------

_FUNCTION_MISMATCH = re.compile(r"^function_mismatch: node=([^,]+), pattern=\w+\(([\w.]+)")
_MULTIPLE_USERS = re.compile(r"^multiple_users \w+\(([\w.]+)")
_SIZES = re.compile(r"\[[\d, ]*\]|\b\d+\b")

# Reasons come as (reason, kind): the kind leaves out node names and sizes, so that sites failing
# alike group together in the terminal.


def _mismatch(node: Any, expected: str) -> tuple[str, str]:
    if isinstance(node, fx.Node):
        return (f"function_mismatch: {_describe(node)} where the pattern expects {expected}",
                f"function_mismatch: a {op_label(node)} where the pattern expects {expected}")
    return (f"function_mismatch: the constant {node!r} where the pattern expects {expected}",
            f"function_mismatch: a constant where the pattern expects {expected}")


def _tidy(reason: str, nodes: dict[str, fx.Node]) -> tuple[str, str]:
    """The engine prints Inductor's FailedMatch with the whole pattern; name the node instead."""
    if m := _FUNCTION_MISMATCH.match(reason):
        return _mismatch(nodes.get(m[1], m[1]), m[2])
    if m := _MULTIPLE_USERS.match(reason):
        text = f"multiple_users: a {m[1]} the pattern would absorb is also used outside it"
        return text, text
    return _one_line(reason)


def _one_line(reason: str) -> tuple[str, str]:
    if reason.startswith("args_structure"):  # two printed TreeSpecs, many lines
        text = ("args_structure: the arguments are structured unlike the pattern's (another "
                "list length: another variant's site)")
        return text, text
    reason = " ".join(reason.split())
    return reason, _SIZES.sub("#", reason)


def _bfs(node: fx.Node, max_depth: int) -> dict[fx.Node, int]:
    """The node's inputs, transitively, up to max_depth edges away, with their distance."""
    dist, todo = {node: 0}, collections.deque([node])
    while todo:
        n = todo.popleft()
        if dist[n] >= max_depth:
            continue
        for a in n.all_input_nodes:
            if a not in dist:
                dist[a] = dist[n] + 1
                todo.append(a)
    return dist


def _depth(pattern) -> int:
    """The longest input-to-output path of the pattern's search graph."""
    pattern.expr  # noqa: B018 (traces the search graph)
    depth: dict[fx.Node, int] = {}
    for n in pattern._search_gm.graph.nodes:
        depth[n] = 1 + max((depth[a] for a in n.all_input_nodes), default=-1)
    return max(depth.values(), default=0)


def _resembles(pattern, cone: dict[fx.Node, int]) -> bool:
    """The engine's test (every distinctive op, 85% of the pattern's ops) on the anchor's inputs
    as deep as the pattern reaches. (The engine cuts its cone at the pattern's node count, depth
    first, which on a wide graph can wander off into the producers and miss the site.)"""
    reach = _depth(pattern) + 2
    have = Counter(getattr(n.target, "_opname", "") for n, d in cone.items()
                   if d <= reach and n.op == "call_function")
    want = pattern.op_signature
    if any(have[k] < want[k] for k in pattern.distinctive):
        return False
    return sum(min(v, have[k]) for k, v in want.items()) >= 0.85 * sum(want.values())


def _failure(failed: Any, anchor: fx.Node) -> tuple[str, str, int]:
    """A FailedMatch as (reason, kind) and how deep the match got before it failed."""
    head = getattr(failed, "format_string", "").split(":")[0].split(" ")[0] or "no match"
    args = getattr(failed, "args", ())
    dist = _bfs(anchor, 64)
    if head == "function_mismatch" and len(args) == 2:
        node, pat = args
        fns = "/".join(str(f) for f in getattr(pat, "fns", ()))
        return (*_mismatch(node, fns), dist.get(node, 1) if isinstance(node, fx.Node) else 1)
    if head == "multiple_users" and args:
        fns = set(getattr(args[0], "fns", ()))
        for n, d in sorted(dist.items(), key=lambda kv: kv[1]):
            if d and n.op == "call_function" and n.target in fns and len(n.users) > 1:
                users = ", ".join(u.name for u in n.users)
                tail = "users; an intermediate the pattern would absorb is also used outside it"
                reason = f"multiple_users: {_describe(n)} has {len(n.users)} {tail} ({users})"
                return reason, f"multiple_users: a {op_label(n)} has {len(n.users)} {tail}", d
    text = str(failed)
    return (*_one_line(text if len(text) < 200 else text[:197] + "..."), 1)


def _match_outcome(p, m, options: Options, bucket: int | None, hits: dict[str, str]) -> str:
    """Why a pattern that matches the site did not fire."""
    if not options.pattern_enabled(p.name):
        return "pattern disabled by options (disabled_patterns)"
    if p.buckets and bucket is not None and not p.buckets[0] <= bucket <= p.buckets[1]:
        return f"bucket {bucket} is outside the pattern's buckets {p.buckets}"
    refused = p.check(m) if p.check else None
    if refused:
        return f"check refused: {refused}"
    taken = sorted({hits[n.name] for n in m.nodes if n.name in hits})
    if taken:
        return f"matches the input graph, but {', '.join(taken)} rewrote part of the site first"
    return "matches the input graph but did not fire"


def _explain(layer: int, nodes: list[fx.Node], family: list, options: Options,
             bucket: int | None, hits: dict[str, str], sites: set[str]) -> list[Miss]:
    """Try every pattern of a missing op at the anchors of the layer in the graph the pipeline
    received (read only: the site as the patterns first saw it); keep the attempts that got
    furthest, one record per site and failure. `hits`: rewritten anchor node -> pattern;
    `sites`: the modules (below the layer) where the family fired in other layers, which narrow
    the anchors to the sites that should have fused (all anchors when it fired nowhere)."""
    tries, reach = [], max(map(_depth, family), default=0) + 2
    names = {p.name for p in family}
    cones: dict[fx.Node, dict[fx.Node, int]] = {}
    where = [n for n in nodes if _suffix(module_path(n)) in sites] or nodes
    for p in family:
        anchors = p.anchors
        for node in where:
            if node.target not in anchors:
                continue
            m = p.expr.match(node)
            if m and any(hits.get(n.name) in names for n in m.nodes):
                continue  # the family did fire here
            if m:
                outcome = _match_outcome(p, m, options, bucket, hits)
                tries.append((1000 + len(m.nodes), p.name, node, (outcome, outcome)))
                continue
            cone = cones.get(node) or cones.setdefault(node, _bfs(node, reach))
            if _resembles(p, cone):
                reason, kind, depth = _failure(m, node)
                tries.append((depth, p.name, node, (reason, kind)))
    best = max((t[0] for t in tries), default=None)
    sites: dict[tuple[fx.Node, tuple[str, str]], list[str]] = collections.defaultdict(list)
    for depth, name, node, reason in tries:
        if depth == best:
            sites[(node, reason)].append(name)
    return [Miss(layer, module_path(node), node.name,
                 names[0] + (f" (+{len(names) - 1} variants)" if len(names) > 1 else ""),
                 reason, kind, "diff")
            for (node, (reason, kind)), names in sites.items()]


# ---- analysis -----------------------------------------------------------------------------------

# fused ops whose patterns match another k3 op (no site in the input graph): a missing one is
# explained by its base op's patterns too
BUILDS_ON = {"oproj_attn_res_mix_norm": "attn_res_mix_norm",
             "allreduce_attn_res_mix_norm": "attn_res_mix_norm", "fb_kda_decode": "kda_decode"}


def _patterns_of(op: str) -> list:
    from k3compile.patterns import all_patterns

    ops = {op, BUILDS_ON.get(op, op)}
    return [p for p in all_patterns() if p.op.split(".")[-1] in ops]


def _layer_info(index, names, before, after, hits, misses, reverted, lr, inputs) -> LayerInfo:
    streams, sync, prefetch = _stream_info(after, inputs)
    fused = Counter(op_label(n)[3:] for n in after if op_label(n).startswith("k3."))
    return LayerInfo(
        index=index, reads_as=names[0], contract_template=lr.template if lr else names[1],
        wl_before=_wl(before) if before is not None else "", wl_after=_wl(after),
        ops_before=Counter(op_label(n) for n in before) if before is not None else Counter(),
        ops_after=Counter(op_label(n) for n in after),
        kernels_before=sum(map(launches, before)) if before is not None else 0,
        kernels_after=sum(map(launches, after)), fused=fused, hits=hits, near_misses=misses,
        reverted=reverted,
        expected=dict(lr.expected) if lr else {}, shortfall=dict(lr.shortfall) if lr else {},
        streams=streams, sync_ops=sync, prefetch=prefetch)


def _templates(layers: dict[int, LayerInfo], has_before: bool) -> list[Template]:
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for i, info in sorted(layers.items()):
        groups[info.wl_before if has_before else info.wl_after].append(i)
    out = []
    for k, (wl, members) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0]), 1):
        name = Counter(layers[i].reads_as for i in members).most_common(1)[0][0]
        fused_alike = Counter(layers[i].wl_after for i in members)
        # the representative: fused like most of its template, then the most fused (a plain GEMM,
        # NEUTRAL, is no fusion: a layer that lost one has more of them), fewest misses
        rep = max(members, key=lambda i: (fused_alike[layers[i].wl_after],
                                          sum(n for op, n in layers[i].fused.items()
                                              if op not in NEUTRAL),
                                          -len(layers[i].near_misses), -i))
        out.append(Template(f"T{k}", name, members, wl, rep))
    return out


def _hist_delta(a: Counter, b: Counter, limit: int = 6) -> str:
    """'+1 add.Tensor, -2 mm, ...': b against a, largest changes first."""
    rows = sorted(((op, b[op] - a[op]) for op in set(a) | set(b) if a[op] != b[op]),
                  key=lambda r: (-abs(r[1]), r[0]))
    parts = [f"{d:+d} {_pretty(op)}" for op, d in rows[:limit]]
    more = f" (+{len(rows) - limit} more)" if len(rows) > limit else ""
    return (", ".join(parts) + more) or "no op difference"


def _deviations(layers: dict[int, LayerInfo], templates: list[Template],
                misread: dict[int, tuple[str, str]]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = collections.defaultdict(list)
    first, last = min(layers, default=0), max(layers, default=0)
    for t in templates:
        if len(t.layers) == 1:
            i = t.layers[0]
            if i in (first, last):
                out[i].append(f"{'first' if i == first else 'last'} layer: a structure of its own "
                              f"({t.id}, {t.name})")
            for u in templates:
                if u is not t and u.name == t.name and len(u.layers) > 1:
                    diff = _hist_delta(layers[u.representative].ops_before, layers[i].ops_before)
                    out[i].append(f"structure differs from {u.id} ({u.name}, layers "
                                  f"{_ranges(u.layers)}): {diff}")
        rep = layers[t.representative]
        for i in t.layers:
            if layers[i].wl_after != rep.wl_after:
                diff = _hist_delta(rep.fused, layers[i].fused)
                out[i].append(f"fused differently from layer {rep.index} of {t.id}: k3 ops {diff}")
    for i, (before, final) in misread.items():
        out[i].append(f"the contract read this layer as {final!r} from the fused graph; before "
                      f"the pipeline its modules read as {before!r}")
    for i, info in layers.items():
        if info.shortfall:
            why = Counter(m.family for m in info.near_misses if m.family in info.shortfall)
            out[i].append(f"contract shortfall: missing {info.shortfall}; near misses: "
                          f"{dict(why) or 'none recorded'}")
    return dict(sorted(out.items()))


def _ranges(xs: Sequence[int]) -> str:
    xs, parts, i = sorted(xs), [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def _rewrites_by_layer(rewrites, final: fx.Graph):
    """The engine's hits, near misses (reasons made readable) and reverted rewrites per layer."""
    nodes = {n.name: n for n in final.nodes}
    hits, misses, reverted = (collections.defaultdict(list) for _ in range(3))
    for h in getattr(rewrites, "hits", ()):
        hits[_layer_index(h.module)].append(h)
    for nm in getattr(rewrites, "near_misses", ()):
        i, (reason, kind) = _layer_index(nm.module), _tidy(nm.reason, nodes)
        misses[i].append(Miss(i, nm.module, nm.node, nm.pattern, reason, kind, "engine"))
    for r in getattr(rewrites, "reverted", ()):
        reverted[_layer_index(r.module)].append(f"{r.pattern} @ {r.module}: {r.error}")
    return hits, misses, reverted


def _bucket_report(compiled, bucket) -> BucketReport:
    obs = compiled.observer
    final = obs.graphs[bucket]
    before_graph, before_text = getattr(obs, "inputs", {}).get(bucket, (None, ""))
    has_before = before_graph is not None
    after = _split_layers(final)
    before = _split_layers(before_graph) if has_before else {}
    contract = compiled.contracts.get(bucket)
    plan = {lr.layer: lr for lr in contract.layers} if contract else {}
    hits, misses, reverted = _rewrites_by_layer(obs.reports.get(bucket), final)
    rewritten = {h.node: h.pattern for hs in hits.values() for h in hs}
    for i, lr in plan.items():
        for op in lr.shortfall:
            family = _patterns_of(op)
            names = {p.name for p in family}
            if any(m.pattern in names for m in misses[i]):
                continue
            sites = {_suffix(h.module) for hs in hits.values() for h in hs if h.pattern in names}
            nodes = (before.get(i) if has_before else after.get(i)) or []
            misses[i] += _explain(i, nodes, family, compiled.options, bucket, rewritten, sites)
    names = layer_templates(final)
    # the contract reads templates off the fused graph; the input graph still has every module
    read_before = layer_templates(before_graph) if has_before else names
    misread = {i: (read_before[i], n) for i, n in names.items() if read_before.get(i, n) != n}
    inputs = _input_names(compiled, final)
    names.pop(OUTSIDE, None)  # the contract's FINAL row is the outside row's plan
    layers = {i: _layer_info(i, (read_before.get(i, "?"), names.get(i, "?")),
                             before.get(i, []) if has_before else None,
                             after[i], hits[i], misses[i], reverted[i], plan.get(i), inputs)
              for i in sorted(after) if i != OUTSIDE}
    outside = _layer_info(OUTSIDE, ("", ""), before.get(OUTSIDE, []) if has_before else None,
                          after.get(OUTSIDE, []), hits[OUTSIDE], misses[OUTSIDE],
                          reverted[OUTSIDE], plan.get(OUTSIDE), inputs)
    templates = _templates(layers, has_before)
    drawings = {t.representative: _drawing(before.get(t.representative, []),
                                           after[t.representative])
                for t in templates if has_before}
    records = obs.records.get(bucket, [])
    texts = {"input": before_text} if before_text else {}
    texts.update({r.name: r.graph_after for r in records})
    return BucketReport(
        deferred=dict(getattr(obs.reports.get(bucket), "deferred", {}) or {}),
        pack=str(obs.notes.get(bucket, {}).get("pack", "")),
        bucket=bucket, met=contract.met if contract else True,
        stages=[StageRow(r.name, r.seconds, sum(r.ops_before.values()), sum(r.ops_after.values()))
                for r in records],
        layers=layers, outside=outside, templates=templates,
        deviations=_deviations(layers, templates, misread), drawings=drawings,
        has_before=has_before, stage_texts=texts)


def stage_diff(bucket: BucketReport, compiled, a: str, b: str) -> StageDiff:
    """Op histogram and unified text diff between the graphs after stages a and b ("input": the
    graph the pipeline received)."""
    if a not in bucket.stage_texts or b not in bucket.stage_texts:
        raise KeyError(f"unknown stage {a if a not in bucket.stage_texts else b!r}; recorded: "
                       f"{', '.join(bucket.stage_texts)}")
    records = compiled.observer.records.get(bucket.bucket, [])
    hists = {"input": records[0].ops_before if records else Counter()}
    hists.update({r.name: r.ops_after for r in records})
    ha, hb = hists[a], hists[b]
    rows = sorted(((op, ha[op], hb[op]) for op in set(ha) | set(hb) if ha[op] != hb[op]),
                  key=lambda r: (-abs(r[2] - r[1]), r[0]))
    unified = list(difflib.unified_diff(bucket.stage_texts[a].splitlines(),
                                        bucket.stage_texts[b].splitlines(),
                                        f"after {a}", f"after {b}", n=1, lineterm=""))
    return StageDiff(a, b, rows, unified)


def analyze(compiled, stages: tuple[str, str] | None = None, source: str = "") -> DiffReport:
    """The report of an already compiled `K3Compiled` (compile it inside `capture()` for the
    per-layer 'before' columns)."""
    buckets = []
    for bucket in compiled.contracts:
        if bucket not in compiled.observer.graphs:
            continue
        br = _bucket_report(compiled, bucket)
        if stages:
            br.stage_diff = stage_diff(br, compiled, *stages)
        buckets.append(br)
    notes = []
    if not any(b.has_before for b in buckets):
        notes.append("no pre-pipeline graph was captured (compile inside k3compile.diff.capture()):"
                     " 'before' columns are empty")
    return DiffReport(
        source=source or type(compiled.gm).__name__, batches=list(compiled.contracts), T=1,
        world_size=1, executor=compiled.options.executor,
        symbol=str(compiled.symbol) if compiled.symbol is not None else None,
        guards={b: str(g) for b, g in compiled.guards.items()}, graphs=1, seconds=0.0,
        buckets=buckets, notes=notes)


# ---- compiling the model ------------------------------------------------------------------------

@dataclasses.dataclass
class Spec:
    config: str | None = "tiny"
    model: str | None = None  # "module:factory" -> (model, example_inputs)
    batches: tuple[int, ...] = (2,)
    T: int = 1
    world_size: int = 1
    layers: int | None = None
    dtype: str = "bfloat16"
    options: dict = dataclasses.field(default_factory=dict)
    stages: tuple[str, str] | None = None
    device: str = "cpu"


def _builtin(spec: Spec, group, world_size: int):
    from k3compile.models import build_model, get_config

    cfg = get_config(spec.config, world_size if world_size > 1 else None)
    if spec.layers:
        cfg = cfg.with_layers(spec.layers)
    device = torch.device(spec.device)
    model = build_model(cfg, device=device, dtype=getattr(torch, spec.dtype), group=group,
                        max_batch=max(spec.batches), max_seq_len=64 + spec.T)
    calls = []
    gen = torch.Generator().manual_seed(0)
    for b in spec.batches:
        shape = (b,) if spec.T == 1 else (b, spec.T)
        ids = torch.randint(0, cfg.vocab_size, shape, generator=gen).to(device)
        pos = torch.zeros(b, dtype=torch.long, device=device)
        slots = torch.arange(b, device=device)
        for t in (ids, pos, slots):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        calls.append(((ids, pos, slots), {}))
    return model, calls


def _factory(spec: Spec):
    module, _, name = spec.model.partition(":")
    if not name:
        raise ValueError(f"--model wants module:factory, got {spec.model!r}")
    model, example = getattr(importlib.import_module(module), name)()
    call = ((), dict(example)) if isinstance(example, dict) else (tuple(example), {})
    return model, [call]


def _compile(spec: Spec, group=None, world_size: int = 1) -> DiffReport:
    model, calls = _factory(spec) if spec.model else _builtin(spec, group, world_size)
    options = {**spec.options, "strict": False, "keep_graphs": True}
    options.setdefault("executor", "aten")
    torch._dynamo.reset()  # a model compiled before in this process would hit Dynamo's cache
    backend.ensure_registered()
    n0 = len(backend._compiled)
    t0 = time.perf_counter()
    failed = None
    with capture(), torch.no_grad():
        compiled_model = torch.compile(model, backend="k3", fullgraph=spec.model is None,
                                       options=options)
        for args, kwargs in calls:
            try:
                compiled_model(*args, **kwargs)
            except Exception as e:  # report what compiled, then say it failed
                if len(backend._compiled) == n0:
                    raise
                failed = f"the compiled graph failed at run time: {type(e).__name__}: {e}"[:400]
                break
    seconds = time.perf_counter() - t0
    new = backend._compiled[n0:]
    if not new:
        raise RuntimeError("the model compiled no graph with backend='k3'")
    cut = f" (first {spec.layers} layers)" if spec.layers else ""
    source = spec.model or f"config {spec.config}{cut}"
    batches = [int(a[0].shape[0]) if a and isinstance(a[0], torch.Tensor) else 0 for a, _ in calls]
    if spec.model is None:
        # fullgraph: several graphs are recompiles (Dynamo specialises batch 1): one per bucket
        reports = [analyze(c, spec.stages) for c in new]
        report = reports[0]
        for other in reports[1:]:
            report.buckets += other.buckets
            report.guards = report.guards or other.guards
            report.symbol = report.symbol or other.symbol
    else:  # with graph breaks the decode step is the graph with the most nodes
        report = analyze(max(new, key=lambda c: len(c.gm.graph.nodes)), spec.stages)
        if len(new) > 1:
            report.notes.append(f"{len(new)} graphs compiled (graph breaks or recompiles); "
                                "reporting the largest")
    report.source, report.batches, report.T = source, batches, spec.T
    report.world_size, report.graphs, report.seconds = world_size, len(new), seconds
    if failed:
        report.notes.append(failed)
    return report


def _worker(rank: int, spec: Spec, port: int, out: str):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=spec.world_size)
    try:
        report = _compile(spec, dist.group.WORLD, spec.world_size)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(report))
    finally:
        dist.destroy_process_group()


def run(config: str | None = "tiny", model: str | None = None, batch: int | Sequence[int] = 2,
        T: int = 1, world_size: int = 1, layers: int | None = None, dtype: str = "bfloat16",
        options: dict | None = None, stages: tuple[str, str] | None = None,
        device: str = "cpu") -> DiffReport:
    """Compile a built-in config (or `module:factory`) with backend "k3" and report.

    With world_size > 1 every rank compiles its tensor-parallel slice under gloo and rank 0
    reports; a factory then runs in every rank, after the process group is up
    (`torch.distributed.group.WORLD`). Resets Dynamo's caches first."""
    batches = (batch,) if isinstance(batch, int) else tuple(batch)
    spec = Spec(config, model, batches, T, world_size, layers, dtype, dict(options or {}),
                tuple(stages) if stages else None, device)
    if world_size <= 1:
        return _compile(spec)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.pkl")
        mp.spawn(_worker, args=(spec, port, out), nprocs=world_size, join=True)
        report = pickle.loads(Path(out).read_bytes())
    report.notes.append(f"world size {world_size}: gloo on CPU, rank 0's graph shown")
    return report


# ---- terminal report ----------------------------------------------------------------------------

class _Style:
    CODES: ClassVar[dict[str, str]] = {
        "bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}

    def __init__(self, color: bool):
        self.color = color

    def __call__(self, text: str, *styles: str) -> str:
        if not self.color or not styles:
            return text
        return "".join(f"\033[{self.CODES[s]}m" for s in styles) + text + "\033[0m"


def _pretty(op: str) -> str:
    return re.sub(r"<built-in function (\w+)>", r"\1", op)


def _hist_rows(a: Counter, b: Counter, changed_only: bool) -> list[tuple[str, int, int]]:
    rows = [(op, a[op], b[op]) for op in set(a) | set(b) if not changed_only or a[op] != b[op]]
    return sorted(rows, key=lambda r: (-abs(r[2] - r[1]), -r[1], r[0]))


def format_text(report: DiffReport, color: bool | None = None, max_diff_lines: int = 120) -> str:
    """The terminal report; colour when `color` (default: stdout is a TTY and NO_COLOR unset)."""
    if color is None:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    s = _Style(color)
    out = [s(f"k3compile diff: {report.source}", "bold") +
           f"  batch {','.join(map(str, report.batches))}, T={report.T}, "
           f"world size {report.world_size}, executor {report.executor}",
           f"compiled {report.graphs} graph(s) in {report.seconds:.1f} s"]
    out += [s(f"note: {n}", "yellow") for n in report.notes]
    out.append(_guards_text(report, s))
    for b in report.buckets:
        out += _bucket_text(b, s, max_diff_lines)
    verdict = s("met", "green") if report.met else s("NOT met", "red", "bold")
    out.append(s(f"\n{KERNEL_RULE}", "dim"))
    out.append(f"fusion contract: {verdict} (exit status {report.exit_code})")
    return "\n".join(out)


def _guards_text(report: DiffReport, s) -> str:
    compiled = {b.bucket for b in report.buckets}
    if not report.guards:
        return f"bucket guards: none (a static graph: Dynamo guards the batch, {sorted(compiled)})"
    parts = [s(f"{k}: {g}", "bold") if k in compiled else f"{k}: {g}"
             for k, g in report.guards.items()]
    return f"bucket guards on {report.symbol} (compiled in bold): " + " | ".join(parts)


def _bucket_text(b: BucketReport, s, max_diff_lines: int) -> list[str]:
    out = [s(f"\n=== bucket {b.bucket}: fusion contract {'met' if b.met else 'NOT met'} ===",
             "bold", "green" if b.met else "red")]
    out.append("stages: " + "  ".join(f"{r.name} {r.seconds:.2f}s ({r.ops_before}->{r.ops_after})"
                                      for r in b.stages) + "  (seconds, ops before->after)")
    if b.deferred:
        out.append(s("left unfused on this device: ", "yellow") + ", ".join(
            f"{op} ({why})" for op, why in sorted(b.deferred.items())))
    if b.pack:
        out.append(f"weights: {b.pack}")
    out.append(s("\nlayers", "bold") + "  (kernels: the rule at the end)")
    out.append(f"  {'layer':>5}  {'template':<13} {'kernels':>13}  {'k3 ops':>6}  plan")
    for i, L in b.layers.items():
        tid = next(t.id for t in b.templates if i in t.layers)
        planned = sum(L.expected.values())
        done = sum(min(L.fused[op], n) for op, n in L.expected.items())
        plan = (s(f"{done}/{planned} MISSING {L.shortfall}", "red") if L.shortfall
                else f"{done}/{planned}" if planned else "-")
        out.append(f"  {i:>5}  {tid:<4} {L.contract_template:<8} {L.kernels_before:>5} -> "
                   f"{L.kernels_after:<5} {sum(L.fused.values()):>6}  {plan}")
    o = b.outside
    out.append(f"  {'other':>5}  {'':<13} {o.kernels_before:>5} -> {o.kernels_after:<5} "
               f"{sum(o.fused.values()):>6}  (embedding, final mix + norm, lm_head, state write-back)")
    when = "before the pipeline" if b.has_before else "after the pipeline (no input captured)"
    out.append(s("\nlayer templates", "bold") + "  (Weisfeiler-Lehman hash of each layer's kernel "
               f"graph {when}: op names as labels, views contracted)")
    for t in b.templates:
        rep = b.layers[t.representative]
        out.append(f"  {t.id:<4} {t.name:<8} layers {_ranges(t.layers):<10} wl {t.wl}  "
                   f"kernels/layer {rep.kernels_before} -> {rep.kernels_after}")
    if b.deviations:
        out.append(s("deviating layers", "bold"))
        for i, reasons in b.deviations.items():
            for r in reasons:
                out.append(f"  layer {i}: " + (s(r, "red") if "shortfall" in r else r))
    for t in b.templates:
        out += _template_text(b, t, s)
    if b.stage_diff:
        out += _stage_diff_text(b.stage_diff, s, max_diff_lines)
    return out


def _miss_groups(misses: list[Miss]) -> list[tuple[str, list[Miss]]]:
    """Near misses grouped by pattern family and failure kind, largest group first."""
    groups: dict[tuple[str, str], list[Miss]] = collections.defaultdict(list)
    for m in misses:
        groups[(m.family, m.kind)].append(m)
    return sorted(((f"{fam}: {kind}", ms) for (fam, kind), ms in groups.items()),
                  key=lambda g: (-len(g[1]), g[0]))


def _sites(misses: list[Miss], limit: int = 6) -> str:
    by_layers: dict[str, list[str]] = collections.defaultdict(list)
    per_site = collections.defaultdict(set)
    for m in misses:
        per_site[_suffix(m.module)].add(m.layer)
    for site, layers in per_site.items():
        by_layers[_ranges(sorted(layers))].append(site)
    parts = []
    for layers, sites in by_layers.items():
        more = f" +{len(sites) - limit} more" if len(sites) > limit else ""
        parts.append(f"layer{'s' if len(layers) > 1 else ''} {layers}: "
                     f"{', '.join(sorted(sites)[:limit])}{more}")
    return "; ".join(parts)


def _template_text(b: BucketReport, t: Template, s, max_rows: int = 16) -> list[str]:
    rep = b.layers[t.representative]
    members = [b.layers[i] for i in t.layers]
    out = [s(f"\n--- {t.id} {t.name}: layers {_ranges(t.layers)} (shown: layer {rep.index}) ---",
             "bold", "cyan")]
    out.append(f"  kernels {rep.kernels_before} -> {rep.kernels_after} per layer"
               f"   ops {sum(rep.ops_before.values())} -> {sum(rep.ops_after.values())}")
    fused = ", ".join(f"{op} x{n}" for op, n in sorted(rep.fused.items())) or "none"
    out.append(f"  fused ops produced: {fused}")
    if b.has_before:
        rows = _hist_rows(rep.ops_before, rep.ops_after, changed_only=True)
        same = len(set(rep.ops_before) | set(rep.ops_after)) - len(rows)
        out.append(f"  op histogram before -> after ({len(rows)} ops changed, {same} unchanged):")
        for op, x, y in rows[:max_rows]:
            d = f"{y - x:+d}"
            delta = s(d, "green" if y < x else "yellow")
            out.append(f"    {_pretty(op):<34}{x:>5} -> {y:<5}{delta}")
        if len(rows) > max_rows:
            out.append(s(f"    ... {len(rows) - max_rows} more (HTML report)", "dim"))
    out.append("  matched sites:" + ("" if rep.hits else " none"))
    for h in rep.hits:
        out.append(f"    {h.module:<56} {h.pattern} -> {h.op}")
    if len(members) > 1:
        counts = Counter(h.pattern for L in members for h in L.hits)
        out.append(f"  hits over the template's {len(members)} layers: "
                   + (", ".join(f"{p} x{n}" for p, n in sorted(counts.items())) or "none"))
    misses = [m for L in members for m in L.near_misses]
    grouped = " (grouped by pattern and failure; every record in the HTML report)"
    out.append(f"  near misses: {len(misses) or 'none'}{grouped if misses else ''}")
    for title, group in _miss_groups(misses):
        sites = len({(m.layer, m.node) for m in group})
        out.append(s(f"    {title}", "yellow"))
        out.append(f"      {sites} site(s), {len(group)} record(s): {_sites(group)}")
        ex = group[0]
        found = " (found by k3compile diff: the engine recorded no near miss here)" \
            if ex.source == "diff" else ""
        out.append(s(f"      e.g. layer {ex.layer} [{ex.node}] {ex.pattern}: {ex.reason}{found}",
                     "dim"))
    for r in (r for L in members for r in L.reverted):
        out.append(s(f"  reverted by verify: {r}", "red"))
    if rep.streams or rep.sync_ops:
        side = collections.defaultdict(list)
        for (stream, op), n in sorted(rep.streams.items()):
            side[stream].append(f"{_pretty(op)} x{n}")
        out.append("  streams:")
        out += [f"    stream {k}: {', '.join(ops)}" for k, ops in side.items()]
        out += [f"    {op}" for op in rep.sync_ops]
    else:
        out.append("  streams: all on the main stream (no node carries meta['k3_stream'])")
    out.append("  prefetch:" + ("" if rep.prefetch else " none"))
    out += [f"    {pf.text(limit=4)}" for pf in rep.prefetch]
    return out


def _stage_diff_text(d: StageDiff, s, max_lines: int) -> list[str]:
    out = [s(f"\n--- stages {d.a} -> {d.b} ---", "bold", "cyan")]
    for op, x, y in d.histogram[:24]:
        out.append(f"    {_pretty(op):<34}{x:>5} -> {y:<5}{y - x:+d}")
    if len(d.histogram) > 24:
        out.append(s(f"    ... {len(d.histogram) - 24} more ops changed (HTML report)", "dim"))
    if not d.histogram:
        out.append("    same op histogram")
    shown = d.unified[:max_lines]
    for line in shown:
        style = ("green",) if line.startswith("+") else ("red",) if line.startswith("-") else ()
        out.append(s(line, *style))
    if len(d.unified) > len(shown):
        out.append(f"    ... {len(d.unified) - len(shown)} more diff lines (see --html)")
    return out


# ---- HTML report --------------------------------------------------------------------------------

_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;
text-align:left;font-size:13px}pre{font-size:12px;background:#f7f7f7;padding:8px;overflow:auto}
.side{display:flex;gap:1em}.side>div{flex:1;min-width:0}.bad{color:#b00}.good{color:#070}
.removed{background:#fdd}.new{background:#dfd}.dim{color:#777}"""


def _svg(nodes: list[DrawNode]) -> str | None:
    """Graphviz through pydot when both are installed; None otherwise (text drawing)."""
    try:
        import pydot
    except ImportError:
        return None
    try:
        dot = pydot.Dot(graph_type="digraph", rankdir="TB")
        names = {n.name for n in nodes}
        fill = {"removed": "#ffdddd", "new": "#ddffdd", "kept": "#ffffff"}
        for n in nodes:
            dot.add_node(pydot.Node(n.name, label=f"{n.label}\\n{n.type}", shape="box",
                                    style="filled", fillcolor=fill[n.status], fontsize="9"))
        for n in nodes:
            for a in n.inputs:
                if a in names:
                    dot.add_edge(pydot.Edge(a, n.name))
        svg = dot.create_svg().decode()
        return svg[svg.find("<svg"):]  # without the XML prolog, to sit inside HTML
    except (OSError, AssertionError, ValueError):  # no `dot` binary: the text drawing stands in
        return None


def _text_drawing(nodes: list[DrawNode]) -> str:
    lines = []
    for n in nodes:
        after = f" <- {', '.join(n.inputs)}" if n.inputs else ""
        text = html.escape(f"{n.name} = {n.label}  {n.type}{after}")
        lines.append(f'<span class="{n.status}">{text}</span>' if n.status != "kept" else text)
    return "\n".join(lines)


def _html_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def write_html(report: DiffReport, folder: str | os.PathLike) -> Path:
    """`folder/index.html` (+ one .diff file per stage diff); returns the index path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    e = html.escape
    verdict = '<b class="good">met</b>' if report.met else '<b class="bad">NOT met</b>'
    title = f"k3compile diff: {e(report.source)}"
    parts = [f"<!doctype html><meta charset=utf-8><title>{title}</title>",
             f"<style>{_CSS}</style><h1>k3compile diff: {e(report.source)}</h1>",
             (f"<p>batch {e(','.join(map(str, report.batches)))}, T={report.T}, world size "
              f"{report.world_size}, executor {e(report.executor)}; {report.graphs} graph(s) "
              f"compiled in {report.seconds:.1f} s. Fusion contract: {verdict}.</p>")]
    parts += [f"<p class=bad>{e(n)}</p>" for n in report.notes]
    parts.append(f"<p>{e(_guards_text(report, _Style(False)))}</p>")
    parts.append(f"<p class=dim>{e(KERNEL_RULE)}</p>")
    for b in report.buckets:
        parts += _bucket_html(b, folder)
    (folder / "index.html").write_text("\n".join(parts))
    return folder / "index.html"


def _bucket_html(b: BucketReport, folder: Path) -> list[str]:
    e = html.escape
    verdict = "met" if b.met else "<span class=bad>NOT met</span>"
    out = [f"<h2>bucket {b.bucket}: contract {verdict}</h2>",
           _html_table(["stage", "seconds", "ops before", "ops after"],
                       [(r.name, f"{r.seconds:.3f}", r.ops_before, r.ops_after) for r in b.stages])]
    rows = []
    for i, L in b.layers.items():
        tid = next(t.id for t in b.templates if i in t.layers)
        plan = ", ".join(f"{op} {L.fused[op]}/{n}" for op, n in L.expected.items())
        rows.append((i, f'<a href="#{tid}-{b.bucket}">{tid}</a>', L.contract_template, L.wl_before,
                     L.wl_after, f"{L.kernels_before} &rarr; {L.kernels_after}",
                     e(plan) + (f' <span class=bad>missing {e(str(L.shortfall))}</span>'
                                if L.shortfall else "")))
    out.append(_html_table(["layer", "template", "contract", "wl before", "wl after", "kernels",
                            "plan"], rows))
    if b.deviations:
        out.append("<h3>deviating layers</h3><ul>" + "".join(
            f"<li>layer {i}: {e(r)}</li>" for i, rs in b.deviations.items() for r in rs) + "</ul>")
    for t in b.templates:
        out += _template_html(b, t)
    if b.stage_diff:
        d = b.stage_diff
        name = f"stages_{d.a}_{d.b}_bucket{b.bucket}.diff"
        (folder / name).write_text("\n".join(d.unified) + "\n")
        out.append(f"<h3>stages {e(d.a)} &rarr; {e(d.b)}</h3>")
        out.append(_html_table(["op", d.a, d.b],
                               [(e(_pretty(op)), x, y) for op, x, y in d.histogram]))
        out.append(f'<p><a href="{name}">{name}</a></p><pre>{e(chr(10).join(d.unified))}</pre>')
    return out


def _template_html(b: BucketReport, t: Template) -> list[str]:
    e = html.escape
    rep = b.layers[t.representative]
    members = [b.layers[i] for i in t.layers]
    fused = ", ".join(f"{op} x{n}" for op, n in sorted(rep.fused.items())) or "none"
    out = [(f'<h3 id="{t.id}-{b.bucket}">{t.id} {e(t.name)}: layers {_ranges(t.layers)} '
            f"(wl {t.wl}; shown: layer {rep.index})</h3>"),
           (f"<p>kernels per layer {rep.kernels_before} &rarr; {rep.kernels_after}; "
            f"fused ops: {e(fused)}</p>")]
    if b.has_before:
        rows = _hist_rows(rep.ops_before, rep.ops_after, changed_only=False)
        out.append(_html_table(["op", "before", "after", "change"],
                               [(e(_pretty(op)), x, y, f"{y - x:+d}" if y != x else "")
                                for op, x, y in rows]))
    out.append("<h4>matched sites</h4>" + _html_table(
        ["layer", "module", "pattern", "op", "node"],
        [(L.index, e(h.module), e(h.pattern), e(h.op), e(h.node))
         for L in members for h in L.hits]))
    reverted = [r for L in members for r in L.reverted]
    if reverted:
        out.append("<h4>reverted by verify</h4><ul>"
                   + "".join(f"<li class=bad>{e(r)}</li>" for r in reverted) + "</ul>")
    misses = [(L.index, nm) for L in members for nm in L.near_misses]
    out.append("<h4>near misses</h4>" + (_html_table(
        ["layer", "module", "pattern", "node", "reason"],
        [(i, e(nm.module), e(nm.pattern), e(nm.node), e(nm.reason)) for i, nm in misses])
        if misses else "<p>none</p>"))
    streams = ", ".join(f"{k[1]} on stream {k[0]} x{n}" for k, n in rep.streams.items())
    sync = ", ".join(rep.sync_ops) or "none"
    prefetch = "; ".join(pf.text() for pf in rep.prefetch) or "none"
    out.append(f"<p>streams: {e(streams or 'all on the main stream')}; fork/join: {e(sync)}; "
               f"prefetch: {e(prefetch)}</p>")
    if rep.index in b.drawings:
        before, after = b.drawings[rep.index]
        cols = []
        for title, nodes in (("before", before), ("after", after)):
            svg = _svg(nodes)
            body = svg if svg else f"<pre>{_text_drawing(nodes)}</pre>"
            head = f"layer {rep.index} {title} ({len(nodes)} kernels)"
            cols.append(f"<div><h4>{head}</h4>{body}</div>")
        out.append('<div class="side">' + "".join(cols) + "</div>")
    return out


# ---- command line -------------------------------------------------------------------------------

def _option(text: str) -> tuple[str, Any]:
    import json

    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default="tiny", help="built-in config (tiny, small, k3_tp16, ...)")
    src.add_argument("--model", help="module:factory returning (model, example_inputs)")
    p.add_argument("--batch", type=int, nargs="+", default=[2],
                   help="batch size(s), one bucket each")
    p.add_argument("--T", type=int, default=1, help="verify rows per request (1: plain decode)")
    p.add_argument("--world-size", type=int, default=1,
                   help=">1: tensor parallel, one process per rank under gloo on CPU")
    p.add_argument("--layers", type=int, help="cut the built-in config to its first N layers")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", help="where the built-in model lives (cpu, cuda)")
    p.add_argument("--executor", default="aten", choices=("aten", "inductor"))
    p.add_argument("--disable", action="append", default=[], metavar="PATTERN",
                   help="disable a pattern (name or prefix); repeatable")
    p.add_argument("--option", action="append", default=[], type=_option, metavar="KEY=VALUE",
                   help="any backend option (JSON value); repeatable")
    p.add_argument("--stages", nargs=2, metavar=("A", "B"), help="diff two stages ('input': the "
                   "graph the pipeline receives)")
    p.add_argument("--html", metavar="DIR", help="also write an HTML report into DIR")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--max-diff-lines", type=int, default=120)
    p.set_defaults(run=_run_cli)
    return p


def _run_cli(args: argparse.Namespace) -> int:
    from k3compile.pipeline import STAGES

    known = ["input", *(name for name, _ in STAGES)]
    if args.stages and not set(args.stages) <= set(known):
        print(f"--stages: unknown stage in {args.stages}; the stages: {', '.join(known)}",
              file=sys.stderr)
        return 2
    options = dict(args.option)
    options["executor"] = args.executor
    if args.disable:
        options["disabled_patterns"] = [*options.get("disabled_patterns", []), *args.disable]
    report = run(None if args.model else args.config, args.model, args.batch, args.T,
                 args.world_size, args.layers, args.dtype, options, args.stages, args.device)
    color = {"auto": None, "always": True, "never": False}[args.color]
    print(format_text(report, color, args.max_diff_lines))
    if args.html:
        print(f"HTML report: {write_html(report, args.html)}")
    return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="python -m k3compile.diff", description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    # run as `k3compile.diff`, not `__main__`, so the report's classes pickle across ranks
    sys.exit(importlib.import_module("k3compile.diff").main())
