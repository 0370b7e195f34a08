"""`InputCheck`, the CuTe DSL kernel of kernels/input_check.py.

Imports `cutlass` at the top: the host module imports this one only in `build`, so importing
the host needs no DSL."""

import cutlass
from cutlass import Int32, Int64, const_expr, cute

from ..common.dsl import pdl_launch_dependents, pdl_wait
from ..input_check import Config

RANGE, SCRATCH, DUPLICATE = 0, 1, 2  # bit 3 * k + check (k3compile/validate.py)


def bit(pred, k: int, check: int):
    return Int32(cutlass.select_(pred, Int32(1 << (3 * k + check)), Int32(0)))


class InputCheck:
    def __init__(self, specs: tuple, cfg: Config, pdl: bool = False):
        self.specs, self.pdl = specs, pdl
        self.threads = cfg.threads
        self.n_warps = cfg.threads // 32
        # sWarp (n_warps,) int32, then each slot input's counted values (numel,) int64
        self.smem_bytes = 16 * -(-4 * self.n_warps // 16) + sum(
            16 * -(-8 * s.numel // 16) for s in specs if s.slots) + 64

    @cute.jit
    def __call__(self, mRows: cute.Tensor, mMask: cute.Tensor, checked, outs, stream):
        # mRows, mMask: (1,) int64; checked[k], outs[k]: (numel_k,) int32 or int64
        self.kernel(mRows, mMask, checked, outs).launch(grid=[1, 1, 1],
                                                        block=[self.threads, 1, 1],
                                                        smem=self.smem_bytes, stream=stream,
                                                        use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mRows: cute.Tensor, mMask: cute.Tensor, checked, outs):
        pdl_launch_dependents(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        sWarp = smem.allocate_tensor(Int32, cute.make_layout((self.n_warps,)), 16)
        sSlots = [smem.allocate_tensor(Int64, cute.make_layout((s.numel,)), 16) if s.slots
                  else None for s in self.specs]
        pdl_wait(self.pdl)  # the inputs and the row count are written by what runs before
        rows = Int64(mRows[0])
        bits = Int32(0)
        for k in cutlass.range_constexpr(len(self.specs)):
            bits = bits | self.check_values(k, checked[k], sSlots[k], rows, tidx)
        if const_expr(any(s.slots for s in self.specs)):
            cute.arch.barrier()  # every slot input's counted values are in shared memory
            for k in cutlass.range_constexpr(len(self.specs)):
                if const_expr(self.specs[k].slots):
                    bits = bits | self.duplicates(k, sSlots[k], tidx)
        total = self.block_or(bits, sWarp)
        if tidx == 0:
            mMask[0] = Int64(total)
        for k in cutlass.range_constexpr(len(self.specs)):
            self.write(k, checked[k], outs[k], total, tidx)

    @cute.jit
    def check_values(self, k: cutlass.Constexpr[int], mT: cute.Tensor, sVals, rows: Int64,
                     tidx) -> Int32:
        """This thread's failed range and scratch checks of input k (elements tidx, tidx + T,
        ...); a slot input's counted values (in range, in a real row; others -1 - i, distinct
        negatives as validate's `_duplicates` writes them) go to sVals."""
        spec, T = self.specs[k], self.threads
        lo, hi = Int64(spec.lo), Int64(spec.hi)
        bits = Int32(0)
        for i in cutlass.range(tidx, spec.numel, T, unroll=1):
            v = Int64(mT[i])
            outside = (v < lo) | (v > hi)
            scratch = v == Int64(spec.scratch if spec.slots else 0)
            counted = (v >= lo) & (v <= hi)
            if const_expr(spec.rows is not None):  # rows past the real batch are padding
                real = Int64(i // (spec.numel // spec.rows)) < rows
                outside, scratch, counted = outside & real, scratch & real, counted & real
            bits = bits | bit(outside, k, RANGE)
            if const_expr(spec.slots):
                bits = bits | bit(scratch, k, SCRATCH)
                sVals[i] = Int64(cutlass.select_(counted, v, Int64(-1) - Int64(i)))
        return bits

    @cute.jit
    def duplicates(self, k: cutlass.Constexpr[int], sVals: cute.Tensor, tidx) -> Int32:
        """DUPLICATE where two of input k's values in sVals are equal (thread: its elements i
        against every j > i)."""
        n, T = self.specs[k].numel, self.threads
        same = Int32(0)
        for i in cutlass.range(tidx, n, T, unroll=1):
            v = sVals[i]
            for j in cutlass.range(i + 1, n, 1, unroll=1):
                same = same | Int32(cutlass.select_(sVals[j] == v, Int32(1), Int32(0)))
        return bit(same != 0, k, DUPLICATE)

    @cute.jit
    def block_or(self, bits: Int32, sWarp: cute.Tensor) -> Int32:
        """OR of every thread's bits; every thread gets it. One barrier."""
        total = cute.arch.warp_redux_sync(bits, "or")
        if const_expr(self.n_warps > 1):
            # warp_idx() is a full-warp shuffle: inside the lane-0 branch lane 0 would wait at
            # it for lanes that wait at the barrier (the hang at 2 warps)
            warp = cute.arch.warp_idx()
            if cute.arch.lane_idx() == 0:
                sWarp[warp] = total
            cute.arch.barrier()
            total = Int32(0)
            for r in cutlass.range_constexpr(self.n_warps):
                total = total | sWarp[r]
        return total

    @cute.jit
    def write(self, k: cutlass.Constexpr[int], mT: cute.Tensor, mOut: cute.Tensor, total: Int32,
              tidx):
        """out = the input where no check failed, else its fill (the scratch slot, or lo)."""
        spec, T = self.specs[k], self.threads
        fill = mT.element_type(spec.fill)
        for i in cutlass.range(tidx, spec.numel, T, unroll=1):
            mOut[i] = mT.element_type(cutlass.select_(total == 0, mT[i], fill))
