"""The backend's logs in torch's logging system, the way torch users know it:

    TORCH_LOGS="+k3"          the `k3compile` loggers at DEBUG ("k3": INFO), with the artifacts
    TORCH_LOGS="k3_fusion"    which rewrites fired where: canonical rules, fused ops, verify's count
    TORCH_LOGS="k3_kernels"   every CuTe DSL kernel build (name, seconds; from the build pool
                              also op, scalars, worker)
    TORCH_LOGS="k3_graphs"    the graph a bucket enters the pipeline with and after each stage
                              (off by default: "+k3" does not print it, naming it does)
    TORCH_TRACE=dir           tlparse's structured log: the same graphs as `k3_bucket<B>_*`
                              artifacts, and the fusion report as JSON

In process: `torch._logging.set_logs(modules={"k3": logging.DEBUG, "k3_fusion": True})`.

Registration. torch parses TORCH_LOGS once, during `import torch`, and rejects names nobody has
registered; its `torch.backends` entry points run just before, so an installed k3compile
registers there (`torch_entry_point`) when TORCH_LOGS names a k3 log. Only then: torch's log
setup makes every registered logger stop propagating to the root logger (it prints them itself),
which a program that configures `logging` itself, or pytest's caplog, would not expect of
`k3compile` when it asked torch for nothing. Otherwise importing the backend registers the names
(`register`, from k3compile/observe.py), so `set_logs` takes them in process. A source tree
used through PYTHONPATH has no entry point: there `set_logs` after importing the backend is the
way (`TORCH_LOGS=+k3compile`, a module name, would import every module under the package
inside torch's import).

This module imports only the standard library at import time (and `k3compile.settings`, which
does too, in the entry point): torch calls the entry point while `import torch` is running.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import fx

    from k3compile.stages import Context

LOGGER = "k3compile"  # every logger of the backend is below it ("k3compile.rewrite", ...)
ALIAS = "k3"
ARTIFACTS: dict[str, tuple[str, bool]] = {  # name -> (description, off by default)
    "k3_fusion": ("k3: which rewrites (canonical rules, fusion patterns) fired where, per bucket",
                  False),
    "k3_kernels": ("k3: every CuTe DSL kernel build, with its compile time", False),
    "k3_graphs": ("k3: the graph before the first and after every pipeline stage, per bucket",
                  True),
}

_registered = False


def register() -> None:
    """Make "k3" and the artifacts names torch's logging knows (idempotent)."""
    global _registered
    if _registered:
        return
    from torch._logging import _internal

    _internal.register_log(ALIAS, LOGGER)
    for name, (description, off_by_default) in ARTIFACTS.items():
        _internal.register_artifact(name, description, off_by_default=off_by_default)
    _registered = True


def torch_entry_point() -> None:
    """The `torch.backends` entry point (pyproject.toml), called by `import torch` before it
    parses TORCH_LOGS: registers where TORCH_LOGS names a k3 log or artifact. Never raises:
    torch's import would fail with it."""
    try:
        from k3compile.settings import torch_env

        if names_k3(torch_env("TORCH_LOGS") or ""):
            register()
    except Exception as e:  # noqa: BLE001
        logging.getLogger(LOGGER).warning("k3: TORCH_LOGS names not registered: %s", e)


def names_k3(settings: str) -> bool:
    names = (re.sub(r"^[+-]", "", s.strip()) for s in settings.split(","))
    return any(n == ALIAS or n in ARTIFACTS for n in names)


def artifact(name: str) -> logging.Logger:
    """The logger of one of `ARTIFACTS` (a child of `k3compile`, as torch names them)."""
    register()
    from torch._logging import getArtifactLogger

    return getArtifactLogger(LOGGER, name)


def _on(log: logging.Logger) -> bool:
    return log.isEnabledFor(logging.DEBUG)


# ---- what the pipeline reports ------------------------------------------------------------------

def stage_graph(stage: str, when: str, gm: fx.GraphModule, ctx: Context, seconds: float | None,
                compile_id: Any = None, text: str | None = None) -> None:
    """The graph of bucket `ctx.batch` `when` ("before" / "after") `stage`: to the k3_graphs
    artifact and, under TORCH_TRACE, to tlparse as artifact `k3_bucket<B>_<when>_<stage>`."""
    from torch._logging import trace_structured

    def payload() -> str:
        nonlocal text
        if text is None:
            text = gm.print_readable(print_output=False)
        return text

    graphs = artifact("k3_graphs")
    if _on(graphs):
        took = "" if seconds is None else f" ({seconds:.3f} s)"
        graphs.debug("bucket %s: graph %s stage %s%s:\n%s", ctx.batch, when, stage, took,
                     payload())
    trace_structured("artifact", lambda: {"name": f"k3_bucket{ctx.batch}_{when}_{stage}",
                                          "encoding": "string"},
                     payload_fn=payload, compile_id=compile_id)


def stage_report(stage: str, ctx: Context, compile_id: Any = None) -> None:
    """What a rewriting stage did, to the k3_fusion artifact (and TORCH_TRACE as JSON)."""
    from torch._logging import trace_structured

    lines = fusion_lines(stage, ctx)
    if not lines:
        return
    fusion = artifact("k3_fusion")
    if _on(fusion):
        for line in lines:
            fusion.debug("bucket %s: %s", ctx.batch, line)
    trace_structured("artifact", lambda: {"name": f"k3_bucket{ctx.batch}_{stage}_report",
                                          "encoding": "json"},
                     payload_fn=lambda: lines, compile_id=compile_id)


def fusion_lines(stage: str, ctx: Context) -> list[str]:
    """One line per rewrite `stage` made (canonicalize: per rule; fuse: per site), or verify's
    count and what it reverted."""
    report = getattr(ctx, "report", None)
    if report is None:  # a context of a stage run alone (tools, tests): no fusion report
        return []
    if stage == "canonicalize":
        counts = ctx.notes.get("canonicalize", {})
        return [f"canonical rule {rule}: {n} rewrites" for rule, n in counts.items() if n]
    if stage == "fuse":
        lines = [f"{h.op} <- pattern {h.pattern} at {h.module or '(top)'} (node {h.node})"
                 for h in report.hits]
        lines += [f"{op} deferred: {why}" for op, why in report.deferred.items()]
        return lines
    if stage == "verify":
        return [verify_count(ctx)] + [f"reverted {r.pattern} at {r.module or r.node}: {r.error}"
                                      for r in report.reverted]
    return []


def verify_count(ctx: Context) -> str:
    return f"{ctx.report.verified} rewrites verified, {len(ctx.report.reverted)} reverted"


def kernel_built(name: str, seconds: float, batch: int | None, by: str | None = None,
                 loaded: bool = False) -> None:
    """One kernel build of bucket `batch` (`by`: the op, its scalars and the build worker, for
    a kernel the build pool built; `loaded`: the worker loaded what another process built)."""
    kernels = artifact("k3_kernels")
    if _on(kernels):
        kernels.debug("bucket %s: %s kernel %s in %.2f s%s", batch,
                      "loaded" if loaded else "built", name, seconds, f" ({by})" if by else "")


__all__ = ["ARTIFACTS", "artifact", "fusion_lines", "kernel_built", "names_k3", "register",
           "stage_graph", "stage_report", "torch_entry_point", "verify_count"]
