"""A seeded random request schedule, the way a decode server drives the step.

Requests hold a state slot from their start (position 0, the slot's state zeroed) until they
reach their length; each step draws a batch size within the buckets, starts requests in free
slots when fewer are active, and runs a random subset of the active ones in random order (the
others wait: their state must not move). Every row carries T tokens, so a request's position
advances by T each time it runs, and positions stay within `[0, max_seq_len - T]`.
"""

from __future__ import annotations

import dataclasses
import random

import torch


@dataclasses.dataclass(frozen=True)
class Step:
    index: int
    input_ids: torch.Tensor  # [B] (T = 1) or [B, T]
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B], distinct, never the scratch slot
    started: tuple[int, ...]  # slots whose new request starts at this step (reset before it)
    finished: tuple[int, ...]  # slots freed before this step

    def describe(self) -> str:
        return (f"batch {len(self.slots)}, slots {self.slots.tolist()}, positions "
                f"{self.positions.tolist()}, started {list(self.started)}, "
                f"finished {list(self.finished)}")


def _length(rng: random.Random, T: int, max_seq_len: int) -> int:
    """Tokens a request decodes: mostly a few steps (so requests come and go within the run),
    one in four up to the whole cache (so late positions are reached too)."""
    if rng.random() < 0.25:
        return rng.randint(T, max_seq_len)
    return min(max_seq_len, T * rng.randint(1, 8))


def schedule(seed: int, steps: int, *, max_batch: int, rows: tuple[int, int], max_seq_len: int,
             T: int, vocab: int, start_prob: float = 0.2):
    """`steps` Steps over slots 0..max_batch-1, each of `rows[0]..rows[1]` rows (fewer only
    while fewer requests are active than the slots allow)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    active: dict[int, list[int]] = {}  # slot -> [position, length]
    for index in range(steps):
        finished = tuple(s for s, (pos, length) in active.items() if pos + T > length)
        for s in finished:
            del active[s]
        batch = rng.randint(*rows)
        started = []
        free = [s for s in range(max_batch) if s not in active]
        rng.shuffle(free)
        while free and (len(active) < batch or rng.random() < start_prob):
            slot = free.pop()
            active[slot] = [0, _length(rng, T, max_seq_len)]
            started.append(slot)
        chosen = rng.sample(sorted(active), min(batch, len(active)))
        positions = torch.tensor([active[s][0] for s in chosen])
        for s in chosen:
            active[s][0] += T
        shape = (len(chosen),) if T == 1 else (len(chosen), T)
        yield Step(index, torch.randint(0, vocab, shape, generator=gen), positions,
                   torch.tensor(chosen), tuple(started), finished)
