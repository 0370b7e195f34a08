"""A pure-Python model of moe_one_launch's protocol (kernels/device/moe_one_launch.py), CPU only:
CTAs start as resident slots free up, each takes a ticket on the slot's ticket word, FC1 items
run and add 1 to their token's count, FC2 items wait for their token's count, run and arrive;
the last arrival resets the words. The numbers are the host's: `configs` at the bucket, the
grid, the counter layout (`TICKET_WORD`, `arrival_word`, `arrivals`, `slot_words`), and the
CTAs an SM holds (registers of the sm_90a builds, docs/kernels.md, moe_experts, 2026-12-04;
`shared_bytes`). Issue 21: at 2 rows the kernel hung on the H200, at 1 row it did not."""

import heapq
import random
from dataclasses import dataclass, field

import pytest
from k3compile.kernels import moe_one_launch
from k3compile.kernels.common.last_cta import SLOT_WORDS

from tests.fusions.test_moe_experts_kernel import INTER, LATENT

SMS = 132  # H200
# registers of the sm_90a builds (2026-12-04, session 17), by block and rows: "fc1" 74 at one
# row (FC1 by cp.async), 133 at 2-8 (docs/kernels.md's 72 and 130 hold as many CTAs per SM);
# "fc2" (256 threads at top-16) 78 and 132
REGISTERS = {"fc1": {1: 74, 2: 133, 4: 133, 8: 133}, "fc2": {1: 78, 2: 132, 4: 132, 8: 132}}


def ctas_per_sm(regs: int, threads: int, smem: int) -> int:
    """sm_90's limits: 64K registers in units of 256 per warp, 228 KB of shared memory with 1 KB
    reserved per CTA, 2048 threads, 32 CTAs."""
    warps = threads // 32
    by_regs = 65536 // (-(-regs * 32 // 256) * 256) // warps
    return min(by_regs, 228 * 1024 // (smem + 1024), 2048 // threads, 32)


@dataclass(frozen=True)
class Layout:
    """Where a launch of N rows keeps its ticket, its arrivals, and how many arrivals end it."""

    ticket_word: int
    arrival_word: object  # n_rows -> word
    arrivals: object  # (n_rows, FC1 items per token, FC2 items per token) -> count
    resets_ticket: bool  # the last CTA sets the ticket word to 0 (arrive resets its own word)


# before the fix (2026-12-04, hfc): the FC2 items arrive on the ticket word
SHARED = Layout(0, lambda n: 0, lambda n, f1, b2: n * (f1 + 2 * b2), False)


def host_layout() -> Layout:
    m = moe_one_launch
    return Layout(m.TICKET_WORD, m.arrival_word, m.arrivals,
                  m.arrival_word(1) != m.TICKET_WORD)


@dataclass
class Run:
    grid: int
    fc1_items: int
    resident: int
    done: set = field(default_factory=set)  # tickets whose item finished
    spinning: list = field(default_factory=list)  # (ticket, word it waits on, value it wants)
    words: list = field(default_factory=list)  # the slot at the end

    @property
    def hung(self) -> bool:
        return bool(self.spinning)


def simulate(n_rows, top_k, layout, seed=0, block="fc1", latent=LATENT, inter=INTER) -> Run:
    """One launch; times in µs drawn per CTA (FC1 item 2-6, FC2 item 1-3 after its wait, a CTA
    starts 0.05 after a slot frees). Ends when no CTA can move."""
    fc1, fc2 = moe_one_launch.configs(latent, inter, top_k, n_rows, block)
    b1 = -(-inter // (fc1.warps * fc1.rows_per_warp))
    b2 = -(-latent // fc2.rows_per_cta)
    k_b1 = top_k * b1
    fc1_items, grid = n_rows * k_b1, n_rows * (k_b1 + b2)
    smem = moe_one_launch.shared_bytes(latent, inter, top_k, fc1, fc2)
    resident = SMS * ctas_per_sm(REGISTERS[block][n_rows], fc1.threads, smem)
    run = Run(grid, fc1_items, resident)
    words = [0] * SLOT_WORDS
    rng = random.Random(seed)
    events, waiting, started = [], [], 0  # events: (time, seq, ticket, kind)
    arrival_word = layout.arrival_word(n_rows)
    assert arrival_word < SLOT_WORDS and n_rows < SLOT_WORDS

    def start(now):
        nonlocal started
        started += 1
        t = words[layout.ticket_word]
        words[layout.ticket_word] += 1
        if t < fc1_items:
            heapq.heappush(events, (now + rng.uniform(2, 6), t, t, "fc1"))
        else:
            n = (t - fc1_items) // b2
            waiting.append((t, 1 + n, k_b1))

    def wake(now):
        for w in [w for w in waiting if w[1] < SLOT_WORDS and words[w[1]] >= w[2]]:
            waiting.remove(w)
            heapq.heappush(events, (now + rng.uniform(1, 3), w[0], w[0], "fc2"))

    for i in range(min(resident, grid)):
        start(0.05 * i / SMS)
    now = 0.0
    while events:
        now, _, t, kind = heapq.heappop(events)
        if kind == "fc1":
            words[1 + t // k_b1] += 1
        else:
            old = words[arrival_word]
            words[arrival_word] += 1
            if old == layout.arrivals(n_rows, k_b1, b2) - 1:  # the last CTA
                words[arrival_word] = 0
                if layout.resets_ticket:
                    words[layout.ticket_word] = 0
                for i in range(n_rows):
                    words[1 + i] = 0
        run.done.add(t)
        if started < grid:
            start(now + 0.05)
        wake(now)
    run.spinning, run.words = waiting, words
    return run


@pytest.mark.parametrize("block", ["fc1", "fc2"])
@pytest.mark.parametrize("top_k", [8, 16])
@pytest.mark.parametrize("n_rows", [1, 2, 8])
def test_the_model_hangs_where_the_h200_did(n_rows, top_k, block):
    """Before the fix: 1 row ran on the H200 (both blocks at top-16), 2 rows hung (top-8 and
    top-16; the benchmark's block "fc2" at 2 rows was not reached). In the
    model an FC2 item exits (arrives on the ticket word) before the last CTA started, that CTA
    takes a ticket one too high: past the grid's items, a token N or more, whose count no FC1
    item adds to. Forced whenever the FC2 items (N·B2) outnumber the CTAs that fit at once."""
    for seed in range(3):
        run = simulate(n_rows, top_k, SHARED, seed, block)
        assert run.hung == (n_rows > 1), run.spinning
        assert run.hung == (run.grid - run.fc1_items > run.resident)
        if run.hung:
            assert all(t >= run.grid and word > n_rows for t, word, _ in run.spinning)
            assert len(run.done) < run.grid  # FC2 items never run: wrong rows too


@pytest.mark.parametrize("block", ["fc1", "fc2"])
@pytest.mark.parametrize("top_k", [8, 16])
@pytest.mark.parametrize("n_rows", [1, 2, 4, 8])
def test_the_host_layout_completes(n_rows, top_k, block):
    """The host's counter layout: every work item runs once, no CTA is left waiting, every word
    of the slot is 0 for the next launch, and the layout fits the stream's slot."""
    assert moe_one_launch.slot_words(n_rows) <= SLOT_WORDS
    assert moe_one_launch.arrival_word(n_rows) < moe_one_launch.slot_words(n_rows)
    for seed in range(3):
        run = simulate(n_rows, top_k, host_layout(), seed, block)
        assert not run.hung, run.spinning[:4]
        assert run.done == set(range(run.grid))
        assert not any(run.words), run.words
