"""The side streams that k3 ops run on, and the stream hand-overs of `k3.stream_fork` /
`k3.stream_join` (not an op: the runtime those ops and the ops with a `stream` argument share).

Where an op runs is an argument of its call: the ops that a stage puts on a side stream
(`k3.situ_gate_up`, `k3.linear`, `k3.prefetch_l2`) take a keyword-only `int stream=0`, and their
CUDA implementation runs with that side stream current (`on_stream`: launches and allocations).
References and fake implementations ignore it; on CPU it changes nothing. An op that runs between
a fork and its join without the argument runs on the main stream (the `hazards` check of
`k3compile.stages.streams` flags a node whose `meta["k3_stream"]` says otherwise).

Memory (the case for each kind of buffer is in `k3compile.stages.streams`): the join takes the
forked tensors and everything the side stream made, so none of them is reused before the main
stream has waited for the side stream. What a side-stream op returns is marked used by the calling
stream (`record_stream`), so that after the join, once the main stream has used and freed it, a
later side-stream allocation takes the block only after the main stream has passed the free.
Within a CUDA-graph capture the allocator defers such a block's reuse to the capture's end (no
event is recorded during a capture): a little more pool memory, nothing recorded on a joined
stream. The forked tensors need no such mark: the join holds them until the main stream waited.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_leaves

_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, stream_id) -> side stream


def side_stream(device: torch.device, stream_id: int) -> torch.cuda.Stream:
    """The side stream `stream_id` of a device (created once; id 0 is the current stream)."""
    if stream_id == 0:
        return torch.cuda.current_stream(device)
    key = (device.index if device.index is not None else torch.cuda.current_device(), stream_id)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=key[0])
    return _STREAMS[key]


def cuda_device(xs) -> torch.device | None:
    """The device of the first CUDA tensor in xs (None on CPU)."""
    return next((x.device for x in xs if isinstance(x, torch.Tensor) and x.is_cuda), None)


def run_on_stream(stream: int, fn, *args, **kwargs):
    """fn(*args, **kwargs) with side stream `stream` current on the device of the first CUDA
    tensor in args; its tensor outputs marked used by the calling stream (see the module
    docstring). Just the call for stream 0 or without a CUDA tensor (CPU)."""
    device = cuda_device(tree_leaves(args)) if stream else None
    if device is None:
        return fn(*args, **kwargs)
    caller = torch.cuda.current_stream(device)
    with torch.cuda.stream(side_stream(device, stream)):
        out = fn(*args, **kwargs)
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(caller)
    return out


def on_stream(fn):
    """The CUDA implementation of an op with a `stream` argument, from one without it:

        torch.library.register_kernel("k3::op", "cuda", on_stream(flat_rows(op_cuda)))

    The dispatcher passes `stream` only when it is not 0, as a keyword (keyword-only in the
    schemas); an implementation of an op without the argument runs unchanged."""

    @functools.wraps(fn)
    def wrapper(*args, stream: int = 0, **kwargs):
        return run_on_stream(stream, fn, *args, **kwargs)

    return wrapper


def hand_over(waiting: torch.cuda.Stream, recording: torch.cuda.Stream) -> None:
    """`waiting` waits for what `recording` has queued so far."""
    event = torch.cuda.Event()
    event.record(recording)
    waiting.wait_event(event)


def aliases(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh aliases of xs (no copy): what the scheduling ops return."""
    return [x.view_as(x) for x in xs]
