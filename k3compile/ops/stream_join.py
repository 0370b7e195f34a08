"""`ys = k3.stream_join(xs, stream_id)`: the main stream waits for what the side stream has
queued (inserted by the `streams` and `prefetch` stages; no math).

Returns its inputs (aliases: no copy), and the main stream consumes the joined values, so the op
orders its consumers after itself. On a GPU it records an event on the side stream and makes the
main stream wait on it; on CPU it is an identity. The join that closes a prefetch's side stream
has no consumer (nothing waits for a prefetch's data), so the op is side-effecting: it still
orders the streams, and a capture needs it. Memory: `k3compile.ops.side_streams`.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from k3compile.ops.side_streams import aliases, cuda_device, hand_over, side_stream

_lib = torch.library.Library("k3", "FRAGMENT")
_lib.define("stream_join(Tensor(a)[] xs, int stream_id) -> Tensor(a)[]")


def stream_join(xs: list[torch.Tensor], stream_id: int) -> list[torch.Tensor]:
    device = cuda_device(xs)
    if device is not None:
        hand_over(torch.cuda.current_stream(device), side_stream(device, stream_id))
    return aliases(xs)


def _fake(xs: list[torch.Tensor], stream_id: int) -> list[torch.Tensor]:
    return aliases(xs)


_lib.impl("stream_join", stream_join, "CompositeExplicitAutograd")
_lib.impl("stream_join", _fake, "Meta")
has_side_effect(torch.ops.k3.stream_join.default)
