"""Where some of a call's input tensors lie, compared at a later call: how the wrapper of a stage
that changes what the graph takes (kernel_layout, stack_inputs, weight_views) knows that the
tensors it made its views from are still where they were (`param.data = t`,
`load_state_dict(assign=True)` move one). One C++ call per step where torch has it
(`_tensors_data_ptrs_at_indices_equal`, as CUDA-graph trees check their static inputs; CUDA
builds), a Python loop over the positions otherwise (CPU builds)."""

from __future__ import annotations

import torch

_SAME = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class Addresses:
    """The data pointers of the tensors at `positions` of a call's `count` arguments."""

    def __init__(self, count: int, pointers: dict[int, int]):
        self.count = count
        self.positions = list(pointers)
        self.pointers: list[int | None] = [None] * count
        for i, p in pointers.items():
            self.pointers[i] = p

    @classmethod
    def of(cls, args: list, positions) -> Addresses:
        """Where the tensors at `positions` of `args` lie now."""
        return cls(len(args), {i: args[i].data_ptr() for i in positions})

    def same(self, args: list) -> bool:
        """Every tensor at the positions of `args` lies where it did."""
        if len(args) != self.count:
            return False
        if _SAME is not None:
            return _SAME(args, self.pointers, self.positions)
        return all(args[i].data_ptr() == self.pointers[i] for i in self.positions)
