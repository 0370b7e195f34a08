"""Vectorised row access (device code; import only where `cutlass` is present).

A row of `dim` elements is viewed as (vec, n_vec) with vec = 16 bytes of elements; thread t of a
CTA of `threads` owns vectors t, t + threads, t + 2 * threads, ... (coalesced 16-byte accesses).
Register fragments are (vec, vec_per_thread).
"""

import cutlass
from cutlass import const_expr, cute


def vec_len(dtype) -> int:
    return 128 // dtype.width


def row_vectors(mX: cute.Tensor, row) -> cute.Tensor:
    """mX (rows, dim) -> gX (vec, n_vec): 16-byte vectors of one row."""
    return cute.zipped_divide(mX[row, None], (vec_len(mX.element_type),))


def vectors(mX: cute.Tensor, vec: int | None = None) -> cute.Tensor:
    """mX (dim,) -> (vec, n_vec); `vec` elements a vector where another tensor's vectors set the
    split (e.g. bf16 beside fp32: 8-byte vectors), else 16 bytes of them."""
    return cute.zipped_divide(mX, (vec or vec_len(mX.element_type),))


def make_frag(dtype, vec_per_thread: int, vec: int | None = None) -> cute.Tensor:
    return cute.make_rmem_tensor(cute.make_layout((vec or vec_len(dtype), vec_per_thread)), dtype)


@cute.jit
def load_vectors(gX: cute.Tensor, rX: cute.Tensor, tidx, threads: cutlass.Constexpr[int],
                 n_vec: cutlass.Constexpr[int], first=0):
    """gX (vec, first + n_vec + ...) -> rX (vec, V): vectors first .. first + n_vec - 1 of the row
    (`first` may be a runtime value). Slots past n_vec are zero-filled."""
    for j in cutlass.range_constexpr(cute.size(rX, mode=[1])):
        if const_expr((j + 1) * threads <= n_vec):
            cute.autovec_copy(gX[None, first + j * threads + tidx], rX[None, j])
        else:
            rX[None, j].fill(0)
            if j * threads + tidx < n_vec:
                cute.autovec_copy(gX[None, first + j * threads + tidx], rX[None, j])


@cute.jit
def store_vectors(rX: cute.Tensor, gX: cute.Tensor, tidx, threads: cutlass.Constexpr[int],
                  n_vec: cutlass.Constexpr[int], first=0):
    """rX (vec, V) -> vectors first .. first + n_vec - 1 of gX; slots past n_vec are not written."""
    for j in cutlass.range_constexpr(cute.size(rX, mode=[1])):
        if const_expr((j + 1) * threads <= n_vec):
            cute.autovec_copy(rX[None, j], gX[None, first + j * threads + tidx])
        else:
            if j * threads + tidx < n_vec:
                cute.autovec_copy(rX[None, j], gX[None, first + j * threads + tidx])


def bf16_halves(x: cute.TensorSSA):
    """bf16 values -> (even, odd) elements as fp32, widened with integer ops on the packed pairs
    (bf16 is the top half of an fp32)."""
    words = x.bitcast(cutlass.Uint32)
    return (words * cutlass.Uint32(65536)).bitcast(cutlass.Float32), \
        (words & cutlass.Uint32(0xFFFF0000)).bitcast(cutlass.Float32)
