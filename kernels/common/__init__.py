"""Helpers shared by the kernels.

`dsl` is host-side pure Python (importable without the DSL); `reduce` (warp/block reductions) and
`copy` (vectorised row loads/stores) are device code and import `cutlass`: kernel modules import
them only inside their lazy kernel builders.
"""
