"""Rule `norm_round`: an RMSNorm over fp32 activations whose result is rounded to bf16 / fp16
-> the same norm over the activations rounded to that dtype first, the canonical form
(`k3compile.math.rms_norm` normalises `x.float()` of an x in the activations' dtype; KDA's
per-head output norm in `patterns/kda_decode.py` rounds the recurrence's fp32 output so).

    y = convert(x * rsqrt(mean(x², -1, keepdim) + eps), D)              x fp32, not an upcast of D
    ->  x' = convert(convert(x, D), fp32);  y = convert(x' * rsqrt(mean(x'², -1, keepdim) + eps), D)

To rounding, not exact: rounding x to D moves each element by at most half an ulp of D
(relative 2^-9 in bf16) and the norm is invariant to x's scale, so the normalised row moves by
at most about one ulp of D before it is rounded to D anyway: the rounded norm differs from the
user's by at most one ulp of D in an element, two after a product with the weight that rounds
again (checked on random rows in tests/canonical/test_norm_round.py). Taken only where the normalised row has one use, its
rounding to D, so no fp32 reader sees another value. Left alone: x already an upcast of D (the
canonical form: rounding it again changes nothing), a norm kept in fp32, a mean over another dim.
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import CAST, LOW, VIEWS, root, shape, val
from k3compile.graph import call

aten = torch.ops.aten


def _squared(node, x) -> bool:
    return isinstance(node, fx.Node) and node.args[0] is x and (
        (node.target is aten.mul.Tensor and node.args[1] is x)
        or (node.target is aten.pow.Tensor_Scalar and node.args[1] == 2))


def inv_rms(node, x) -> bool:
    """node is rsqrt(mean(x², -1, keepdim) + eps)."""
    if not (isinstance(node, fx.Node) and node.target is aten.rsqrt.default):
        return False
    add = node.args[0]
    if add.target is not aten.add.Tensor or not isinstance(add.args[1], float):
        return False
    mean = add.args[0]
    if mean.target is not aten.mean.dim or len(mean.args) < 3 or not mean.args[2]:
        return False
    return (list(mean.args[1]) in ([-1], [len(shape(x)) - 1])
            and _squared(mean.args[0], x))


def _site(mul: fx.Node) -> fx.Node | None:
    """x, where mul is an fp32 RMSNorm of x rounded to bf16 / fp16 as its one use."""
    if len(mul.users) != 1 or val(mul) is None or val(mul).dtype != torch.float32:
        return None
    (cast,) = mul.users
    if cast.target is not CAST or cast.args[1] not in LOW:
        return None
    for x, inv in (mul.args, reversed(mul.args)):
        if isinstance(x, fx.Node) and shape(x) == shape(mul) and inv_rms(inv, x):
            source = root(x, VIEWS)
            if (source.op == "call_function" and source.target is CAST
                    and val(source.args[0]) is not None
                    and val(source.args[0]).dtype == cast.args[1]):
                return None  # already normalises an upcast of D
            return x
    return None


def _write(graph: fx.Graph, node: fx.Node, x: fx.Node) -> None:
    dtype = next(iter(node.users)).args[1]
    inv = node.args[1] if node.args[0] is x else node.args[0]
    square = inv.args[0].args[0].args[0]
    with graph.inserting_before(square):
        low = call(graph, CAST, (x, dtype), like=node)
        rounded = call(graph, CAST, (low, torch.float32), like=node)
    for reader in (square, node):
        reader.replace_input_with(x, rounded)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.mul.Tensor}, tidy=False)


RULE = Rule("norm_round", apply,
            "fp32 RMSNorm of fp32 x rounded to bf16/fp16 -> the norm of x rounded to that dtype "
            "(to rounding)")

__all__ = ["RULE", "apply"]
