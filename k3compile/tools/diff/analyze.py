"""From what the backend recorded to a `DiffReport`: the layers of each bucket, grouped into
templates, with their hits, near misses (the engine's, and `near_miss.explain`'s where the
contract fell short and the engine recorded none), deviations and stage diffs.

The observer records the graph after every stage; the per-layer 'before' needs the graph each
bucket enters the pipeline with, which the stages rewrite in place: compile inside `capture()`
(a listener on `Observer.subscribe` that copies it) and hand what it captured to `analyze`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import difflib
import weakref
from collections import Counter
from collections.abc import Iterator

from torch import fx

from k3compile import layers as k3layers
from k3compile import stage_cache
from k3compile.observe import Observer, StageEvent
from k3compile.rewrite import near_miss
from k3compile.rewrite.near_miss import op_label
from k3compile.stages.contract import NEUTRAL, layer_templates
from k3compile.stages.fuse import fitting
from k3compile.tools.diff.layers import (
    OUTSIDE,
    drawing,
    input_names,
    launches,
    layer_index,
    split_layers,
    stream_info,
    suffix,
    wl_hash,
)
from k3compile.tools.diff.report import (
    BucketReport,
    DiffReport,
    LayerInfo,
    Miss,
    StageDiff,
    StageRow,
    Template,
    pretty,
    ranges,
)

# fused ops whose patterns match another k3 op (no site in the input graph): a missing one is
# explained by its base op's patterns too
BUILDS_ON = {"oproj_attn_res_mix_norm": "attn_res_mix_norm",
             "allreduce_attn_res_mix_norm": "attn_res_mix_norm", "fb_kda_decode": "kda_decode"}


# ---- capture: the graph each bucket enters the pipeline with ------------------------------------

class InputGraphs:
    """An observer listener keeping, per observer and bucket, a copy of the graph the bucket's
    first stage receives and its printed text."""

    def __init__(self):
        self.graphs: weakref.WeakKeyDictionary[Observer, dict] = weakref.WeakKeyDictionary()

    def __call__(self, event: StageEvent) -> None:
        if event.first:
            stage_cache.complete(event.gm)  # a warm bucket's graph, as a cold compile has it
            text = event.gm.print_readable(print_output=False)
            self.graphs.setdefault(event.observer, {})[event.batch] = (
                copy.deepcopy(event.gm.graph), text)

    def of(self, observer: Observer) -> dict[int | None, tuple[fx.Graph, str]]:
        return self.graphs.get(observer, {})


@contextlib.contextmanager
def capture() -> Iterator[InputGraphs]:
    """Compile inside this to give `analyze` the pre-pipeline graphs (per-layer 'before')."""
    with Observer.subscribe(InputGraphs()) as graphs:
        yield graphs


# ---- per layer ----------------------------------------------------------------------------------

def _patterns_of(op: str) -> list:
    from k3compile.patterns import all_patterns

    ops = {op, BUILDS_ON.get(op, op)}
    return [p for p in all_patterns() if p.op.split(".")[-1] in ops]


def _layer_info(index, names, before, after, hits, misses, reverted, lr, inputs) -> LayerInfo:
    streams, sync, prefetch = stream_info(after, inputs)
    fused = Counter(op_label(n)[3:] for n in after if op_label(n).startswith("k3."))
    return LayerInfo(
        index=index, reads_as=names[0], contract_template=lr.template if lr else names[1],
        wl_before=wl_hash(before) if before is not None else "", wl_after=wl_hash(after),
        ops_before=Counter(op_label(n) for n in before) if before is not None else Counter(),
        ops_after=Counter(op_label(n) for n in after),
        kernels_before=sum(map(launches, before)) if before is not None else 0,
        kernels_after=sum(map(launches, after)), fused=fused, hits=hits, near_misses=misses,
        reverted=reverted,
        expected=dict(lr.expected) if lr else {}, shortfall=dict(lr.shortfall) if lr else {},
        streams=streams, sync_ops=sync, prefetch=prefetch)


def _rewrites_by_layer(rewrites):
    """The engine's hits, near misses and reverted rewrites per layer."""
    hits, misses, reverted = (collections.defaultdict(list) for _ in range(3))
    for h in getattr(rewrites, "hits", ()):
        hits[layer_index(h.module)].append(h)
    for nm in getattr(rewrites, "near_misses", ()):
        i = layer_index(nm.module)
        misses[i].append(Miss(i, nm.module, nm.node, nm.pattern, nm.reason, nm.kind, "engine"))
    for r in getattr(rewrites, "reverted", ()):
        reverted[layer_index(r.module)].append(f"{r.pattern} @ {r.module}: {r.error}")
    return hits, misses, reverted


