"""Rule `addcmul_split`: `addcmul(S, a, b)` (value 1, fp32 or fp64) -> `S + a * b`, the add and the
product the other rules and the patterns read apart.

The delta rule's rank-1 write `S + k ⊗ u` is spelled `S.addcmul_(k[..., None], u[..., None, :])`
on a [B, H, K, V] state (spell11: a training codebase's in-place update); functionalised it is an
`addcmul`. The canonical form (`k3compile.math.delta_rule_step`) adds the outer product
`k.unsqueeze(-1) * u.unsqueeze(-2)` to the state, which rule `delta_einsum` and `kda_decode`
read.

To rounding: CPU's fp32 `addcmul` is a fused multiply-add (one rounding) where the split rounds
the product, then the sum: within one rounding of the product, |Δ| <= 2^-24·(|a·b| + 2|S + a·b|)
(measured: a fifth of the elements of a random rank-1 write differ, by one ulp;
tests/canonical/test_addcmul_split.py), as `baddbmm_split`'s product. Taken: value 1 in fp32 /
fp64. Left alone: another value (a scaled product), and half precision, where `addcmul` computes
in fp32 and rounds once, the split rounding a bf16 product before the add (not an ulp of the
result's rounding order but the half-precision rounding of a term).
"""

from __future__ import annotations

import functools

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.baddbmm_split import write_sum

aten = torch.ops.aten

_EXACT = (torch.float32, torch.float64)


def _site(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return (len(node.args) == 3 and node.kwargs.get("value", 1) == 1 and set(node.kwargs) <= {"value"}
            and isinstance(val, torch.Tensor) and val.dtype in _EXACT
            and all(isinstance(a, fx.Node) and a.meta.get("val") is not None
                    and a.meta["val"].dtype == val.dtype for a in node.args))


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, functools.partial(write_sum, aten.mul.Tensor),
                         targets={aten.addcmul.default})


RULE = Rule("addcmul_split", apply, "addcmul(S, a, b) (value 1, fp32) -> S + a * b")

__all__ = ["RULE", "apply"]
