"""The HTML report: `folder/index.html` with every bucket, layer, template and near-miss record
(the terminal report groups and trims them), each template's representative layer drawn before
and after (Graphviz through pydot where installed, else as text), and one .diff file per stage
diff."""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3compile.tools.diff.layers import KERNEL_RULE
from k3compile.tools.diff.report import (
    BucketReport,
    DiffReport,
    DrawNode,
    Template,
    hist_rows,
    pretty,
    ranges,
)
from k3compile.tools.diff.text import Style, guards_text

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
    verdict = ('<b class="good">met</b>' if report.met
               else f'<b class="bad">{html.escape(report.verdict)}</b>')
    title = f"k3compile diff: {e(report.source)}"
    parts = [f"<!doctype html><meta charset=utf-8><title>{title}</title>",
             f"<style>{_CSS}</style><h1>k3compile diff: {e(report.source)}</h1>",
             (f"<p>batch {e(','.join(map(str, report.batches)))}, T={report.T}, world size "
              f"{report.world_size}, executor {e(report.executor)}; {report.graphs} graph(s) "
              f"compiled in {report.seconds:.1f} s. Fusion contract: {verdict}.</p>")]
    parts += [f"<p class=bad>{e(n)}</p>" for n in report.notes]
    parts.append(f"<p>{e(guards_text(report, Style(False)))}</p>")
    parts.append(f"<p class=dim>{e(KERNEL_RULE)}</p>")
    for b in report.buckets:
        parts += _bucket_html(b, folder)
    (folder / "index.html").write_text("\n".join(parts))
    return folder / "index.html"


def _bucket_html(b: BucketReport, folder: Path) -> list[str]:
    e = html.escape
    verdict = "met" if b.met else f"<span class=bad>{html.escape(b.verdict)}</span>"
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
                               [(e(pretty(op)), x, y) for op, x, y in d.histogram]))
        out.append(f'<p><a href="{name}">{name}</a></p><pre>{e(chr(10).join(d.unified))}</pre>')
    return out


def _template_html(b: BucketReport, t: Template) -> list[str]:
    e = html.escape
    rep = b.layers[t.representative]
    members = [b.layers[i] for i in t.layers]
    fused = ", ".join(f"{op} x{n}" for op, n in sorted(rep.fused.items())) or "none"
    out = [(f'<h3 id="{t.id}-{b.bucket}">{t.id} {e(t.name)}: layers {ranges(t.layers)} '
            f"(wl {t.wl}; shown: layer {rep.index})</h3>"),
           (f"<p>kernels per layer {rep.kernels_before} &rarr; {rep.kernels_after}; "
            f"fused ops: {e(fused)}</p>")]
    if b.has_before:
        rows = hist_rows(rep.ops_before, rep.ops_after, changed_only=False)
        out.append(_html_table(["op", "before", "after", "change"],
                               [(e(pretty(op)), x, y, f"{y - x:+d}" if y != x else "")
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
