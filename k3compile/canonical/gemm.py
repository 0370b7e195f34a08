"""Rule `gemm`: every spelling of a projection x·Wᵀ by a weight W (a graph input) as what
`F.linear(x, W)` traces to, `mm(x2d, permute(W, [1, 0]))`, with views to and from 2-D.

A K3 written elsewhere spells its projections as `bmm` against `W.t().expand(B, ...)`, `einsum`
("btd,ed->bte": unsqueeze/permute/view around a bmm of batch 1), `W @ x.unsqueeze(-1)` (matmul
folds it into an mm of a permuted x and transposes the result back), `torch.inner`/`tensordot`
(identity permutes before the view), or one `bmm` over a weight stack [G, N, K] of the input
expanded G times (q|k|v "lowered to bmm"). The patterns (linear, linear_concat, norm_linear,
moe_front, ...) match only the F.linear form, so each such GEMM becomes:

    x2d = view(x, [R, K])           (absent where x is already [R, K])
    y   = mm(x2d, permute(W, [1, 0]))     W: the weight input, or select/slice of it
    out = view(y, out_shape)        the GEMM's result as its consumers saw it

and a stacked bmm becomes G such mm's, one per `select(W, 0, g)` (or row slice).

Matching is structural and by layout, not by spelling: the operands' chains of view ops
(view, permute, expand, unsqueeze, select, slice, ...) are replayed on meta tensors, which gives
each operand's strides over its root in logical index space. A GEMM is a projection when one
operand is, per batch, exactly Wᵀ of one [N, K] piece of a weight root (K contiguous), and the
other is a row-major [R, K] reshape of an activation (or that same activation expanded for a
stack); the activation root is the farthest ancestor through views that still is one, so that
several projections of one input share it as the F.linear form does. The result's own chain of
views is collapsed the same way to `view(y, shape)` where it is a plain reshape of y.

Left alone: GEMMs whose "weight" operand is not a view of a graph input, or is one the graph
writes (state buffers: MLA's q·cacheᵀ, the delta rule's state products), batched GEMMs of
per-batch inputs and weights (MLA's per-head absorption, attention), weights laid out [K, N],
and mm's already in the F.linear form (our model's own graph is left exactly as it is).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch import fx

from k3compile.canonical import Rule, rewrite_sites
from k3compile.canonical.region import static_shape as _shape
from k3compile.graph import RESHAPES, call, written_in_place

aten = torch.ops.aten

# view ops whose result is a function of their input's elements only (replayed on meta tensors);
# the reshapes among them are replayed as `view`, which refuses where a copy would be needed
VIEWS = RESHAPES | {
    aten.permute.default, aten.t.default, aten.transpose.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
    aten.select.int, aten.slice.Tensor, aten.alias.default,
}
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One [N, K] piece of a weight root: `W[g][n0:n0+n, k0:k0+k]` (g None for a 2-D root)."""

    root: fx.Node
    g: int | None
    n0: int
    n: int
    k0: int
    k: int


@dataclasses.dataclass
class Site:
    node: fx.Node  # the mm or bmm
    x: fx.Node  # activation root
    rows: int  # R: rows of x2d
    pieces: list[Piece]  # one (broadcast) or one per batch (stack)
    transposed: bool  # the weight was the first operand: the GEMM computed (x·Wᵀ)ᵀ


# ---- layouts on meta tensors ------------------------------------------------------------------

def _is_view(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in VIEWS
            and not any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values())))


def _chain(node: fx.Node) -> list[fx.Node]:
    """[root, v1, ..., node]: node's ancestors through view ops, the first one not a view."""
    chain = [node]
    while _is_view(chain[0]):
        chain.insert(0, chain[0].args[0])
    return chain


def _replay(base: torch.Tensor, ops: list[fx.Node]) -> torch.Tensor | None:
    """ops applied to a meta tensor (each op's first argument replaced); None where a reshape
    would have to copy (its result would no longer be a view of `base`)."""
    t = base
    try:
        for op in ops:
            target = aten.view.default if op.target in RESHAPES else op.target
            t = target(t, *op.args[1:], **op.kwargs)
    except RuntimeError:
        return None
    return t


