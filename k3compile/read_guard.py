"""The graph inputs whose values a compile read, guarded at every call.

A few canonical rules rewrite by what a graph input holds, not only by its shape: rule
`mxfp4_dequant` proves a lookup table is E2M1, rule `causal_mask` that a bool buffer is
`tril(ones)`. They record the input's position in `gm.meta["inputs_read"]` (the stage cache keys
entries by those inputs' digests). Dynamo guards on no tensor's values, so a buffer written in
place after the compile (`model.causal_mask[5, 9] = True`, a new table) would leave the compiled
step computing what the old values meant: a silent wrong answer.

The pipeline hands the compiled step's caller a `ReadGuard` (`fn.k3_read_guard`), and the
backend asks it at every call, before a CUDA graph's replay too, whether any such input changed:
by its address and version counter first (any in-place write, `copy_` or `load_state_dict`,
bumps it; `param.data = t` moves the address), two integer reads per input. Where either changed
it compares the input's digest with the one the compile read: the same values (a
`load_state_dict` of the same table) are taken, and the new address and version remembered;
other values make the backend compile the bucket again (logged), on the new values, before the
step runs. Not seen: a write through `.data` (its own version counter), as for stage
`weight_cast`.
"""

from __future__ import annotations

import hashlib

import torch

from k3compile.rewrite import inductor


def digest(x) -> str:
    """sha256 of a tensor's dtype, shape and bytes (read on the host), or the repr of another
    value."""
    if not isinstance(x, torch.Tensor):
        return repr(x)
    with inductor.unset_fake_temporarily():
        t = x.detach().cpu().contiguous()
        return hashlib.sha256(str((t.dtype, tuple(t.shape))).encode()
                              + t.view(torch.uint8).numpy().tobytes()).hexdigest()


class ReadGuard:
    """The inputs at `positions` of a compiled step, as the compile read them from `inputs`."""

    def __init__(self, positions, inputs: list):
        self.positions = sorted(i for i in positions if isinstance(inputs[i], torch.Tensor))
        with inductor.unset_fake_temporarily():
            self.seen = {i: (inputs[i].data_ptr(), inputs[i]._version) for i in self.positions}
        self.digests = {i: digest(inputs[i]) for i in self.positions}

    def changed(self, args) -> str | None:
        """What changed since the compile read them (None: nothing). Same values at a new
        address or version are taken, and remembered."""
        for i in self.positions:
            x = args[i]
            if (x.data_ptr(), x._version) == self.seen[i]:
                continue
            if digest(x) != self.digests[i]:
                return (f"graph input {i} ({x.dtype} {list(x.shape)}), whose values the compile "
                        "read, changed in place")
            self.seen[i] = (x.data_ptr(), x._version)
        return None


__all__ = ["ReadGuard", "digest"]