def _explain_shortfalls(plan, misses, hits, nodes_of, options, bucket) -> None:
    """Where a layer misses a planned op and the engine recorded no near miss of its patterns,
    ask `near_miss.explain`, at the sites where the op fired in other layers (every anchor of
    the layer when it fired nowhere)."""
    rewritten = {h.node: h.pattern for hs in hits.values() for h in hs}
    for i, lr in plan.items():
        for op in lr.shortfall:
            family = _patterns_of(op)
            names = {p.name for p in family}
            if any(m.pattern in names for m in misses[i]):
                continue
            sites = {suffix(h.module) for hs in hits.values() for h in hs if h.pattern in names}
            nodes = nodes_of(i)
            where = [n for n in nodes if suffix(near_miss.module_path(n)) in sites] or nodes
            misses[i] += [Miss(i, nm.module, nm.node, nm.pattern, nm.reason, nm.kind, "diff")
                          for nm in near_miss.explain(where, family, options.pattern_enabled,
                                                      bucket, rewritten)]


def _probe_shortfalls(plan, misses, graph: fx.Graph, options, bucket) -> None:
    """Where a layer misses a big fusion its structure calls for (`k3compile.layers`) and no near
    miss explains it yet (the engine recorded none, e.g. stage fuse was off, and `explain` found
    no resembling site), the structural probe at the layer's evidence node: such a layer is
    never without one."""
    from k3compile.patterns import all_patterns

    def wanted(i: int, ops: tuple[str, ...]) -> bool:
        lr = plan.get(i)
        return (lr is not None and not set(lr.shortfall).isdisjoint(ops)
                and not any(m.family in ops for m in misses[i]))

    fit, _ = fitting(graph, all_patterns())
    for p in k3layers.probe_fusions(graph, k3layers.find_layers(graph), fit,
                                    options.pattern_enabled, bucket, wanted):
        nm = p.miss
        misses[p.layer].append(Miss(p.layer, nm.module, nm.node, nm.pattern, nm.reason, nm.kind,
                                    "diff"))


# ---- templates and deviations -------------------------------------------------------------------

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
    parts = [f"{d:+d} {pretty(op)}" for op, d in rows[:limit]]
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
                    delta = _hist_delta(layers[u.representative].ops_before, layers[i].ops_before)
                    out[i].append(f"structure differs from {u.id} ({u.name}, layers "
                                  f"{ranges(u.layers)}): {delta}")
        rep = layers[t.representative]
        for i in t.layers:
            if layers[i].wl_after != rep.wl_after:
                delta = _hist_delta(rep.fused, layers[i].fused)
                out[i].append(f"fused differently from layer {rep.index} of {t.id}: k3 ops {delta}")
    for i, (before, final) in misread.items():
        out[i].append(f"the contract read this layer as {final!r}; the graph the pipeline "
                      f"received reads as {before!r}")
    for i, info in layers.items():
        if info.shortfall:
            # a missing fb_kda_decode is explained by kda_decode's near misses too
            families = {f for op in info.shortfall for f in (op, BUILDS_ON.get(op))}
            why = Counter(m.family for m in info.near_misses if m.family in families)
            out[i].append(f"contract shortfall: missing {info.shortfall}; near misses: "
                          f"{dict(why) or 'none recorded'}")
    return dict(sorted(out.items()))


