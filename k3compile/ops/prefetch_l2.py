"""`ys = k3.prefetch_l2(weights, nbytes, stream=s, after=xs)`: read the first nbytes of the
weights so that the next GEMMs find them in L2 (inserted by the `prefetch` stage; no math).

`after` passes through (aliases): on a side stream the op reads the fork's alias and the join
reads its output, so in every order it is launched after the fork and before the join. On the
main stream `after` is empty and the op returns nothing anyone reads; it is side-effecting so
dead-code elimination keeps it. On a GPU it runs a reduction over the bytes it names (one per
weight); on CPU it is a no-op.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from k3compile.ops.side_streams import aliases, run_on_stream

_lib = torch.library.Library("k3", "FRAGMENT")
_lib.define("prefetch_l2(Tensor[] weights, int nbytes, *, int stream=0, Tensor(a)[]? after=None)"
            " -> Tensor(a)[]")


def prefetch_l2(weights: list[torch.Tensor], nbytes: int, *, stream: int = 0,
                after: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Touch the first nbytes of weights (in order) so the next GEMMs find them in L2, on side
    stream `stream` when it is not 0; returns aliases of `after`."""
    if weights and weights[0].is_cuda and nbytes > 0:
        run_on_stream(stream, _touch, weights, nbytes)
    return _fake(weights, nbytes, after=after)


def _touch(weights: list[torch.Tensor], nbytes: int) -> None:
    parts, left = [], nbytes
    for w in weights:
        if left <= 0:
            break
        flat = w.reshape(-1) if w.is_contiguous() else w.contiguous().reshape(-1)
        take = min(flat.numel(), -(-left // flat.element_size()))
        parts.append(flat[:take])
        left -= take * flat.element_size()
    for part in parts:  # a full-bandwidth reduction reads every byte; the scalar is dropped
        torch.amax(part)


def _fake(weights, nbytes, *, stream=0, after=None):
    return aliases(after or [])


_lib.impl("prefetch_l2", prefetch_l2, "CompositeExplicitAutograd")
_lib.impl("prefetch_l2", _fake, "Meta")
has_side_effect(torch.ops.k3.prefetch_l2.default)
