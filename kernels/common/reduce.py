"""Warp, block and cluster sums (device code; import only where `cutlass` is present)."""

import operator

import cutlass
from cutlass import AddressSpace, Float32, Int32, const_expr, cute
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def store_to_peer(val: Float32, ptr: cute.Pointer, peer, *, loc=None, ip=None) -> None:
    """st.shared::cluster of one fp32 to the same smem address in cluster CTA `peer`."""
    remote = nvvm.mapa(llvm.PointerType.get(AddressSpace.dsmem), ptr.to_llvm_ptr(loc=loc, ip=ip),
                       Int32(peer).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    llvm.store(Float32(val).ir_value(loc=loc, ip=ip), remote, loc=loc, ip=ip)


@cute.jit
def block_sum(vals: list, sbuf: cute.Tensor, n_warps: cutlass.Constexpr[int]) -> list:
    """Sum each fp32 value over the CTA; every thread gets the totals. One barrier.
    sbuf: smem (n_warps, len(vals)) fp32, used by this call only."""
    return row_sum(vals, sbuf, n_warps, 1, False)


@cute.jit
def row_sum(vals: list, sbuf: cute.Tensor, n_warps: cutlass.Constexpr[int],
            cluster_n: cutlass.Constexpr[int], first_cluster_use: cutlass.Constexpr[bool]) -> list:
    """Sum each fp32 value over the CTA, or over every CTA of a (cluster_n, 1, 1) cluster; every
    thread gets the totals.

    sbuf: smem (cluster_n * n_warps, len(vals)) fp32, used by this call only. Each warp's totals
    go to row (rank * n_warps + warp) of every CTA's sbuf (remote stores through DSMEM), behind
    one CTA barrier or one cluster barrier (release/acquire). `first_cluster_use`: this call
    ends the cluster_arrive_relaxed() the kernel issued at its start, so that no CTA writes into
    a peer's shared memory before the peer runs.
    """
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    n_vals = len(vals)
    rows = cluster_n * n_warps
    vals = [cute.arch.warp_reduction(v, operator.add) for v in vals]
    out = vals
    if const_expr(rows > 1):
        if const_expr(cluster_n == 1):
            if lane == 0:
                for k in cutlass.range_constexpr(n_vals):
                    sbuf[warp, k] = vals[k]
            cute.arch.barrier()
        else:
            if const_expr(first_cluster_use):
                cute.arch.cluster_wait()
            rank = cute.arch.block_idx_in_cluster()
            if lane < cluster_n:  # lane p writes this warp's totals into CTA p
                for k in cutlass.range_constexpr(n_vals):
                    offset = cute.crd2idx((rank * n_warps + warp, k), sbuf.layout)
                    store_to_peer(vals[k], sbuf.iterator + offset, lane)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        out = column_sums(sbuf, rows, n_vals)
    return out


@cute.jit
def column_sums(sbuf: cute.Tensor, rows: cutlass.Constexpr[int],
                n_vals: cutlass.Constexpr[int]) -> list:
    """The sum of each column of sbuf (rows, n_vals) fp32 smem, rows added in order; every
    thread gets the totals (call behind the barrier that published the rows)."""
    lane = cute.arch.lane_idx()
    out = []
    if const_expr(n_vals >= 4):
        # Lane k adds up column k, then every lane collects the columns by shuffles.
        col = Float32(0.0)
        if lane < n_vals:
            for r in cutlass.range_constexpr(rows):
                col = col + sbuf[r, lane]
        for k in cutlass.range_constexpr(n_vals):
            out.append(cute.arch.shuffle_sync(col, k))
    else:
        # Every warp re-reduces the rows (lanes past them add zeros; all lanes get the sum).
        for k in cutlass.range_constexpr(n_vals):
            t = Float32(0.0)
            for r0 in cutlass.range_constexpr(0, rows, 32):
                if r0 + lane < rows:
                    t = t + sbuf[r0 + lane, k]
            out.append(cute.arch.warp_reduction(t, operator.add))
    return out
