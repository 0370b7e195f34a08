"""Scheduling ops that the `streams` and `prefetch` stages insert, and the `stream` argument of the
ops they put on a side stream. The scheduling ops do no math.

    ys = k3.stream_fork(xs, stream_id)   the side stream waits for what the main stream has queued
    ys = k3.stream_join(xs, stream_id)   the main stream waits for what the side stream has queued
    ys = k3.prefetch_l2(weights, nbytes, stream=s, after=xs)
                                         read the first nbytes of the weights so they sit in L2

Fork and join return their inputs (aliases: no copy), and the branch consumes the forked values and
the main stream the joined ones, so neither op is dead code and each orders its consumers after
itself: in graph order (the aten executor) and in any order Inductor's wrapper picks. On a GPU
they record an event on one stream and make the other wait on it. On CPU both are identities.

Where an op runs is an argument of its call: the ops that a stage puts on a side stream
(`k3.situ_gate_up`, `k3.linear`, `k3.prefetch_l2`) take a keyword-only `int stream=0`, and their
CUDA implementation runs with that side stream current (`on_stream`: launches and allocations).
References and fake implementations ignore it; on CPU it changes nothing. An op that runs between
a fork and its join without the argument runs on the main stream (the `hazards` check of
`k3compile.stages.streams` flags a node whose `meta["k3_stream"]` says otherwise).

Memory (the case for each kind of buffer is in `k3compile.stages.streams`): the join takes the forked
tensors and everything the side stream made, so none of them is reused before the main stream has
waited for the side stream. What a side-stream op returns is marked used by the calling stream
(`record_stream`), so that after the join, once the main stream has used and freed it, a later
side-stream allocation takes the block only after the main stream has passed the free. Within a
CUDA-graph capture the allocator defers such a block's reuse to the capture's end (no event is
recorded during a capture): a little more pool memory, nothing recorded on a joined stream. The
forked tensors need no such mark: the join holds them until the main stream waited.

`prefetch_l2` passes `after` through (aliases): on a side stream it reads the fork's alias and the
join reads its output, so in every order it is launched after the fork and before the join. On
the main stream `after` is empty and the op returns nothing anyone reads; it is marked
side-effecting so dead-code elimination keeps it. On a GPU it runs a reduction over the bytes it
names (one per weight); on CPU it is a no-op. The join that closes a prefetch's side stream has no
consumer (nothing waits for a prefetch's data), so `stream_join` is side-effecting too: it still
orders the streams, and a capture needs it.
"""

from __future__ import annotations

import functools

import torch
from torch.fx.node import has_side_effect
from torch.utils._pytree import tree_leaves

_lib = torch.library.Library("k3", "FRAGMENT")
_lib.define("stream_fork(Tensor(a)[] xs, int stream_id) -> Tensor(a)[]")
_lib.define("stream_join(Tensor(a)[] xs, int stream_id) -> Tensor(a)[]")
_lib.define("prefetch_l2(Tensor[] weights, int nbytes, *, int stream=0, Tensor(a)[]? after=None)"
            " -> Tensor(a)[]")

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
    return next((x.device for x in xs if isinstance(x, torch.Tensor) and x.is_cuda), None)


def run_on_stream(stream: int, fn, *args, **kwargs):
    """fn(*args, **kwargs) with side stream `stream` current on the device of the first CUDA
    tensor in args; its tensor outputs marked used by the calling stream (see the module
    docstring). Just the call for stream 0 or without a CUDA tensor (CPU)."""
    device = _cuda_device(tree_leaves(args)) if stream else None
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


def prefetch_l2(weights: list[torch.Tensor], nbytes: int, *, stream: int = 0,
                after: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Touch the first nbytes of weights (in order) so the next GEMMs find them in L2, on side
    stream `stream` when it is not 0; returns aliases of `after`."""
    if weights and weights[0].is_cuda and nbytes > 0:
        run_on_stream(stream, _touch, weights, nbytes)
    return _prefetch_alias(weights, nbytes, after=after)


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


def _prefetch_alias(weights, nbytes, *, stream=0, after=None):
    return [x.view_as(x) for x in after or ()]


_lib.impl("prefetch_l2", prefetch_l2, "CompositeExplicitAutograd")
_lib.impl("prefetch_l2", _prefetch_alias, "Meta")

has_side_effect(torch.ops.k3.prefetch_l2.default)
has_side_effect(torch.ops.k3.stream_join.default)
