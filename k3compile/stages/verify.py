"""Stage `verify` (option `verify`, K3_VERIFY=1): every rewrite `fuse` made is checked against
its unfused pattern on fresh random inputs shaped like the site (`verify_site`: values within the
pattern's tolerance, and the same dtype and shape as the pattern's outputs and as the site's
metadata); a failing rewrite is reverted, the pattern's search traced at the site spliced back,
and reported (`RewriteReport.reverted`, a warning).

It runs right after `fuse`: the later stages build on the fused ops (`shard` slices their
weights, `streams` moves them to a side stream, `writeback` drops the write-backs they took
over), and a revert must come before they do."""

from __future__ import annotations

import logging

from torch import fx

from k3compile.rewrite import verify_rewrites

log = logging.getLogger("k3compile")


def verify(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    verify_rewrites(gm.graph, ctx.report)
    gm.recompile()
    log.info("k3 verify (batch %s): %d rewrites verified, %d reverted", ctx.batch,
             ctx.report.verified, len(ctx.report.reverted))
    return gm
