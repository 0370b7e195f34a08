"""A plain GEMM of a weight that no fusion took -> `k3.linear`, on CUDA `gemv.linear`: our skinny
GEMM at one row (x1.2-1.8 over cuBLAS on the H200 at M = 1), above it whatever `gemv.linear`
routes those rows to (cuBLAS, or the tensor-core kernel where registered).

Registered last: every fusion takes its GEMMs first, and this takes what they leave (in the K3
decode: the dense MLP's down projection, the shared experts' down projection, lm_head; on a device
where a fusion is deferred, its GEMMs too, e.g. f_b without fb_kda_decode; o_proj at W > 1).

`F.linear(x, w)` without a bias is `mm(x, permute(w, [1, 0]))` in the ATen graph (`t` is
decomposed to that permute before our stages; a 3-D x adds a view before and after the mm, which
stay). `w` must be a weight: a graph input (parameter or buffer) the graph does not write; an
activation x activation product is not a linear.

On CPU graphs too: the op's CPU implementation is F.linear, the same mm the graph held, so the
values are unchanged bit for bit, and the graph (and its plan) is the same on every device.

Before: permute(w, [1, 0]), mm(x, ·)
After:  y = k3.linear(x, w)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3compile.graph import written_in_place
from k3compile.rewrite import Pattern, tensor_meta

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def search(x, w):
    return F.linear(x, w)


def replace(x, w):
    return torch.ops.k3.linear(x, w)


def check(match) -> str | None:
    x, w = tensor_meta(match.kwargs["x"]), tensor_meta(match.kwargs["w"])
    if x is None or w is None:
        return "an input has no tensor metadata"
    node = match.kwargs["w"]
    if node.op != "placeholder":
        return f"w is computed in the graph ({node.name}), not a weight input"
    if written_in_place(node):
        return f"w ({node.name}) is state the graph writes in place, not a weight"
    if w.dim() != 2:
        return f"w {list(w.shape)} is not a 2-D weight"
    if x.dtype != w.dtype:
        return f"x is {x.dtype} but w is {w.dtype}"
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} is not a float type"
    return None


def patterns() -> list[Pattern]:
    def example_inputs():
        return [torch.randn(2, 64), torch.randn(32, 64)]

    # "linear[plain]", so that disabled_patterns (a name prefix) can name this one without
    # linear_concat's
    return [Pattern(name="linear[plain]", search=search, replace=replace,
                    example_inputs=example_inputs, op="k3.linear", check=check,
                    distinctive=("mm",))]
