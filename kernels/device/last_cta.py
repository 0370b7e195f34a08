"""The device side of the "last CTA" pattern (kernels/common/last_cta.py).

Imports `cutlass` at the top: host modules import this one only in their `build`."""

import cutlass
from cutlass import Int32, cute


@cute.jit
def arrive(mCount: cute.Tensor, ctas: cutlass.Constexpr[int], sLast: cute.Tensor):
    """Every thread fences its result stores (release), the CTA arrives on the counter (thread
    0, acq_rel at GPU scope); the CTA that sees every other one arrived resets the counter for
    the next launch. Returns whether this CTA is the last (the same in every thread); the last
    then fences again (acquire) before it reads the others' results. sLast: (4,) int32 smem."""
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
