"""Scheduling ops that the `streams` and `prefetch` stages insert. They do no math.

    ys = k3.stream_fork(xs, stream_id)   the side stream waits for what the main stream has queued
    ys = k3.stream_join(xs, stream_id)   the main stream waits for what the side stream has queued
    k3.prefetch_l2(weights, nbytes)      read the first nbytes of the weights so they sit in L2

Fork and join return their inputs (aliases: no copy), and the branch consumes the forked values and
the main stream the joined ones, so neither op is dead code and each orders its consumers after
itself. On a GPU they record an event on one stream and make the other wait on it. Which stream
runs the nodes in between is the node's `meta["k3_stream"]`, honoured by the executor
(`k3compile.streams.runner`). On CPU both are identities.

Memory: the join also takes the forked tensors, so they live until the main stream has waited for
the side stream, and no later main-stream allocation can take their blocks while the side stream
still reads them. (`record_stream` would do the same outside CUDA graphs, but inside a capture the
event it records at free time is side-stream work after the join, which the capture refuses.)

`prefetch_l2` returns nothing; it is marked side-effecting so dead-code elimination keeps it. On a
GPU it runs a reduction over the bytes it names (one per weight); on CPU it is a no-op. The join
that closes a prefetch's side stream has no consumer (nothing waits for a prefetch's data), so
`stream_join` is side-effecting too: it still orders the streams, and a capture needs it.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

_lib = torch.library.Library("k3", "FRAGMENT")
_lib.define("stream_fork(Tensor(a)[] xs, int stream_id) -> Tensor(a)[]")
_lib.define("stream_join(Tensor(a)[] xs, int stream_id) -> Tensor(a)[]")

_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, stream_id) -> side stream


def side_stream(device: torch.device, stream_id: int) -> torch.cuda.Stream:
    """The side stream `stream_id` of a device (created once; id 0 is the current stream)."""
    if stream_id == 0:
        return torch.cuda.current_stream(device)
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream_id)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=key[0])
    return _STREAMS[key]


def _cuda_device(xs) -> torch.device | None:
    return next((x.device for x in xs if x.is_cuda), None)


def _hand_over(waiting: torch.cuda.Stream, recording: torch.cuda.Stream) -> None:
    event = torch.cuda.Event()
    event.record(recording)
    waiting.wait_event(event)


def _fork(xs: list[torch.Tensor], stream_id: int) -> list[torch.Tensor]:
    device = _cuda_device(xs)
    if device is not None:
        _hand_over(side_stream(device, stream_id), torch.cuda.current_stream(device))
    return [x.view_as(x) for x in xs]


def _join(xs: list[torch.Tensor], stream_id: int) -> list[torch.Tensor]:
    device = _cuda_device(xs)
    if device is not None:
        _hand_over(torch.cuda.current_stream(device), side_stream(device, stream_id))
    return [x.view_as(x) for x in xs]


def _alias(xs: list[torch.Tensor], stream_id: int) -> list[torch.Tensor]:
    return [x.view_as(x) for x in xs]


_lib.impl("stream_fork", _fork, "CompositeExplicitAutograd")
_lib.impl("stream_join", _join, "CompositeExplicitAutograd")
for _name in ("stream_fork", "stream_join"):
    _lib.impl(_name, _alias, "Meta")


@torch.library.custom_op("k3::prefetch_l2", mutates_args=())
def prefetch_l2(weights: list[torch.Tensor], nbytes: int) -> None:
    """Touch the first nbytes of weights (in order) so the next GEMMs find them in L2."""
    if not weights or not weights[0].is_cuda or nbytes <= 0:
        return
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


@prefetch_l2.register_fake
def _(weights, nbytes):
    return None


has_side_effect(torch.ops.k3.prefetch_l2.default)
has_side_effect(torch.ops.k3.stream_join.default)
