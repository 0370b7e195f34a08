"""The device side of the global counters (kernels/common/last_cta.py): the "last CTA" pattern
(`arrive`), and for a grid whose later CTAs consume earlier ones' results (moe_one_launch) the
dynamic ticket (`ticket`) and the count a consumer waits for (`signal`, `wait_count`).

Imports `cutlass` at the top: host modules import this one only in their `build`."""

import cutlass
from cutlass import Int32, cute


@cute.jit
def arrive(mCount: cute.Tensor, ctas, sLast: cute.Tensor):
    """Every thread fences its result stores (release), the CTA arrives on the counter (thread
    0, acq_rel at GPU scope); the CTA that sees every other one arrived resets the counter for
    the next launch. Returns whether this CTA is the last (the same in every thread); the last
    then fences again (acquire) before it reads the others' results. `ctas`: the arrivals that
    complete the count (an int, or an Int32 known at run time). sLast: (4,) int32 smem."""
    tidx = cute.arch.thread_idx()[0]
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier()
    if tidx == 0:
        arrived = cute.arch.atomic_add(mCount.iterator, Int32(1), sem="acq_rel", scope="gpu")
        last = arrived == Int32(ctas - 1)
        if last:
            cute.arch.atomic_exch(mCount.iterator, Int32(0), sem="relaxed", scope="gpu")
        sLast[0] = Int32(cutlass.select_(last, Int32(1), Int32(0)))
    cute.arch.barrier()
    return sLast[0] != Int32(0)


@cute.jit
def ticket(mCount: cute.Tensor, sTicket: cute.Tensor) -> Int32:
    """This CTA's ticket: the counter's value before thread 0 adds 1 (relaxed: it orders
    nothing), the same in every thread. Tickets go out in the order CTAs start running, so a
    CTA holding ticket t knows every ticket below t is held by a CTA that runs.
    sTicket: (4,) int32 smem."""
    if cute.arch.thread_idx()[0] == 0:
        sTicket[0] = cute.arch.atomic_add(mCount.iterator, Int32(1), sem="relaxed",
                                          scope="gpu")
    cute.arch.barrier()
    return sTicket[0]


@cute.jit
def signal(mCount: cute.Tensor):
    """Every thread fences its result stores, then thread 0 adds 1 to the counter (release at
    GPU scope): a CTA that reads the count (`wait_count`) sees those results."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier()
    if cute.arch.thread_idx()[0] == 0:
        cute.arch.atomic_add(mCount.iterator, Int32(1), sem="release", scope="gpu")


@cute.jit
def wait_count(mCount: cute.Tensor, target):
    """Thread 0 spins until the counter reaches `target` (acquire loads at GPU scope), fences,
    then the CTA barrier: every thread may read what the `signal`ling CTAs wrote."""
    if cute.arch.thread_idx()[0] == 0:
        seen = cute.arch.load(mCount.iterator, Int32, sem="acquire", scope="gpu")
        while seen < target:
            seen = cute.arch.load(mCount.iterator, Int32, sem="acquire", scope="gpu")
        cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier()
