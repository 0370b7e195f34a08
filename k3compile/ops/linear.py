"""`y = k3.linear(x, w, stream=s)`: one GEMM that no fusion took.

    y = x · Wᵀ   [..., N]

A plain GEMM, routed on CUDA to our skinny GEMM (kernels/gemv.py, x1.2-1.8 over cuBLAS at one
row); `stream=s` runs it on side stream s (the shared experts' down GEMM, stage `streams`).
"""

from __future__ import annotations

import torch

from k3compile.ops.side_streams import run_on_stream


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


@torch.library.custom_op("k3::linear", mutates_args=(),
                         schema="(Tensor x, Tensor w, *, int stream=0) -> Tensor")
def linear(x, w, *, stream=0):
    """x [..., K], w [N, K] -> x·wᵀ [..., N] in x's dtype, on CUDA side stream `stream` when it
    is not 0 (stage `streams`). The reference is the very call the unfused graph makes (F.linear
    without bias is mm(x, wᵀ)), so CPU results do not change."""
    return run_on_stream(stream, linear_ref, x, w)


@linear.register_fake
def _(x, w, *, stream=0):
    return x.new_empty((*x.shape[:-1], w.shape[0]))