def _meta(shape) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements of one base in the same logical order (strides of size-1 dims aside)."""
    return (a.shape == b.shape and a.storage_offset() == b.storage_offset()
            and all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n != 1))


def _is_reshape_of(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t.numel() == base.numel() and _same_layout(t, base.view(t.shape))


# ---- the weight operand -----------------------------------------------------------------------

def _pieces(w_op: fx.Node, transposed: bool, batched: bool) -> list[Piece] | None:
    """Per batch, the weight piece the operand is the transpose of; None if it is not one."""
    chain = _chain(w_op)
    root, shape = chain[0], _shape(chain[0])
    if (root.op != "placeholder" or root.meta.get("k3_user_input") or shape is None
            or len(shape) not in (2, 3) or written_in_place(root) or root.meta["val"].dtype not in FLOATS):
        return None
    t = _replay(_meta(shape), chain[1:])
    if t is None:
        return None
    t = t if batched else t.unsqueeze(0)
    t = t.transpose(1, 2) if transposed else t  # [Bt, K, N]: per batch Wpieceᵀ
    _, k, n = t.shape
    wn, wk = shape[-2:]
    if (k > 1 and t.stride(1) != 1) or (n > 1 and t.stride(2) != wk):
        return None
    pieces = []
    for b in range(t.shape[0] if t.stride(0) else 1):
        g, rest = divmod(t.storage_offset() + b * t.stride(0), wn * wk)
        n0, k0 = divmod(rest, wk)
        if n0 + n > wn or k0 + k > wk or (g and len(shape) == 2):
            return None
        pieces.append(Piece(root, g if len(shape) == 3 else None, n0, n, k0, k))
    return pieces


# ---- the activation operand -------------------------------------------------------------------

def _x_layout(x2d: torch.Tensor, out_batch: int | None, stacked: bool, transposed: bool):
    """The activation operand as a function of x2d [R, K]."""
    if out_batch is None:
        return x2d.t() if transposed else x2d
    rows, k = x2d.shape
    t = (x2d.unsqueeze(0).expand(out_batch, rows, k) if stacked
         else x2d.view(out_batch, rows // out_batch, k))
    return t.transpose(1, 2) if transposed else t


def _activation(x_op: fx.Node, k: int, out_batch: int | None, stacked: bool,
                transposed: bool) -> tuple[fx.Node, int] | None:
    """(x, R): the farthest ancestor of the operand through views that is an [.., K] tensor whose
    row-major [R, K] reshape the operand reads as the GEMM's rows."""
    chain = _chain(x_op)
    for i, node in enumerate(chain):
        shape = _shape(node)
        if shape is None or not shape or shape[-1] != k:
            continue
        rows = math.prod(shape) // k
        if out_batch is not None and not stacked and rows % out_batch:
            continue
        base = _meta(shape)
        got = _replay(base, chain[i + 1:])
        if got is not None and _same_layout(
                got, _x_layout(base.view(rows, k), out_batch, stacked, transposed)):
            return node, rows
    return None


# ---- sites ------------------------------------------------------------------------------------

def _canonical(node: fx.Node) -> bool:
    """An mm already in the F.linear form: x (or a `view` of a non-view-op or of a view) times
    permute(W, [1, 0]), W a weight or a select/slice of one."""
    x, wt = node.args
    if not (wt.target is aten.permute.default and list(wt.args[1]) == [1, 0]):
        return False
    w = wt.args[0]
    while isinstance(w, fx.Node) and w.target in (aten.select.int, aten.slice.Tensor):
        w = w.args[0]
    if not (isinstance(w, fx.Node) and w.op == "placeholder"):
        return False
    if not _is_view(x):
        return True
    return x.target is aten.view.default and not (_is_view(x.args[0])
                                                  and x.args[0].target is not aten.view.default)


def _site(node: fx.Node) -> Site | None:
    batched = node.target is aten.bmm.default
    out = _shape(node)
    if out is None or node.meta["val"].dtype not in FLOATS:
        return None
    out_batch = out[0] if batched else None
    k = _shape(node.args[0])[-1] if _shape(node.args[0]) else None
    sites = []
    for w_index in (1, 0):
        transposed = w_index == 0
        pieces = _pieces(node.args[w_index], transposed, batched)
        if pieces is None:
            continue
        x = _activation(node.args[1 - w_index], k, out_batch, len(pieces) > 1, transposed)
        if x is not None:
            sites.append(Site(node, x[0], x[1], pieces, transposed))
    # an input tensor may pass for a weight stack of one row per batch: one weight read by
    # every batch is the likelier projection
    return min(sites, key=lambda site: len(site.pieces), default=None)


# ---- rewriting --------------------------------------------------------------------------------

def _weight_t(graph: fx.Graph, piece: Piece, like: fx.Node) -> fx.Node:
    """permute(W[g][n0:n0+n, k0:k0+k], [1, 0]), as F.linear on that piece traces."""
    w = piece.root
    if piece.g is not None:
        w = call(graph, aten.select.int, (w, 0, piece.g), like=like)
    wn, wk = w.meta["val"].shape
    if (piece.n0, piece.n) != (0, wn):
        w = call(graph, aten.slice.Tensor, (w, 0, piece.n0, piece.n0 + piece.n), like=like)
    if (piece.k0, piece.k) != (0, wk):
        w = call(graph, aten.slice.Tensor, (w, 1, piece.k0, piece.k0 + piece.k), like=like)
    return call(graph, aten.permute.default, (w, [1, 0]), like=like)


