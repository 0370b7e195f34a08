"""The terminal report: per bucket the stages, the layers against their plan, the templates and
deviating layers, then per template its histogram, matched sites, near misses (grouped by
pattern and failure), streams and prefetch points; optionally a stage-to-stage diff.

Near misses are listed only for templates with a layer whose plan falls short, unless
`near_misses="all"` (`--near-misses all`): where the plan is met they are the engine's record of
sites that resembled a pattern, no failure (the tiny model's kda_moe template alone records
hundreds of them: variants of the o_proj fold tried at every mix). Their count is still shown,
and the HTML report keeps every record.
"""

from __future__ import annotations

import collections
import sys
from collections import Counter
from typing import ClassVar

from k3compile import settings
from k3compile.tools.diff.layers import KERNEL_RULE, suffix
from k3compile.tools.diff.report import (
    BucketReport,
    DiffReport,
    Miss,
    StageDiff,
    Template,
    hist_rows,
    pretty,
    ranges,
)

NEAR_MISSES = ("missing", "all")  # which templates list their near misses



class Style:
    CODES: ClassVar[dict[str, str]] = {
        "bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}

    def __init__(self, color: bool):
        self.color = color

    def __call__(self, text: str, *styles: str) -> str:
        if not self.color or not styles:
            return text
        return "".join(f"\033[{self.CODES[s]}m" for s in styles) + text + "\033[0m"


def format_text(report: DiffReport, color: bool | None = None, max_diff_lines: int = 120,
                near_misses: str = "missing") -> str:
    """The terminal report; colour when `color` (default: stdout is a TTY and NO_COLOR unset);
    `near_misses`: "missing" lists them for templates with a shortfall only, "all" for all."""
    if near_misses not in NEAR_MISSES:
        raise ValueError(f"near_misses must be one of {NEAR_MISSES}, got {near_misses!r}")
    if color is None:
        color = sys.stdout.isatty() and settings.color_wanted()
    s = Style(color)
    out = [s(f"k3compile diff: {report.source}", "bold") +
           f"  batch {','.join(map(str, report.batches))}, T={report.T}, "
           f"world size {report.world_size}, executor {report.executor}",
           f"compiled {report.graphs} graph(s) in {report.seconds:.1f} s"]
    out += [s(f"note: {n}", "yellow") for n in report.notes]
    out.append(guards_text(report, s))
    for b in report.buckets:
        out += _bucket_text(b, s, max_diff_lines, near_misses == "all")
    verdict = s("met", "green") if report.met else s(report.verdict, "red", "bold")
    out.append(s(f"\n{KERNEL_RULE}", "dim"))
    out.append(f"fusion contract: {verdict} (exit status {report.exit_code})")
    return "\n".join(out)


def guards_text(report: DiffReport, s) -> str:
    compiled = {b.bucket for b in report.buckets}
    if not report.guards:
        return f"bucket guards: none (a static graph: Dynamo guards the batch, {sorted(compiled)})"
    parts = [s(f"{k}: {g}", "bold") if k in compiled else f"{k}: {g}"
             for k, g in report.guards.items()]
    return f"bucket guards on {report.symbol} (compiled in bold): " + " | ".join(parts)


def _bucket_text(b: BucketReport, s, max_diff_lines: int, all_misses: bool) -> list[str]:
    out = [s(f"\n=== bucket {b.bucket}: fusion contract {b.verdict} ===",
             "bold", "green" if b.met else "red")]
    out.append("stages: " + "  ".join(f"{r.name} {r.seconds:.2f}s ({r.ops_before}->{r.ops_after})"
                                      for r in b.stages) + "  (seconds, ops before->after)")
    if b.verified is not None:
        done, reverted = b.verified
        out.append(s(f"verify: {done} rewrites verified, {reverted} reverted", "red" if reverted
                     else "green") + " (each checked numerically against its unfused pattern)")
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
        out.append(f"  {t.id:<4} {t.name:<8} layers {ranges(t.layers):<10} wl {t.wl}  "
                   f"kernels/layer {rep.kernels_before} -> {rep.kernels_after}")
    if b.deviations:
        out.append(s("deviating layers", "bold"))
        for i, reasons in b.deviations.items():
            for r in reasons:
                out.append(f"  layer {i}: " + (s(r, "red") if "shortfall" in r else r))
    for t in b.templates:
        out += _template_text(b, t, s, all_misses)
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
        per_site[suffix(m.module)].add(m.layer)
    for site, layers in per_site.items():
        by_layers[ranges(sorted(layers))].append(site)
    parts = []
    for layers, sites in by_layers.items():
        more = f" +{len(sites) - limit} more" if len(sites) > limit else ""
        parts.append(f"layer{'s' if len(layers) > 1 else ''} {layers}: "
                     f"{', '.join(sorted(sites)[:limit])}{more}")
    return "; ".join(parts)


def _template_text(b: BucketReport, t: Template, s, all_misses: bool,
                   max_rows: int = 16) -> list[str]:
    rep = b.layers[t.representative]
    members = [b.layers[i] for i in t.layers]
    out = [s(f"\n--- {t.id} {t.name}: layers {ranges(t.layers)} (shown: layer {rep.index}) ---",
             "bold", "cyan")]
    out.append(f"  kernels {rep.kernels_before} -> {rep.kernels_after} per layer"
               f"   ops {sum(rep.ops_before.values())} -> {sum(rep.ops_after.values())}")
    fused = ", ".join(f"{op} x{n}" for op, n in sorted(rep.fused.items())) or "none"
    out.append(f"  fused ops produced: {fused}")
    if b.has_before:
        rows = hist_rows(rep.ops_before, rep.ops_after, changed_only=True)
        same = len(set(rep.ops_before) | set(rep.ops_after)) - len(rows)
        out.append(f"  op histogram before -> after ({len(rows)} ops changed, {same} unchanged):")
        for op, x, y in rows[:max_rows]:
            d = f"{y - x:+d}"
            delta = s(d, "green" if y < x else "yellow")
            out.append(f"    {pretty(op):<34}{x:>5} -> {y:<5}{delta}")
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
    shown = misses if all_misses else [m for L in members if L.shortfall for m in L.near_misses]
    if not misses:
        out.append("  near misses: none")
    elif not shown:
        out.append(f"  near misses: {len(misses)} recorded, none listed: the plan is met here "
                   "(--near-misses all lists them; the HTML report has every record)")
    else:
        part = ("" if len(shown) == len(misses)
                else f"; listed: the {len(shown)} at layers short of their plan")
        out.append(f"  near misses: {len(misses)} (grouped by pattern and failure{part}; "
                   "every record in the HTML report)")
    for title, group in _miss_groups(shown):
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
            side[stream].append(f"{pretty(op)} x{n}")
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
        out.append(f"    {pretty(op):<34}{x:>5} -> {y:<5}{y - x:+d}")
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
