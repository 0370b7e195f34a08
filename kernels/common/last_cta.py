"""The counters of the "last CTA" one-launch kernels (moe_front_route, oproj_attn_res_mix_norm):
the CTAs of a grid write their results, arrive on a global atomic counter, and the last to
arrive runs the dependent step (device side: kernels/device/last_cta.py). No CTA waits.
moe_one_launch also takes tickets on it, waits on counts in the slot's next words (one per
token) and arrives on the word after them; its last CTA resets all of them.

`SLOT_WORDS` int32 per (device, stream) in a buffer per device (`COUNTER_SLOTS` slots),
allocated and zeroed once, outside any CUDA-graph capture; the last CTA sets the words it used
back to 0 before its grid ends, so every launch (and every replay of a captured one) finds 0. Launches on one stream never
overlap on the counter, whichever of these kernels they are: each CTA arrives after its PDL
wait, i.e. after the previous kernel in the stream, and so after the previous launch's reset;
launches on two streams (a side stream, a graph captured on its own stream) take two slots. A
graph replayed on several streams at once would share its slot: not done here (one replay at a
time).
"""

import torch

COUNTER_SLOTS = 64
SLOT_WORDS = 16
_counters: dict[int, torch.Tensor] = {}  # device index -> int32 [COUNTER_SLOTS·SLOT_WORDS]
_slots: dict[tuple[int, int], int] = {}  # (device index, stream) -> its slot


def counter(device: torch.device, words: int = 1) -> torch.Tensor | str:
    """This stream's counter (an int32 [words] view: the counter, then `words` - 1 more of the
    slot), or why there is none."""
    if not 1 <= words <= SLOT_WORDS:
        return f"{words} counter words (a slot has {SLOT_WORDS})"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _counters:
        if torch.cuda.is_current_stream_capturing():
            return "no counter allocated before CUDA-graph capture (run once uncaptured first)"
        _counters[index] = torch.zeros(COUNTER_SLOTS * SLOT_WORDS, dtype=torch.int32,
                                       device=device)
    key = (index, torch.cuda.current_stream(device).cuda_stream)
    if key not in _slots:
        if len([k for k in _slots if k[0] == index]) >= COUNTER_SLOTS:
            return f"more than {COUNTER_SLOTS} streams launched a last-CTA kernel"
        _slots[key] = len([k for k in _slots if k[0] == index])
    start = _slots[key] * SLOT_WORDS
    return _counters[index][start:start + words]