def _reshaped(graph: fx.Graph, src: fx.Node, shape, like: fx.Node) -> fx.Node:
    if tuple(src.meta["val"].shape) == tuple(shape):
        return src
    return call(graph, aten.view.default, (src, list(shape)), like=like)


def _views_below(node: fx.Node) -> list[fx.Node]:
    """node's single-user chain of view ops: [node, v1, v2, ...]."""
    chain = [node]
    while len(chain[-1].users) == 1:
        user = next(iter(chain[-1].users))
        if not (_is_view(user) and user.args[0] is chain[-1]):
            break
        chain.append(user)
    return chain


def _settle(graph: fx.Graph, y: fx.Node, head: fx.Node, head_of_y: list, like: fx.Node) -> None:
    """Replace `head` (a value equal to y through the view ops `head_of_y`, (target, args)
    pairs) and the single-user view chain below it: its farthest node that is a plain reshape
    of y with y's last dim becomes view(y, shape); `head`, where still used, y through
    `head_of_y`."""
    chain = _views_below(head)
    base = _meta(tuple(y.meta["val"].shape))
    t, last = base, None
    for target, args in head_of_y:
        t = target(t, *args)
    for i, node in enumerate(chain):
        t = _replay(t, [node]) if i else t
        if t is None:
            break
        if _is_reshape_of(t, base) and t.shape[-1] == base.shape[-1]:
            last = i
    if last is not None:
        with graph.inserting_before(chain[last]):
            chain[last].replace_all_uses_with(
                _reshaped(graph, y, tuple(chain[last].meta["val"].shape), like))
        for node in reversed(chain[1:last + 1]):
            graph.erase_node(node)
    if head.users:
        with graph.inserting_before(head):
            for target, args in head_of_y:
                y = call(graph, target, (y, *args), like=like)
        head.replace_all_uses_with(y)


def _rewrite(graph: fx.Graph, _, site: Site) -> None:
    node = site.node
    k = site.pieces[0].k
    with graph.inserting_before(node):
        # a view of x per mm, as each F.linear traces (a shared one would tie the mm's together)
        ys = [call(graph, aten.mm.default, (_reshaped(graph, site.x, (site.rows, k), node),
                                            _weight_t(graph, p, node)), like=node)
              for p in site.pieces]
    if len(ys) == 1:
        _settle(graph, ys[0], node, _output_of(node, site.transposed), node)
    else:
        _settle_stack(graph, site, ys)
    if not node.users:
        graph.erase_node(node)


def _output_of(node: fx.Node, transposed: bool) -> list:
    """The GEMM's result as view ops, (target, args), applied to y [R, N]."""
    shape = tuple(node.meta["val"].shape)
    if len(shape) == 2:
        return [(aten.permute.default, ([1, 0],))] if transposed else []
    batch, m, n = shape[0], *(shape[:0:-1] if transposed else shape[1:])
    ops = [(aten.view.default, ([batch, m, n],))]
    return ops + [(aten.permute.default, ([0, 2, 1],))] if transposed else ops


def _settle_stack(graph: fx.Graph, site: Site, ys: list[fx.Node]) -> None:
    """A stacked bmm: each consumer of one batch (select(·, 0, g), unbind's getitem g) reads
    its own mm; anything else reads the stack of them."""
    node = site.node
    per_y = [(aten.permute.default, ([1, 0],))] if site.transposed else []
    for user in list(node.users):
        if user.target is aten.select.int and user.args[1] in (0, -3):
            _settle(graph, ys[user.args[2] % len(ys)], user, per_y, node)
            graph.erase_node(user)
        elif user.target is aten.unbind.int and (user.args[1:] or (0,))[0] in (0, -3) \
                and all(u.target is operator.getitem for u in user.users):
            for item in list(user.users):
                _settle(graph, ys[item.args[1]], item, per_y, node)
                graph.erase_node(item)
            graph.erase_node(user)
    if node.users:
        with graph.inserting_before(node):
            stack = call(graph, aten.stack.default, (ys,), like=node)
            if site.transposed:
                stack = call(graph, aten.permute.default, (stack, [0, 2, 1]), like=node)
        node.replace_all_uses_with(stack)


def _new_site(node: fx.Node) -> Site | None:
    return None if node.target is aten.mm.default and _canonical(node) else _site(node)


def apply(graph: fx.Graph) -> int:
    return rewrite_sites(graph, _new_site, _rewrite, targets={aten.mm.default, aten.bmm.default},
                         tidy=False)


RULE = Rule("gemm", apply, "bmm/matmul/einsum/@ of a weight input (or a weight stack) -> "
                           "mm(x2d, permute(W, [1, 0])) with views, as F.linear traces")
