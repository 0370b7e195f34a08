"""Rule `square`: a square written as a product with itself, `x * x`, read by a sum or mean over
the last dim (an RMS or L2 norm) -> `x.pow(2)`, the form `math.rms_norm` and `math.l2_norm` trace
to.

A JAX port writes its norms `x * rsqrt(mean(x * x, -1, keepdims=True) + eps)` (spell9; Flax's
RMSNorm squares by `lax.square`, which a port spells `x * x`), where our model and the patterns
(rms_norm, mla_lowrank_norm, attn_res_mix_norm, ...) write `x.pow(2).mean(-1, keepdim=True)`.
`torch.square(x)` already traces to `pow(x, 2)`.

Exact: ATen's `pow(x, 2)` is computed as `x * x` (one rounded product, as the mul) on CPU and
CUDA, and Inductor lowers both to the same multiply; `tests/canonical/test_square.py` checks it
bit for bit in fp32 and bf16. Taken only where both operands are the same node and every reader
of the product is a `mean` / `sum` over the last dim: `x * x` elsewhere (a gate, an energy, a
variance of a centred input read twice) is left as it is.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.graph import call

aten = torch.ops.aten
_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _last_dim_reduction(node: fx.Node, rank: int) -> bool:
    if node.op != "call_function" or node.target not in _REDUCTIONS or len(node.args) < 2:
        return False
    dims = node.args[1]
    return (isinstance(dims, (list, tuple)) and len(dims) == 1
            and dims[0] in (-1, rank - 1) and node.kwargs.get("dtype") is None)


def _site(node: fx.Node) -> fx.Node | None:
    """x, where node = mul(x, x) of a float tensor read only by last-dim sums / means."""
    if len(node.args) != 2 or node.kwargs:
        return None
    x, y = node.args
    val = node.meta.get("val")
    if x is not y or not isinstance(x, fx.Node) or not isinstance(val, torch.Tensor):
        return None
    xval = x.meta.get("val")
    if (val.dtype not in _FLOATS or not isinstance(xval, torch.Tensor)
            or xval.dtype != val.dtype or xval.shape != val.shape):
        return None
    if not node.users or not all(_last_dim_reduction(u, val.dim()) for u in node.users):
        return None
    return x


def _write(graph: fx.Graph, node: fx.Node, x: fx.Node) -> None:
    with graph.inserting_before(node):
        sq = call(graph, aten.pow.Tensor_Scalar, (x, 2), like=node)
    node.replace_all_uses_with(sq)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.mul.Tensor})


RULE = Rule("square", apply, "x * x read by a last-dim mean / sum -> x.pow(2)")
