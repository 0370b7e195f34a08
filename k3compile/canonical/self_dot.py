"""Rule `self_dot`: a sum of squares over the last dim spelled as a self-contraction,
`einsum("...d,...d->...", x, x)`, -> `sum(x * x, [-1])` (keepdim where the contraction's result
is read with a trailing 1), the form rules `square` / `norm_keepdim` / `norm_rms` / `l2_norm`
then read as a norm.

spell13 (`tests/models/spell13_k3.py`, `dot_self`) takes every RMSNorm's mean square, KDA's l2
norms and the AttnRes sources' norms so. einsum lowers it to a bmm of two view chains of x,
[N, 1, D] @ [N, D, 1] (decomposed: `sum(squeeze(view(..x)) * squeeze(view(..x)), [1], True)`),
read back through views to x.shape[:-1]:

    view(permute(view(bmm(view(permute(x)), view(permute(x))))))  ->  sum(mul(x, x), [-1])

Taken only where both operands read the same fp32 tensor x row by row in its own order (checked
on x's element indices through `layout`, so no permuted, sliced or scaled operand passes), the
bmm's [N, 1, 1] result reaches one node of shape x.shape[:-1] (or that with a trailing 1)
through single-user views that keep its order, and nothing else reads the chain.
To rounding: the same D squares summed in the reduction's order instead of the bmm's (all
terms >= 0, so the relative difference is at most (D - 1) fp32 ulps; the test bounds it).
Left alone: products of two tensors, of x with a view of x in another order, reductions over
another dim, bf16 / fp16 (the bmm rounds once, `sum(x * x)` per product).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.layout import Layout, layout, layout_source
from k3compile.canonical.layout import step as layout_step
from k3compile.canonical.region import shape, val
from k3compile.graph import call

aten = torch.ops.aten


def in_order(lay: Layout, numel: int) -> bool:
    """lay reads all `numel` elements of its root in the root's own order, unscaled: its strided
    sub-dims merge into one run of stride 1 from offset 0 (read off the strides, so no index
    tensor is built, fake mode or not)."""
    if lay.offset != 0 or lay.scale != 1.0:
        return False
    runs: list[tuple[int, int]] = []
    for size, stride in (sub for dim in lay.dims for sub in dim if sub[0] != 1):
        if runs and runs[-1][1] == size * stride:
            runs[-1] = (runs[-1][0] * size, stride)
        else:
            runs.append((size, stride))
    return runs == ([(numel, 1)] if numel > 1 else [])


def _chain(node) -> list[fx.Node]:
    """node and the nodes up its chain of view-like ops, nearest first."""
    out = []
    while isinstance(node, fx.Node):
        out.append(node)
        node = layout_source(node)
    return out


def _layout_from(node: fx.Node, stop: fx.Node) -> Layout | None:
    """node as a Layout over `stop`, an ancestor up its view chain."""
    if node is stop:
        return Layout.of_root(stop)
    lay = _layout_from(layout_source(node), stop)
    return None if lay is None else layout_step(node, lay)


def _source(a: fx.Node, b: fx.Node, n: int, d: int) -> fx.Node | None:
    """The nearest node x up both view chains that a and b each read in order, as n rows of d:
    the tensor whose rows are dotted with themselves."""
    b_chain = _chain(b)
    for x in _chain(a):
        if x not in b_chain:
            continue
        v = x.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[-1] != d \
                or v.numel() != n * d:
            continue
        la, lb = _layout_from(a, x), _layout_from(b, x)
        if la is not None and lb is not None and in_order(la, n * d) and in_order(lb, n * d):
            return x
    return None


def _exit(start: fx.Node, want: tuple[int, ...]) -> tuple[fx.Node, bool] | None:
    """The last node of the single-user view chain from `start` (itself included) that holds its
    n sums in order, shaped `want` (keepdim False) or `want + (1,)` (True)."""
    node, found = start, None
    if shape(start) in (want, want + (1,)):
        found = (start, shape(start) != want)
    while len(node.users) == 1:
        (user,) = node.users
        if layout_source(user) is not node:
            break
        node = user
        lay = layout(node)
        if lay is None or lay.root is not start or lay.scale != 1.0:  # a scalar multiple
            break
        if shape(node) in (want, want + (1,)) and in_order(lay, val(start).numel()):
            found = (node, shape(node) != want)
    return found


def _operands(node: fx.Node):
    """(a, b, n, d): node contracts a and b over d per row, n rows: a bmm [n, 1, d] @ [n, d, 1],
    or its decomposition sum(a * b, [-1]) of two [.., d] tensors."""
    if node.target is aten.bmm.default:
        a, b = node.args
        sa, sb = shape(a), shape(b)
        if sa is None or sb is None or len(sa) != 3 or sa[1] != 1 or sb[2] != 1:
            return None
        return a, b, sa[0], sa[2]
    prod, dims = node.args[:2]
    if not (isinstance(prod, fx.Node) and prod.target is aten.mul.Tensor
            and len(prod.users) == 1 and not node.kwargs):
        return None
    a, b = prod.args
    sa = shape(a)
    if (sa is None or shape(b) != sa or len(sa) < 2 or dims is None or len(dims) != 1
            or dims[0] % len(sa) != len(sa) - 1):
        return None
    return a, b, int(torch.Size(sa[:-1]).numel()), sa[-1]


def _site(node: fx.Node):
    found = _operands(node)
    if found is None or val(node).dtype != torch.float32:
        return None
    a, b, n, d = found
    x = _source(a, b, n, d)
    if x is None or (a is x and b is x):
        return None  # not one tensor's rows, or already x * x
    want = tuple(int(s) for s in x.meta["val"].shape[:-1])
    exit_ = _exit(node, want)
    return None if exit_ is None else (x, *exit_)


def _write(graph: fx.Graph, node: fx.Node, site) -> None:
    x, exit_node, keepdim = site
    with graph.inserting_before(exit_node):
        sq = call(graph, aten.mul.Tensor, (x, x), like=exit_node)
        new = call(graph, aten.sum.dim_IntList, (sq, [-1], keepdim), like=exit_node)
    exit_node.replace_all_uses_with(new)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _site, _write, targets={aten.bmm.default, aten.sum.dim_IntList})


RULE = Rule("self_dot", apply,
            "einsum('...d,...d->...', x, x) (a bmm of x's rows with themselves) -> "
            "sum(x * x, [-1])")

__all__ = ["RULE", "apply", "in_order"]
