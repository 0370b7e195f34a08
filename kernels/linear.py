"""CUDA implementation of `k3::linear`: a plain GEMM that no fusion took.

    y = x · Wᵀ

Constraints:
    * x [N, K] rows, W [O, K]: `router.linear` picks our skinny GEMM, the tensor-core one or cuBLAS
      by shape (each where it takes the inputs).
"""

import torch

from k3compile.ops import registry

from .common.dsl import flat_rows, on_stream
from .common.router import linear

OP = "linear"


def linear_cuda(x, w):
    # x [N, K] rows; w [O, K]
    return linear(x, w)


def register() -> None:
    registry.register_kernel(OP)  # refused inputs take the unfused launches
    torch.library.register_kernel(f"k3::{OP}", "cuda", on_stream(flat_rows(linear_cuda)))
