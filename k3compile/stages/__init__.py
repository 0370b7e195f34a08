"""The pipeline's stages, one module each; each stage is a `(graph module, Context) -> graph
module` function over the functional ATen graph (`k3compile.pipeline.stages(options)` lists the
ones a compile runs, in order). Whether a stage runs is decided there, from the options; a stage
function reads the options only for how it runs."""

from __future__ import annotations

import dataclasses
from typing import Any

from k3compile.rewrite import RewriteReport
from k3compile.settings import Options


@dataclasses.dataclass
class Context:
    """What the stages of one bucket's compile share: the options, the bucket, the rewrite
    report `fuse` fills and `verify` checks, each stage's notes (what it reports, by stage name),
    and Dynamo's real example inputs (`pack` moves their storage)."""

    options: Options
    batch: int | None  # the bucket this graph is specialised to (None: not bucketed)
    report: RewriteReport = dataclasses.field(default_factory=RewriteReport)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)
    inputs: list = dataclasses.field(default_factory=list)  # Dynamo's real example inputs
    # positions of the inputs the caller passes each step (not parameters or buffers)
    user_inputs: frozenset[int] = frozenset()
    stage_key: str | None = None  # the stage cache's key text of the ATen graph (None: uncached)
    # views of flat inputs read as inputs of their own (stage `weight_views`); None: none
    viewed: Any = None
    # the inputs read as their transpose (stage `kernel_layout`), for the executor; None: none
    transposed: Any = None
    # the inputs a fused op reads permuted, re-laid by the first call (stage `conv_layout`)
    permuted: Any = None
    # the inputs read as their copy in a lower float dtype (stage `weight_cast`); None: none
    weight_cast: Any = None
    # the inputs whose values the stages read (`gm.meta["inputs_read"]`), guarded at each call
    # (k3compile/read_guard.py)
    inputs_read: frozenset[int] = frozenset()
