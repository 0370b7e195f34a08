"""Everything k3compile takes from `torch._inductor`, in one place, so a torch upgrade touches one
file: pattern tracing/matching (Inductor's pattern matcher) and the compile entry points."""

from __future__ import annotations

from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor import config as inductor_config  # noqa: F401
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.pattern_matcher import (
    FailedMatch,
    Match,
    MultiOutputPattern,
    PatternExpr,
    fwd_only,
    gen_pattern_and_search_gm,
)

__all__ = [
    "FailedMatch", "Match", "MultiOutputPattern", "PatternExpr", "compile_fx", "compile_fx_inner",
    "fwd_only", "gen_pattern_and_search_gm", "inductor_config", "make_boxed_func",
]
