"""Rule `head_repeat`: a per-head vector repeated over each head's channels and applied to flat
channels, `a.repeat_interleave(D) * y` on [N, H*D], then viewed per head, -> the product on the
per-head view, `a[:, None] * y.view(..., H, D)`, the form the `kda_decode` pattern computes
KDA's decay in (`exp(A_log).view(H, 1) * (graw.view(B, T, H, D) + dt_bias.view(H, D))`).

spell10 (`tests/models/spell10_k3.py`, a serving engine's KDA) computes the decay on flat rows:
`z = exp(A_log).repeat_interleave(D) * (graw.float() + dt_bias)`, `exp(z.sigmoid_().mul_(b))`,
viewed [B, T, H, D] only for the recurrence (its probe `decay_per_head` is the pattern's form).
`repeat_interleave` traces to `view(clone(expand(unsqueeze(a, 1), [H, D])), [H*D])`, so

    view(f(mul(view(clone(expand(unsqueeze(a, 1), [H, D])), [W]), add(g, bias [W]))), [.., H, D])
    ->  f(mul(unsqueeze(a, 1), add(view(g, [.., H, D]), view(bias, [H, D]))))

with f a chain of elementwise ops (sigmoid, a multiply by a number, exp, ...), each read once,
and views between them that keep the channel dim. Bit for bit: the same elementwise ops on the
same elements (a broadcast of a[h] over head h's D channels is what the repeat wrote out).
Left alone: a vector not repeated per head (`a.repeat(D)`: tiled, another element order), a
product read flat elsewhere, an op between the product and the view that is not elementwise
(a sum, a GEMM), a view that does not split the channels into (H, D).
"""

from __future__ import annotations

import math

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape
from k3compile.graph import RESHAPES, call

aten = torch.ops.aten
_UNARY = {aten.exp.default, aten.sigmoid.default, aten.neg.default, aten.tanh.default,
          aten.reciprocal.default, aten.rsqrt.default, aten.sqrt.default, aten.log.default,
          aten.abs.default}
_SCALAR = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor}


def _repeated(node) -> tuple[fx.Node, int, int] | None:
    """(a, H, D) where node = view(clone(expand(unsqueeze(a [H], 1), [H, D])), [H*D])."""
    if not (isinstance(node, fx.Node) and node.target in RESHAPES):
        return None
    clone = node.args[0]
    expand = clone.args[0] if isinstance(clone, fx.Node) and clone.target is aten.clone.default \
        else clone
    if not (isinstance(expand, fx.Node) and expand.target is aten.expand.default):
        return None
    unsq = expand.args[0]
    if not (isinstance(unsq, fx.Node) and unsq.target is aten.unsqueeze.default
            and unsq.args[1] in (1, -1)):
        return None
    a = unsq.args[0]
    sa, se = shape(a), shape(expand)
    if sa is None or len(sa) != 1 or se is None or len(se) != 2 or se[0] != sa[0]:
        return None
    if list(shape(node)) != [se[0] * se[1]]:
        return None
    return a, se[0], se[1]


def _elementwise(node: fx.Node) -> bool:
    """node is a unary elementwise op or one with a number as its other operand."""
    if node.target in _UNARY:
        return len(node.args) == 1 and not node.kwargs
    if node.target in _SCALAR and len(node.args) == 2 and not node.kwargs:
        tensors = [x for x in node.args if isinstance(x, fx.Node)]
        return len(tensors) == 1
    return False


def _site(mul: fx.Node):
    """(repeat operand index, a, H, D, y, chain, view) where mul = repeat(a) * y [N, H*D], chain
    the elementwise ops (and channel-keeping views) after it, view the per-head view ending it."""
    if len(mul.args) != 2 or mul.kwargs:
        return None
    for i in (0, 1):
        rep, y = mul.args[i], mul.args[1 - i]
        found = _repeated(rep)
        if found is None or not isinstance(y, fx.Node):
            continue
        a, h, d = found
        sy = shape(y)
        if sy is None or len(sy) != 2 or sy[1] != h * d or shape(mul) != sy:
            continue
        chain, node = [], mul
        while len(node.users) == 1:
            (user,) = node.users
            if user.target in RESHAPES and user.args[0] is node:
                out = list(shape(user))
                if out[-2:] == [h, d] and math.prod(out[:-2]) == sy[0]:
                    return i, a, h, d, y, chain, user
                if out[-1] != h * d or math.prod(out[:-1]) != sy[0]:
                    return None
            elif not (_elementwise(user) and user.args[0 if user.args[0] is node else 1] is node):
                return None
            else:
                chain.append(user)
            node = user
        return None
    return None


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    i, a, h, d, y, chain, view = site
    lead = list(shape(view)[:-2])
    with graph.inserting_before(view):
        bias = y.args[1] if y.target is aten.add.Tensor and len(y.args) == 2 else None
        if (isinstance(bias, fx.Node) and shape(bias) == (h * d,) and isinstance(y.args[0], fx.Node)
                and shape(y.args[0]) == shape(y) and not y.kwargs and len(y.users) == 1):
            g = call(graph, aten.view.default, (y.args[0], [*lead, h, d]), like=y)
            b = call(graph, aten.view.default, (bias, [h, d]), like=y)
            per_head = call(graph, aten.add.Tensor, (g, b), like=y)
        else:
            per_head = call(graph, aten.view.default, (y, [*lead, h, d]), like=y)
        col = call(graph, aten.unsqueeze.default, (a, 1), like=node)
        args = (col, per_head) if i == 0 else (per_head, col)
        out = call(graph, aten.mul.Tensor, args, like=node)
        for op in chain:
            # one tensor operand each (`_elementwise`): the chain's previous value
            out = call(graph, op.target,
                       tuple(out if isinstance(x, fx.Node) else x for x in op.args), like=op)
    view.replace_all_uses_with(out)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.mul.Tensor})


RULE = Rule("head_repeat", apply,
            "f(a.repeat_interleave(D) * (g + bias)).view(.., H, D) -> "
            "f(a[:, None] * (g.view(.., H, D) + bias.view(H, D)))")

__all__ = ["RULE", "apply"]
