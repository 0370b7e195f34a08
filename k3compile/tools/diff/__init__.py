"""`k3compile diff`: what the k3 backend did to a model's decode graph, layer template by template.

    k3compile diff --config tiny --batch 2            # or: python -m k3compile.tools.diff ...
    k3compile diff --model mypkg.models:factory --html out/
    k3compile diff --config tiny --stages normalize fuse

The tool compiles the model with `backend="k3"` (executor "aten" unless told otherwise), reads what
the backend's observer recorded, and reports per bucket:

* layer templates: the layers grouped by a Weisfeiler-Lehman hash of their kernel graph (the
  nodes whose module path is `...layers.N...`, views contracted, op names as labels), and the
  layers that deviate from their template (first/last layer, a layer where a pattern missed);
* per template: op histogram before/after, fused ops, kernels before -> after (`KERNEL_RULE`),
  every matched site (module path, pattern), near misses with the failing condition (listed for
  templates short of their plan; `--near-misses all` for every template), stream assignment and
  prefetch points when the pipeline made any, and the bucket guards;
* in verify mode (`--option verify=true` or `K3_VERIFY=1`) the count of rewrites verified and
  reverted, per bucket;
* `--stages A B`: op histogram and unified text diff between any two pipeline stages.

The exit status is 1 when a bucket's fusion contract is not met, so CI can gate on it; 2 for a
bad argument. The modules, one idea each:

    report.py   the report as plain data (it crosses process boundaries at world size > 1)
    layers.py   reading a graph layer by layer: kernels, WL hash, streams, drawings
    analyze.py  capture() (an Observer subscription) and analyze(compiled) -> DiffReport
    run.py      compiling a built-in config or a module:factory, one process per rank
    text.py     format_text (terminal);  html.py: write_html
    cli.py      the arguments and their checks

Near misses come from the rewrite engine's one explanation (`k3compile.rewrite.near_miss`).
"""

from k3compile.tools.diff.analyze import analyze, capture, stage_diff
from k3compile.tools.diff.cli import add_arguments, main
from k3compile.tools.diff.html import write_html
from k3compile.tools.diff.layers import KERNEL_RULE, launches
from k3compile.tools.diff.report import DiffReport
from k3compile.tools.diff.run import run
from k3compile.tools.diff.text import format_text

__all__ = ["KERNEL_RULE", "DiffReport", "add_arguments", "analyze", "capture", "format_text",
           "launches", "main", "run", "stage_diff", "write_html"]
