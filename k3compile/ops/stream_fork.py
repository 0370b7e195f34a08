"""`ys = k3.stream_fork(xs, stream_id)`: the side stream waits for what the main stream has
queued (inserted by the `streams` stage; no math).

Returns its inputs (aliases: no copy), and the branch consumes the forked values, so the op is
not dead code and orders its consumers after itself, in graph order (the aten executor) and in
any order Inductor's wrapper picks. On a GPU it records an event on the main stream and makes the
side stream wait on it; on CPU it is an identity. Memory: `k3compile.ops.side_streams`.
"""

from __future__ import annotations

import torch

from k3compile.ops.side_streams import aliases, cuda_device, hand_over, side_stream

_lib = torch.library.Library("k3", "FRAGMENT")
_lib.define("stream_fork(Tensor(a)[] xs, int stream_id) -> Tensor(a)[]")


def stream_fork(xs: list[torch.Tensor], stream_id: int) -> list[torch.Tensor]:
    device = cuda_device(xs)
    if device is not None:
        hand_over(side_stream(device, stream_id), torch.cuda.current_stream(device))
    return aliases(xs)


def _fake(xs: list[torch.Tensor], stream_id: int) -> list[torch.Tensor]:
    return aliases(xs)


_lib.impl("stream_fork", stream_fork, "CompositeExplicitAutograd")
_lib.impl("stream_fork", _fake, "Meta")
