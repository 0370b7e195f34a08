"""CUDA implementation of `k3::linear_concat`: one GEMM over the concatenated weights.

    y = x · [W_0; W_1; ...]ᵀ

The reference is already what a GPU should run (the op registers native): on CUDA the GEMM goes
through `router.linear` (our skinny GEMM at one row, cuBLAS above).

Constraints:
    * x [N, D] rows, W_i [N_i, D]; `concatenated` is a view where the `pack` stage stored them
      as one buffer, else a fresh concatenation per call (nothing cached: never stale).
"""

import torch

from k3compile.ops import registry
from k3compile.ops.linear_concat import concatenated

from .common.dsl import flat_rows, on_stream
from .common.router import linear

OP = "linear_concat"


def linear_concat_cuda(x, weights):
    # x [N, D] rows; weights [N_i, D]
    return linear(x, concatenated(list(weights)))


def register() -> None:
    registry.register_kernel(OP, native=True)
    torch.library.register_kernel(f"k3::{OP}", "cuda", on_stream(flat_rows(linear_concat_cuda)))
