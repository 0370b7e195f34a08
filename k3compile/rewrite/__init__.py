"""The rewrite engine: patterns matched with Inductor's pattern matcher (behind
`k3compile.rewrite.inductor`, the one module that imports `torch._inductor`), checks, near
misses, verify mode. Patterns import what they need from here."""

from k3compile.rewrite.engine import (
    NEUTRAL,
    Hit,
    NearMiss,
    Pattern,
    Reverted,
    Rewrite,
    RewriteReport,
    apply_patterns,
    module_path,
    revert,
    tensor_meta,
    verify_rewrites,
    verify_site,
    with_signature,
)

__all__ = ["NEUTRAL", "Hit", "NearMiss", "Pattern", "Reverted", "Rewrite", "RewriteReport",
           "apply_patterns", "module_path", "revert", "tensor_meta", "verify_rewrites",
           "verify_site", "with_signature"]