# ---- buckets ------------------------------------------------------------------------------------

def _bucket_report(compiled, bucket, captured: dict) -> BucketReport:
    obs = compiled.observer
    final = obs.graphs[bucket]
    before_graph, before_text = captured.get(bucket, (None, ""))
    has_before = before_graph is not None
    after = split_layers(final)
    before = split_layers(before_graph) if has_before else {}
    contract = compiled.contracts.get(bucket)
    plan = {lr.layer: lr for lr in contract.layers} if contract else {}
    hits, misses, reverted = _rewrites_by_layer(obs.reports.get(bucket))
    _explain_shortfalls(plan, misses, hits,
                        lambda i: (before.get(i) if has_before else after.get(i)) or [],
                        compiled.options, bucket)
    _probe_shortfalls(plan, misses, before_graph if has_before else final, compiled.options,
                      bucket)
    # the contract's templates (read as its graph entered stage fuse); the input graph's own
    # reading differs only where a stage before fuse changed what a layer computes
    names = ({lr.layer: lr.template for lr in contract.layers} if contract
             else layer_templates(final))
    read_before = layer_templates(before_graph) if has_before else names
    misread = {i: (read_before[i], n) for i, n in names.items() if read_before.get(i, n) != n}
    inputs = input_names(compiled, final)
    names.pop(OUTSIDE, None)  # the contract's FINAL row is the outside row's plan
    layers = {i: _layer_info(i, (read_before.get(i, "?"), names.get(i, "?")),
                             before.get(i, []) if has_before else None,
                             after[i], hits[i], misses[i], reverted[i], plan.get(i), inputs)
              for i in sorted(after) if i != OUTSIDE}
    outside = _layer_info(OUTSIDE, ("", ""), before.get(OUTSIDE, []) if has_before else None,
                          after.get(OUTSIDE, []), hits[OUTSIDE], misses[OUTSIDE],
                          reverted[OUTSIDE], plan.get(OUTSIDE), inputs)
    templates = _templates(layers, has_before)
    drawings = {t.representative: drawing(before.get(t.representative, []),
                                          after[t.representative])
                for t in templates if has_before}
    records = obs.records.get(bucket, [])
    texts = {"input": before_text} if before_text else {}
    texts.update({r.name: r.graph_after for r in records})
    rewrites = obs.reports.get(bucket)
    verified = ((rewrites.verified, len(rewrites.reverted))
                if compiled.options.verify and rewrites is not None else None)
    return BucketReport(
        verified=verified,
        deferred=dict(getattr(obs.reports.get(bucket), "deferred", {}) or {}),
        pack=str(obs.notes.get(bucket, {}).get("pack", "")),
        bucket=bucket, met=contract.met if contract else True,
        status=contract.status if contract else "",
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


def analyze(compiled, stages: tuple[str, str] | None = None, source: str = "",
            captured: InputGraphs | None = None) -> DiffReport:
    """The report of an already compiled `K3Compiled`; `captured`: what `capture()` kept while it
    compiled (the per-layer 'before' columns; without it they are empty)."""
    inputs = captured.of(compiled.observer) if captured is not None else {}
    buckets = []
    for bucket in compiled.contracts:
        if bucket not in compiled.observer.graphs:
            continue
        br = _bucket_report(compiled, bucket, inputs)
        if stages:
            br.stage_diff = stage_diff(br, compiled, *stages)
        buckets.append(br)
    notes = []
    if not any(b.has_before for b in buckets):
        notes.append("no pre-pipeline graph was captured (compile inside "
                     "k3compile.tools.diff.capture()): 'before' columns are empty")
    return DiffReport(
        source=source or type(compiled.gm).__name__, batches=list(compiled.contracts), T=1,
        world_size=1, executor=compiled.options.executor,
        symbol=str(compiled.symbol) if compiled.symbol is not None else None,
        guards={b: str(g) for b, g in compiled.guards.items()}, graphs=1, seconds=0.0,
        buckets=buckets, notes=notes)
