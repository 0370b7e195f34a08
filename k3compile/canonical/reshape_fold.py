"""Rule `reshape_fold`: a reshape undone by a later one, across elementwise ops -> neither.

Code reshapes a value, computes elementwise on it, and reshapes back (or to the same elements
with a size-1 dim moved):
    out = view(conv, [B, C]); silu(out).unsqueeze(1)              (fla's T=1 short conv step)
    out = stack([view(conv, [B, C])], -1)  = unsqueeze(view(conv, [B, C]), -1)    (T = 1)
where the canonical form (`k3compile/math.py`, `F.silu(conv).to(dtype).transpose(1, 2)`)
computes on the unreshaped value. This rule moves the first reshape past the elementwise ops
between them (they compute the same values in either shape), and replaces the two reshapes by
their composition where that is the identity (dropped) or moves only size-1 dims (the `permute`
a `transpose` of a size-1 dim traces to). Where the composition is any other reshape, nothing is
rewritten: moving a view across ops is then no closer to a canonical form.

The region is every elementwise op, reshape and plain copy computed from one reshape of a
source (and its twins: the same reshape made once per read) and nothing else; it is rewritten
only when it holds an op (a chain of reshapes alone, like F.linear's view of a view, is our
model's own form and stays) and no value in it is read both inside and outside it (a norm's x).
Elementwise: the unary float ops and dtype casts, binary ops with a Python scalar, and binary
ops whose two tensor operands both come from the reshaped value (silu's `x / (1 + exp(-x))`).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import shape as _shape
from k3compile.graph import call

aten = torch.ops.aten

RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims}
UNARY = {aten.neg.default, aten.exp.default, aten.sigmoid.default, aten.silu.default,
         aten.tanh.default, aten.relu.default, aten.gelu.default, aten.rsqrt.default,
         aten.sqrt.default, aten.log.default, aten.abs.default, aten.reciprocal.default,
         aten.expm1.default, aten.log1p.default,
         torch.ops.prims.convert_element_type.default}
BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar,
          aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.pow.Tensor_Scalar,
          aten.rsub.Scalar, aten.maximum.default, aten.minimum.default}


def is_reshape(node: fx.Node) -> bool:
    """A reshape, or a plain copy (`stack` of one traces to unsqueeze + clone): both keep the
    values and their order, and the rewrite drops both."""
    return node.op == "call_function" and (node.target in RESHAPES or (
        node.target is aten.clone.default and not node.kwargs))


def _elementwise_on(node: fx.Node, inside: set[fx.Node]) -> bool:
    """node is elementwise with every tensor operand in `inside` (and only scalars else)."""
    if node.op != "call_function" or node.kwargs.keys() - {"dtype"}:
        return False
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if node.target in UNARY:
        ok = len(tensors) == 1 and node.args[0] is tensors[0]
    elif node.target in BINARY:
        scalars_ok = all(isinstance(a, (int, float, fx.Node)) for a in node.args)
        ok = scalars_ok and len(tensors) >= 1
    else:
        return False
    return ok and all(t in inside for t in tensors)


def _twins(first: fx.Node) -> set[fx.Node]:
    """first and the other reshapes of its source to the same shape (a squeeze per read)."""
    return {u for u in first.args[0].users if is_reshape(u) and _shape(u) == _shape(first)}


def region(first: fx.Node) -> list[fx.Node]:
    """The elementwise ops and reshapes computed from `first` and its twins alone (scalars
    aside), each with first's number of elements, in graph order."""
    inside, numel = _twins(first), first.meta["val"].numel()
    while True:
        grown = {u for n in inside for u in n.users if u not in inside
                 and isinstance(u.meta.get("val"), torch.Tensor)
                 and u.meta["val"].numel() == numel
                 and ((is_reshape(u) and u.args[0] in inside) or _elementwise_on(u, inside))}
        if not grown:
            break
        inside |= grown
    return sorted(inside - _twins(first))  # graph order (fx nodes compare by position)


def _composition(src: tuple[int, ...], dst: tuple[int, ...]) -> list[int] | None:
    """The permutation taking src to dst where dst is src with size-1 dims moved ([] for the
    identity); None for any other reshape."""
    if len(src) != len(dst) or [d for d in src if d != 1] != [d for d in dst if d != 1]:
        return None
    if src == dst:
        return []
    big, ones = [i for i, d in enumerate(src) if d != 1], [i for i, d in enumerate(src) if d == 1]
    it_big, it_ones = iter(big), iter(ones)
    return [next(it_big) if d != 1 else next(it_ones) for d in dst]


def fold(graph: fx.Graph, first: fx.Node, _) -> int:
    source = first.args[0]
    if not all(isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)
               for n in (source, first)):
        return 0
    ops = region(first)
    if not any(not is_reshape(n) for n in ops):
        return 0  # a reshape chain alone (F.linear's view of a view) is left as it is
    twins = sorted(_twins(first))
    inside = {*twins, *ops}
    exits = [n for n in [*twins, *ops] if any(u not in inside for u in n.users)]
    if any(u in inside for n in exits for u in n.users):
        return 0  # a value read both by the region and outside it: not one tube of ops
    perms = [_composition(_shape(source), _shape(n)) for n in exits]
    if not exits or any(p is None for p in perms):
        return 0
    clones = dict.fromkeys(twins, source)
    for node in ops:
        if is_reshape(node):
            clones[node] = clones[node.args[0]]
            continue
        with graph.inserting_before(node):
            clones[node] = call(graph, node.target, fx.map_arg(node.args, lambda a: clones[a]),
                                dict(node.kwargs), like=node)
    for node, perm in zip(exits, perms):
        new = clones[node]
        if perm:
            with graph.inserting_after(new):
                new = call(graph, aten.permute.default, (new, perm), like=node)
        for user in [u for u in node.users if u not in inside]:
            user.replace_input_with(node, new)
    for node in reversed(ops):
        if not node.users:
            graph.erase_node(node)
    return 1


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, is_reshape, fold, tidy=False)


RULE = Rule("reshape_fold", apply,
            "reshape, elementwise ops, reshape back (or a size-1 dim moved) -> the ops unreshaped")
