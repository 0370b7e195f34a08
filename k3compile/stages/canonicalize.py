"""Stage `canonicalize`: every canonical-form rule (`k3compile.canonical`), in order, so that the
patterns of stage `fuse` meet one spelling of each K3 computation whatever spelling the user's
model chose. What each rule rewrote is in the notes as "canonicalize" (rule -> sites) and logged."""

from __future__ import annotations

import logging

from torch import fx

from k3compile.canonical import all_rules

log = logging.getLogger("k3compile")


def canonicalize(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    counts = {}
    gm.meta["real_inputs"] = ctx.inputs  # the placeholders' real tensors (constant tables)
    for rule in all_rules():
        if rule.name in ctx.options.disabled_rules:
            continue
        counts[rule.name] = rule.apply(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ctx.notes["canonicalize"] = counts
    if any(counts.values()):
        log.info("k3 canonicalize (batch %s): %s", ctx.batch,
                 ", ".join(f"{name} {n}" for name, n in counts.items() if n))
    return gm
